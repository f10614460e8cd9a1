"""A simulated worker's time: its steps and the gaps between them, from the profile, at the worker's pace where
one is given, on a host it shares with the deployment's other workers.

- step: the profile's step model (pdlab.recipe.timing.StepTiming), times the worker's pace factor at the rate
  being simulated (pdlab.sim.pace.WorkerPace, a run replayed at its own pace), then the profile's contention
  (pdlab.timing.contention): the share of the other workers stepping over the step's modelled time, a cold
  start after idling, what the worker's last prefill left to its decode steps, a decode step's spread,
  drawn, and the KV of hand-overs admitted since its last step (`joined_ktok`, set by the simulator), read first.
- gap: the worker's own time before its next step: drawn from its pace's gap quantiles, or the profile's
  `host.gap_ms`.
- host: on a box where the main process shares the workers' cores, the time it takes from this worker's
  (pdlab.sim.host_load; the simulator sets `host`).

Before each of its steps the simulator sets `step_start`, `cold` and `others` (for each other worker: whether
it has work, so steps through this step back to back, and when its step in progress ends; None: none), and
after each `waited` (it has nothing left to step: its core idles until its next).
`begin(rate, repeat)` before each run: the pace's factor for that rate and repeat, and the draws seeded by
worker, rate and repeat, so a simulation repeats exactly (steps and gaps from streams of their own).

The engine takes this object as its step timing (pdlab.engine.timed): anything else it asks for is the
profile's.
"""

from __future__ import annotations

import random
import zlib
from typing import Any, Optional

from pdlab.sim.host_load import HostLoad
from pdlab.sim.pace import WorkerPace, draw
from pdlab.workload import rate_tag


class WorkerTime:
    def __init__(self, profile: Any, worker: str, pace: Optional[WorkerPace] = None):
        self.profile, self.worker, self.pace = profile, worker, pace
        self.contention = profile.contention
        self.factor = pace.factor if pace is not None else 1.0
        self.spreads = bool(self.contention.decode_spread or self.contention.decode_spread_beside)
        self.step_rng, self.gap_rng = random.Random(0), random.Random(0)
        self.step_start, self.cold, self.others = 0.0, False, []
        self.waited = True  # it waited for work before its next step (its core idled)
        self.since_prefill: Optional[int] = None  # decode-only steps since its last with prefill tokens
        self.host: Optional[HostLoad] = None
        self.joined_ktok = 0.0  # thousands of prompt tokens admitted since its last step (the simulator adds them)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.profile, name)

    def begin(self, rate: float, repeat: int) -> None:
        tag = rate_tag(rate)
        if self.pace is not None:
            self.factor = next((f for t, r, f in self.pace.by_run if t == tag and r == repeat), self.pace.factor)
        self.waited = True  # idle until the rate's first request
        key = f"{self.worker}/{tag}/{repeat}"
        self.gap_rng.seed(zlib.crc32(key.encode()))  # stable across processes
        self.step_rng.seed(zlib.crc32(f"{key}/steps".encode()))

    def through(self, step_s: float) -> list[float]:
        """Each other worker's share of [step_start, step_start + step_s] it steps through."""
        return [1.0 if work else 0.0 if end is None else min(max(end - self.step_start, 0.0) / max(step_s, 1e-12), 1.0)
                for work, end in self.others]

    def share(self, step_s: float) -> float:
        """The share of the other workers stepping over [step_start, step_start + step_s]."""
        xs = self.through(step_s)
        return sum(xs) / len(xs) if xs else 0.0

    def least(self, step_s: float) -> Optional[float]:
        """The least share of the step any other worker steps through (None: no other worker)."""
        xs = self.through(step_s)
        return min(xs) if xs else None

    def step_s(self, *counts: int) -> float:
        s = self.profile.step_s(*counts) * self.factor
        u = self.step_rng.random() if self.spreads else None
        prefill = counts[0] > 0
        out = self.contention.step_s(s, prefill, self.share(s), self.cold, u, self.since_prefill)
        self.since_prefill = 0 if prefill else None if self.since_prefill is None else self.since_prefill + 1
        out += self.contention.join_ktok_ms * self.joined_ktok / 1e3 * self.factor  # their KV, read here first
        self.joined_ktok = 0.0
        if self.host is not None:
            out *= self.host.factor(self.worker, self.step_start, self.least(out), self.waited)
        return out

    def gap_s(self, default_s: float) -> float:
        g = self.pace.gaps_ms if self.pace is not None else ()
        return draw(g, self.gap_rng.random()) / 1000.0 if len(g) > 1 else default_s
