"""Per-request SLO and misses by kind (docs/design.md, Metrics); goodput is in pdlab.measure.search.

Percentiles everywhere are numpy's default (linear interpolation between closest ranks), the same as
`vllm bench serve`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from pdlab.constants import MISS_KINDS, STATS
from pdlab.recipe.slo import SLO

__all__ = ["MISS_KINDS", "SLO", "itl_value", "request_slo", "miss_kind"]


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


def request_slo(ok: bool, ttft: Optional[float], gaps: list[float], slo: SLO, tpot: Optional[float] = None) -> dict:
    """SLO verdict of one request. A failed request meets nothing. A request with one output token has
    no gaps: its ITL is met by definition (there was nothing to wait for after the first token).

    `slo_tpot_ok` is the verdict with TPOT (the mean gap) in place of the declared statistic: the
    definition DistServe and `vllm bench serve --goodput` use, reported beside pdlab's own. `tpot`: the
    request's TPOT when its gaps are per streamed chunk (several tokens each), where the mean gap is not
    TPOT; `itl_stat: mean` then judges it too."""
    if tpot is None or not gaps:
        tpot = itl_value(gaps, "mean")
    value = tpot if slo.itl_stat == "mean" else itl_value(gaps, slo.itl_stat)
    ttft_ok = bool(ok and ttft is not None and ttft * 1000.0 <= slo.ttft_ms)
    itl_ok = bool(ok and (value is None or value * 1000.0 <= slo.itl_ms))
    tpot_ok = bool(ttft_ok and (tpot is None or tpot * 1000.0 <= slo.itl_ms))
    return {"slo_ttft_ok": ttft_ok, "slo_itl_ok": itl_ok, "slo_ok": ttft_ok and itl_ok, "slo_itl_value": value,
            "slo_tpot_ok": tpot_ok}


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
