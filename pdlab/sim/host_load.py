"""The main process on the workers' cores: a simulated CPU worker's steps lose the time the router and harness
take from its core, on a box where they have no core of their own.

A run's main process receives every worker step's messages and records them: on the 2-core Xeon 0.22 ms of
its CPU per worker step and 27 us per token, 6-16% of a core (BENCHMARKS.md, 2026-12-03 third session). With
no spare core (`pdlab run` moves it off the workers' cores when there is one) that time comes from a worker's:
each CPU step records its own CPU time (`cpu_s`), and the workers lost 0.6-1.0 of the main process's CPU time
while their steps' own compute stayed at the profile's prediction. It does not come from every worker alike:
a 1P1D decode worker lost 0.2-0.8% of its steps' time, its prefill worker 7-15%; of two unified workers one
lost 10-16%, the other 1-4%. The scheduler wakes the main process on an idle core when there is one, else on
the core it last ran on: it settles on the core of a worker that waits for work, and stays there while that
worker steps.

So the main process's time goes to the workers that wait for work: a step of worker w takes 1 + D x q_w x b
times its time, where
- D: the main process's share of a core over the last WINDOW_S: the profile's `contention.main_step_ms` per
  step any worker ended in it;
- q_w: w's share of the times the workers waited for work (it had nothing to step after a step), each counted
  with weight exp(-age / WAIT_MEMORY_S): a 1P1D prefill worker waits after each prompt, its decode worker only
  when it runs out of requests; two unified workers alike. (All alike before any waited.)
- b: the share of the step the other workers step through (the least of them; 1 with no other worker): while
  another core idles the main process runs there.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

WINDOW_S = 0.2  # the main process's recent load: the steps ended in this window before a step's start
MAX_SHARE = 0.9  # of a core the main process can take
WAIT_MEMORY_S = 1.0  # how long a worker's waiting for work keeps drawing the main process to its core


class HostLoad:
    def __init__(self, step_ms: float, workers: list[str]):
        self.step_s = step_ms / 1000.0
        self.workers = list(workers)
        self.begin()

    def begin(self) -> None:
        """A new rate (or repeat): no recent steps; the workers' waits alike."""
        self.ends: deque[float] = deque()
        self.waits = {w: 1.0 for w in self.workers}
        self.t: Optional[float] = None  # when the waits were last decayed

    def stepped(self, end: float) -> None:
        """A worker's step ended at `end` (the main process receives and records it)."""
        self.ends.append(end)

    def demand(self, t: float) -> float:
        """The main process's share of a core at `t`: its time per step over the steps ended in the window.
        (Ends come in the order steps start, nearly sorted: the front goes once it is old.)"""
        while self.ends and self.ends[0] < t - 2 * WINDOW_S:
            self.ends.popleft()
        return min(self.step_s * sum(1 for e in self.ends if t - WINDOW_S <= e <= t) / WINDOW_S, MAX_SHARE)

    def share(self, worker: str, t: float, waited: bool) -> float:
        """`worker`'s part of the main process's time at `t`, counting its wait before this step if `waited`."""
        if self.t is not None and t > self.t:
            k = math.exp(-(t - self.t) / WAIT_MEMORY_S)
            self.waits = {w: c * k for w, c in self.waits.items()}
        self.t = t if self.t is None else max(self.t, t)
        if waited:
            self.waits[worker] = self.waits.get(worker, 0.0) + 1.0
        total = sum(self.waits.values())
        return self.waits.get(worker, 0.0) / total if total > 0 else 1.0 / len(self.workers)

    def factor(self, worker: str, start: float, others_stepping: Optional[float], waited: bool) -> float:
        """A step's time over its own compute: 1 + D x q_w x b (`others_stepping`: b, None with no other
        worker; `waited`: the worker waited for work before the step)."""
        q = self.share(worker, start, waited)
        if self.step_s <= 0:
            return 1.0
        b = 1.0 if others_stepping is None else others_stepping
        return 1.0 + self.demand(start) * q * b
