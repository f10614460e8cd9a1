"""A profile's drift: the box's pace against the profile in the runs checked with it, kept in the profile file
(`pdlab profile --check RUN --profile FILE --write-drift`) for a simulation's band (pdlab.sim.band).

Why: a forecast steps every worker at the profile's pace, and a shared box does not keep one. On the developers'
2-core VM, across 18 validation runs, whole runs' workers stepped x0.92-1.23 their profile's prediction (median
x1.09), and single rates x0.83-1.33 (BENCHMARKS.md, issue 25); the profile, measured in a minute or two before
them, held its own steps to 6%. No point forecast can know that; a band can say how far it alone moves one.

A factor is one worker's steps in one rate and repeat of a run, measured over predicted, predicted as the
simulator would step them in their own context (the step model with the profile's contention), exactly as
the replay reads a worker's pace (pdlab.timing.replay.worker_paces): what the profile leaves unexplained.
The profile keeps the latest constants.DRIFT_KEEP of them and how many runs gave them.
"""

from __future__ import annotations

from typing import Any, Optional

from pdlab.constants import DRIFT_KEEP
from pdlab.recipe.timing import Drift, TimingProfile
from pdlab.timing.replay import worker_paces


def run_factors(profile: TimingProfile, steps: list[dict], variants: list[str],
                requests: Optional[list[dict]] = None) -> list[float]:
    """Each worker's pace in each rate and repeat of `variants` (those of a run that ran their model) in the
    run's step records, against `profile`; warm-up steps left out; with the run's `requests`, its join steps
    predicted with their join cost (worker_paces)."""
    out: list[float] = []
    for v in variants:
        for pace in worker_paces(profile, [s for s in steps if s.get("variant") == v], requests=requests).values():
            out += [f for _, _, f in pace.by_run]
    return out


def merged(drift: Drift, factors: list[float], source: str = "") -> Drift:
    """`drift` with one more run's factors (the latest DRIFT_KEEP kept); `source`: the run's start time, kept so
    that the same run is not added twice (`taken`)."""
    return drift.replace(factors=tuple((list(drift.factors) + [round(f, 4) for f in factors])[-DRIFT_KEEP:]),
                         runs=drift.runs + 1, sources=tuple((list(drift.sources) + [source])[-DRIFT_KEEP:])
                         if source else drift.sources)


def taken(drift: Drift, source: str) -> bool:
    """Whether the run started at `source` is in `drift` already."""
    return bool(source) and source in drift.sources


def checked_variants(checks: dict[str, Any]) -> list[str]:
    """The variants of a profile check (pdlab.timing.check.check_run) that ran their model."""
    return [v for v, c in checks.items() if not c["modelled"]]
