"""A simulated worker's pace: how much slower or faster than its profile a worker stepped, and the gaps
between its steps, as a run measured them (pdlab.timing.replay: a run replayed at its own pace).

On a shared box the same step takes longer minutes later, and not alike on every core: in one recipe on the
developers' 2-core VM a decode worker stepped at x1.34-1.59 its profile's prediction from one rate to the next
while its prefill worker stepped at x1.01-1.23 (BENCHMARKS.md, issue 25). And a worker's own time between
steps is not a constant: its median 0.3-0.8 ms, its p99 1.5-3 ms; a request's p99 ITL is the slowest few of
its gaps, so it takes the tail.

- `factor`: the worker's steps over the profile's prediction, in all (sum of measured over sum of predicted).
- `by_run`: the same per (rate tag, repeat) of the run: the pace while that rate ran; the simulator takes it
  for that rate and repeat, `factor` for any other.
- `gaps_ms`: quantiles (evenly spaced, 0 to 1) of the worker's own time between back-to-back steps; the
  simulator draws each gap from them, seeded per worker, rate and repeat (a simulation repeats exactly);
  empty: the profile's gap_ms.

Steps are not spread around their scaled time: drawn independently, a run's spread of step ratios (which
comes in stretches and by step shape, not step by step) put simulated ITL tails 20-70% above the run's.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from pdlab.workload import rate_tag

QUANTILES = 41  # 0, 2.5%, ..., 100%: a run's tails without carrying every step


@dataclass(frozen=True)
class WorkerPace:
    factor: float = 1.0
    gaps_ms: tuple[float, ...] = ()
    by_run: tuple[tuple[str, int, float], ...] = ()  # (rate tag, repeat, factor)


def quantiles(xs: Sequence[float], n: int = QUANTILES) -> tuple[float, ...]:
    """`n` evenly spaced quantiles of `xs` (linear interpolation); () for no values."""
    s = sorted(xs)
    if not s:
        return ()
    out = []
    for i in range(n):
        pos = i * (len(s) - 1) / (n - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return tuple(out)


def draw(qs: tuple[float, ...], u: float) -> float:
    """The value at probability `u` of the distribution whose evenly spaced quantiles are `qs`."""
    pos = u * (len(qs) - 1)
    lo = min(int(pos), len(qs) - 2)
    return qs[lo] + (qs[lo + 1] - qs[lo]) * (pos - lo)


class PacedTiming:
    """A profile whose step_s is scaled by a worker's pace at the rate being simulated (engine.timed's
    StepTimeModel; everything else is the profile's). `start(rate, repeat)` before each run of the simulator."""

    def __init__(self, profile: Any, pace: WorkerPace, worker: str):
        self.profile, self.pace, self.worker = profile, pace, worker
        self.factor, self.rng = pace.factor, random.Random(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.profile, name)

    def start(self, rate: float, repeat: int) -> None:
        tag = rate_tag(rate)
        self.factor = next((f for t, r, f in self.pace.by_run if t == tag and r == repeat), self.pace.factor)
        self.rng.seed(zlib.crc32(f"{self.worker}/{tag}/{repeat}".encode()))  # stable across processes

    def step_s(self, *counts: int) -> float:
        return self.profile.step_s(*counts) * self.factor

    def gap_s(self, default_s: float) -> float:
        g = self.pace.gaps_ms
        return draw(g, self.rng.random()) / 1000.0 if len(g) > 1 else default_s
