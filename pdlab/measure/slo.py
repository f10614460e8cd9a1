"""Per-request SLO, misses by kind, and goodput over a rate grid (DESIGN.md, Measurement).

Percentiles everywhere are numpy's default (linear interpolation between closest ranks), the same as
`vllm bench serve`.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

from pdlab.constants import MISS_KINDS, STATS
from pdlab.recipe.slo import SLO

__all__ = ["MISS_KINDS", "SLO", "itl_value", "request_slo", "miss_kind", "goodput"]


def itl_value(gaps: list[float], stat: str) -> Optional[float]:
    """The declared statistic of one request's ITL gaps (seconds); None when there are no gaps.

    `mean` is TPOT: the gaps sum to last - first token time, so their mean is (E2EL - TTFT) / (n - 1).
    """
    if not gaps:
        return None
    if stat == "mean":
        return float(np.mean(gaps))
    if stat == "max":
        return float(np.max(gaps))
    if stat in ("p50", "p90", "p99"):
        return float(np.percentile(gaps, float(stat[1:])))
    raise ValueError(f"unknown itl_stat {stat!r}; expected one of {', '.join(STATS)}")


def request_slo(ok: bool, ttft: Optional[float], gaps: list[float], slo: SLO) -> dict:
    """SLO verdict of one request. A failed request meets nothing. A request with one output token has
    no gaps: its ITL is met by definition (there was nothing to wait for after the first token)."""
    value = itl_value(gaps, slo.itl_stat)
    ttft_ok = bool(ok and ttft is not None and ttft * 1000.0 <= slo.ttft_ms)
    itl_ok = bool(ok and (value is None or value * 1000.0 <= slo.itl_ms))
    return {"slo_ttft_ok": ttft_ok, "slo_itl_ok": itl_ok, "slo_ok": ttft_ok and itl_ok, "slo_itl_value": value}


def miss_kind(rec: dict) -> Optional[str]:
    """ttft_only | itl_only | both | failed, or None when the request met its SLO."""
    if not rec.get("ok"):
        return "failed"
    t, i = rec["slo_ttft_ok"], rec["slo_itl_ok"]
    if t and i:
        return None
    if not t and not i:
        return "both"
    return "itl_only" if t else "ttft_only"


def goodput(points: Iterable[tuple[float, float]], target: float) -> dict:
    """Goodput: the highest request rate whose SLO attainment is >= target.

    `points` are (rate, attainment). Rules, all visible in the result:
    - inf (all-at-once) is the saturation point, not a rate on the grid: it is left out;
    - the highest passing rate r_j is taken (if attainment is not monotonic, `monotonic` is false);
      if a higher rate r_j+1 fails, goodput is interpolated linearly where attainment crosses the target:
      r_j + (a_j - target) / (a_j - a_j+1) * (r_j+1 - r_j);
    - every rate passes: goodput = the highest rate, `lower_bound` true (the real value is higher);
    - no rate passes: goodput = 0.0, `below_grid` true (no extrapolation below the lowest rate).
    """
    grid = sorted((float(r), float(a)) for r, a in points if not math.isinf(float(r)))
    out = {"goodput": 0.0, "target": target, "grid": [{"rate": r, "attainment": a} for r, a in grid],
           "lower_bound": False, "below_grid": False, "monotonic": True}
    if not grid:
        out["goodput"] = None
        return out
    atts = [a for _, a in grid]
    out["monotonic"] = all(x >= y for x, y in zip(atts, atts[1:]))
    passing = [j for j, (_, a) in enumerate(grid) if a >= target]
    if not passing:
        out["below_grid"] = True
        return out
    j = passing[-1]
    if j == len(grid) - 1:
        out["goodput"], out["lower_bound"] = grid[j][0], True
        return out
    (r0, a0), (r1, a1) = grid[j], grid[j + 1]
    out["goodput"] = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return out
