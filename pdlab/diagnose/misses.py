"""The ITL figures a verdict rests on, from the tagged background gaps.

- steady ITL p50/p99: the gaps in no prefill window; ITL p99 with probes: every gap while the probes ran
  (offline: every gap);
- an ITL *miss* is a gap longer than the ITL target (per gap: the stall a user sees);
- the share of misses in prefill windows, and the share the windows *explain*: the misses in windows beyond
  what the miss rate outside windows predicts for that many gaps, (m_in - r_out * n_in) / m_all, clamped to
  [0, 1]. A window covers some gaps by chance; when misses are no likelier inside windows than outside, the
  windows explain none of them, however many fell inside;
- what the misses outside windows follow instead: the server's running requests (its /metrics) or, without
  them, this client's requests in flight, at the end of each gap (Pearson's r with the miss indicator).
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import numpy as np

from pdlab.diagnose.streams import Stream
from pdlab.diagnose.tagging import Gap, Tagging

CORRELATED_R = 0.2  # |r| from which misses are said to follow the load


def pct(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def itl_figures(tagging: Tagging, probes: Optional[Sequence[float]]) -> dict:
    """Steady ITL p50/p99 and ITL p99 while the probes ran (`probes`: [start, end]; None: every gap)."""
    steady = [g.ms for g in tagging.gaps if not g.in_window]
    during = [g.ms for g in tagging.gaps if probes is None or (g.end > probes[0] and g.start < probes[1])]
    return {"steady_itl_p50_ms": pct(steady, 50), "steady_itl_p99_ms": pct(steady, 99),
            "itl_p99_with_probes_ms": pct(during, 99), "gaps": len(tagging.gaps), "steady_gaps": len(steady),
            "stall_gaps": len(tagging.of("stall")), "outliers": sum(g.stands_out and not g.in_window
                                                                   for g in tagging.gaps)}


def miss_shares(gaps: Sequence[Gap], target_ms: float) -> dict:
    misses = [g for g in gaps if g.ms > target_ms]
    n_in = sum(g.in_window for g in gaps)
    n_out = len(gaps) - n_in
    m_in = sum(g.in_window for g in misses)
    m_out = len(misses) - m_in
    stall = sum(g.tag == "stall" for g in misses)
    rate_in = m_in / n_in if n_in else None
    rate_out = m_out / n_out if n_out else None
    explained = None
    if misses:
        expected = (rate_out or 0.0) * n_in
        explained = min(1.0, max(0.0, (m_in - expected) / len(misses)))
    return {"target_ms": target_ms, "misses": len(misses), "in_windows": m_in, "stall_tagged": stall,
            "outside_windows": m_out, "share_in_windows": m_in / len(misses) if misses else None,
            "explained_share": explained, "miss_rate_in_windows": rate_in, "miss_rate_outside": rate_out,
            "gaps_in_windows": n_in, "gaps_outside": n_out}


def load_at(times: Sequence[float], streams: list[Stream], samples: Optional[Sequence[Sequence[float]]]) \
        -> tuple[str, list[float]]:
    """The load at each of `times`: the server's running requests (the last /metrics sample before), else this
    client's requests between send and last delivery."""
    if samples:
        ts = [s[0] for s in samples]
        return "the server's running requests, from its /metrics", [
            float(samples[max(0, bisect.bisect_right(ts, t) - 1)][1]) for t in times]
    sends = sorted(s.send for s in streams if s.end is not None)
    ends = sorted(s.end for s in streams if s.end is not None)
    return "this client's requests in flight", [
        float(bisect.bisect_right(sends, t) - bisect.bisect_left(ends, t)) for t in times]


def correlation(tagging: Tagging, streams: list[Stream], target_ms: float,
                samples: Optional[Sequence[Sequence[float]]]) -> dict:
    """Pearson's r between "this gap outside windows missed" and the load at its end."""
    gaps = [g for g in tagging.gaps if not g.in_window]
    what, load = load_at([g.end for g in gaps], streams, samples)
    miss = np.asarray([g.ms > target_ms for g in gaps], dtype=float)
    x = np.asarray(load, dtype=float)
    r = None
    if len(gaps) > 2 and miss.std() > 0 and x.std() > 0:
        r = float(np.corrcoef(miss, x)[0, 1])
    return {"with": what, "r": r, "misses_outside": int(miss.sum()), "load_p50": pct(load, 50),
            "load_max": float(x.max()) if len(x) else None,
            "correlated": r is not None and abs(r) >= CORRELATED_R}
