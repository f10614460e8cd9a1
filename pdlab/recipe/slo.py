"""The recipe's `slo` section: the per-request targets every variant is judged by."""

from __future__ import annotations

from dataclasses import dataclass

from pdlab.constants import STATS
from pdlab.fields import Section, one_of, spec, to_float


@dataclass(frozen=True)
class SLO(Section):
    ttft_ms: float = spec(1000.0, "a number > 0 (milliseconds)", to_float(0.0))
    itl_ms: float = spec(50.0, "a number > 0 (milliseconds)", to_float(0.0))
    # the statistic of one request's ITL gaps compared with itl_ms (mean = TPOT)
    itl_stat: str = spec("p99", f"one of {', '.join(STATS)}", one_of(STATS))
    attainment: float = spec(0.9, "a fraction in (0, 1]", to_float(0.0, 1.0))
