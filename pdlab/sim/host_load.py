"""The main process on the workers' cores: a simulated CPU worker's steps lose the time the router and harness
take from its core, on a box where they have no core of their own.

A run's main process receives every worker step's messages and records them: on the 2-core Xeon 0.22 ms of
its CPU per worker step and 27 us per token, 6-16% of a core (BENCHMARKS.md, 2026-12-03 third session). With
no spare core (`pdlab run` moves it off the workers' cores when there is one) that time comes from a worker's:
each CPU step records its own CPU time (`cpu_s`), and the workers lost 0.6-1.0 of the main process's CPU time,
while their steps' own compute stayed at the profile's prediction. Where the scheduler finds an idle core the
main process runs there and takes nothing: it takes from a worker only while every worker steps, and most from
the one that idles most (the core it last found idle). A 1P1D decode worker lost 0.2-0.8% of its steps' time,
its prefill worker 7-14%.

So a step of worker w takes 1 + D x q_w x b times its time, where
- D: the main process's share of a core over the last WINDOW_S: the profile's `contention.main_step_ms` per
  step any worker ended in it;
- q_w: w's share of the workers' idle time since the rate began (each worker's: 1 - its busy share), the part
  of D that lands on w's core (all alike when none idled);
- b: the share of the step the other workers step through (the least of them; 1 with no other worker).
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
        self.begin(0.0)

    def begin(self, t: float) -> None:
        """A new rate (or repeat) from `t`: no recent steps, no busy time yet."""
        self.t0 = t
        self.ends: deque[float] = deque()
        self.busy = {w: 0.0 for w in self.workers}

    def stepped(self, worker: str, start: float, end: float) -> None:
        self.ends.append(end)
        self.busy[worker] = self.busy.get(worker, 0.0) + max(end - start, 0.0)

    def demand(self, t: float) -> float:
        """The main process's share of a core at `t`: its time per step over the steps ended in the window.
        (Ends come in the order steps start, nearly sorted: the front goes once it is old.)"""
        while self.ends and self.ends[0] < t - 2 * WINDOW_S:
            self.ends.popleft()
        return min(self.step_s * sum(1 for e in self.ends if t - WINDOW_S <= e <= t) / WINDOW_S, MAX_SHARE)

    def share(self, worker: str, t: float) -> float:
        """`worker`'s part of the main process's time when every worker steps: its share of their idle time."""
        span = t - self.t0
        if span <= 0:
            return 1.0 / len(self.workers)
        idle = {w: max(1.0 - b / span, 0.0) for w, b in self.busy.items()}
        total = sum(idle.values())
        return idle.get(worker, 0.0) / total if total > 1e-9 else 1.0 / len(self.workers)

    def factor(self, worker: str, start: float, others_stepping: Optional[float]) -> float:
        """A step's time over its own compute: 1 + D x q_w x b (`others_stepping`: b; None: no other worker)."""
        b = 1.0 if others_stepping is None else others_stepping
        if self.step_s <= 0 or b <= 0:
            return 1.0
        return 1.0 + self.demand(start) * self.share(worker, start) * b
