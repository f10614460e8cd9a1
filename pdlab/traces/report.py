"""The `trace` block of a run's summary: what the trace workload was (pdlab.traces.replay.Replay.facts) beside
what the run measured of it: the rates run against the trace's nominal rate, and the prefix-cache hit rate
the engines reached against the trace's own reuse ratio.

The two ratios differ for reasons the summary names: the trace's ratio assumes one unbounded cache that
sees every request in order; a run starts each rate with a cold cache, spreads requests over replicas
(each with its own cache), evicts when the pool fills, and always computes a prompt's last token.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

NO_PREFIX = ("this trace format carries no prefix information: every prompt is its own random tokens, so "
             "prefix-cache hits are not expected")
WHY_APART = ("reuse_ratio: the trace's own, one unbounded cache over the replayed requests in order; "
             "prefix_hit_rate: measured, each rate from a cold cache, per replica, with evictions")

# facts that may differ between variants (the model's context sets clipping); the rest are the trace's
PER_VARIANT = ("clipped",)


def _rate(r: Any) -> float:
    return math.inf if isinstance(r, str) and r.lower() in ("inf", "infinity") else float(r)


def _hit(recs: list[dict]) -> Optional[float]:
    """Cached prompt tokens over prompt tokens of the completed requests (as the per-rate summary has it)."""
    good = [r for r in recs if r.get("ok")]
    tokens = sum(int(r.get("prompt_len") or 0) for r in good)
    return sum(int(r.get("cached_tokens") or 0) for r in good) / tokens if tokens else None


def trace_summary(facts: dict[str, dict], requests: list[dict]) -> Optional[dict]:
    """`facts`: variant -> its Replay.facts() (None or empty: no trace workload); `requests`: the run's
    request records (warm-up ones are left out)."""
    if not facts:
        return None
    first = next(iter(facts.values()))
    out = {k: v for k, v in first.items() if k not in PER_VARIANT}
    out["note"] = WHY_APART if first.get("prefix_info") else NO_PREFIX
    nominal = first.get("nominal_rate")
    by: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in requests:
        if not r.get("warmup") and r.get("variant") in facts:
            by[r["variant"]][_rate(r["rate"])].append(r)
    out["variants"] = {}
    for v, f in facts.items():
        rates = sorted(by.get(v, {}).items(), key=lambda kv: (math.isinf(kv[0]), kv[0]))
        out["variants"][v] = {
            **{k: f.get(k) for k in PER_VARIANT},
            "prefix_hit_rate": _hit([r for _, recs in rates for r in recs]),
            "rates": [{"rate": "inf" if math.isinf(rate) else rate,
                       "of_nominal": None if not nominal or math.isinf(rate) or math.isinf(nominal) else rate / nominal,
                       "requests": len(recs), "prefix_hit_rate": _hit(recs)} for rate, recs in rates],
        }
    return out


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def describe(trace: dict) -> str:
    """The trace block of a summary on one line, for compare's header: what was replayed, at what pace, and the
    trace's own prefix reuse beside the hit rate each variant measured."""
    nominal = trace.get("nominal_rate")
    pace = "" if nominal is None else f", nominal {nominal:.3g} req/s"
    scales = ", ".join(f"{k} {trace[k]:g}" for k in ("time_scale", "length_scale") if trace.get(k) not in (None, 1, 1.0))
    dropped = sum((trace.get("dropped") or {}).values())
    head = (f"trace {trace.get('format')} {trace.get('path')}: {trace.get('requests')} requests"
            + (f" over {trace['span_s']:.0f} s" if trace.get("span_s") is not None else "") + pace
            + (f" ({scales})" if scales else "") + (f", {dropped} rows dropped" if dropped else ""))
    variants = trace.get("variants") or {}
    if trace.get("prefix_info"):
        hits = ", ".join(f"{v} {_pct(f.get('prefix_hit_rate'))}" for v, f in variants.items())
        head += f"; prefix reuse {_pct(trace.get('reuse_ratio'))} in the trace, prefix hits measured: {hits}"
    else:
        head += "; no prefix information in this format"
    clipped = [f"{v} {n} {k}" for v, f in variants.items() for k, n in ((f.get("clipped") or {}).items())
               if k != "context" and n]
    return head + (f"; clipped to the context: {', '.join(clipped)}" if clipped else "")
