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
- `gaps_ms`: quantiles (at LEVELS) of the worker's own time between back-to-back steps; the
  simulator draws each gap from them, seeded per worker, rate and repeat (a simulation repeats exactly);
  empty: the profile's gap_ms.

Steps are not spread around their scaled time: drawn independently, a run's spread of step ratios (which
comes in stretches and by step shape, not step by step) put simulated ITL tails 20-70% above the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


# the probability levels a WorkerPace keeps its gaps at: every 5% to 95%, then dense in the tail, where a
# request's p99 ITL takes its gaps from (evenly spaced levels put p99.5 most of the way to the largest gap)
LEVELS = (tuple(i / 20 for i in range(20)) + (0.96, 0.97, 0.98, 0.99, 0.995, 0.998, 0.999, 1.0))


@dataclass(frozen=True)
class WorkerPace:
    factor: float = 1.0
    gaps_ms: tuple[float, ...] = ()
    by_run: tuple[tuple[str, int, float], ...] = ()  # (rate tag, repeat, factor)


def paced_profile(profile: Any) -> Any:
    """The profile a worker stepping at a pace read from a run is simulated with: the main process's share of the
    workers' cores taken out, since the pace holds it (pdlab.sim.host_load would take it a second time)."""
    return profile.replace(contention=profile.contention.replace(main_step_ms=0.0))


def quantiles(xs: Sequence[float], levels: Sequence[float] = LEVELS) -> tuple[float, ...]:
    """The quantiles of `xs` at `levels` (linear interpolation); () for no values."""
    if not len(xs):
        return ()
    return tuple(float(q) for q in np.quantile(np.asarray(xs, dtype=float), levels))


def draw(qs: tuple[float, ...], u: float) -> float:
    """The value at probability `u` of the distribution whose quantiles at LEVELS are `qs`."""
    return float(np.interp(u, LEVELS, qs))
