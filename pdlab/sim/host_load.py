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

So the main process sits on one worker's core: the last worker that waited for work (it had nothing to
step after its last step, or it takes its first) before a step it starts. A step of the worker it sits with takes
1 + D x b times its time, where
- D: the main process's share of a core over the last WINDOW_S: the profile's `contention.main_step_ms` per
  step any worker ended in it;
- b: the share of the step the other workers step through (the least of them; 1 with no other worker): while
  another core idles the main process runs there.
Other workers' steps take their own time.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

WINDOW_S = 0.2  # the main process's recent load: the steps ended in this window before a step's start
MAX_SHARE = 0.9  # of a core the main process can take


class HostLoad:
    def __init__(self, step_ms: float, workers: list[str]):
        self.step_s = step_ms / 1000.0
        self.workers = list(workers)
        self.begin()

    def begin(self) -> None:
        """A new rate (or repeat): no recent steps; the main process on no worker's core yet."""
        self.ends: deque[float] = deque()
        self.on: Optional[str] = None

    def stepped(self, end: float) -> None:
        """A worker's step ended at `end` (the main process receives and records it)."""
        self.ends.append(end)

    def demand(self, t: float) -> float:
        """The main process's share of a core at `t`: its time per step over the steps ended in the window.
        (Ends come in the order steps start, nearly sorted: the front goes once it is old.)"""
        while self.ends and self.ends[0] < t - 2 * WINDOW_S:
            self.ends.popleft()
        return min(self.step_s * sum(1 for e in self.ends if t - WINDOW_S <= e <= t) / WINDOW_S, MAX_SHARE)

    def factor(self, worker: str, start: float, others_stepping: Optional[float], waited: bool) -> float:
        """A step's time over its own compute: 1 + D x b for the worker the main process sits with, else 1.
        `others_stepping`: b (None: no other worker); `waited`: the worker waited for work before the step."""
        if waited or self.on is None:
            self.on = worker  # its core was idle: the main process ran there, and stays
        if self.on != worker or self.step_s <= 0:
            return 1.0
        b = 1.0 if others_stepping is None else others_stepping
        return 1.0 + self.demand(start) * b
