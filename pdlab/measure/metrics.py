"""Request records and the metrics of one (variant, repeat, rate) (docs/design.md, Metrics), from records only.

Records keep seconds on the router's monotonic clock; summaries report latencies in milliseconds.
Statistics are mean / p50 / p90 / p99 / max with numpy's default percentile (linear interpolation),
as `vllm bench serve` computes them. Latency statistics cover successful requests; ITL statistics
pool every gap of every successful request (vLLM does the same).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import numpy as np

from pdlab.constants import MISS_KINDS, STATS
from pdlab.measure.attribution import PARTS, attribute_gaps, interference_summary, ttft_parts
from pdlab.measure.client_attribution import attribute_gaps_client, client_interference_summary
from pdlab.measure.slo import SLO, miss_kind, request_slo


def stats(values: Iterable[float], scale: float = 1.0) -> dict:
    """mean/p50/p90/p99/max of `values` times `scale` (None for each when empty), plus the count."""
    v = np.asarray([x for x in values if x is not None], dtype=float) * scale
    if v.size == 0:
        return {k: None for k in STATS} | {"n": 0}
    out = {"mean": float(v.mean()), "max": float(v.max()), "n": int(v.size)}
    for q in (50, 90, 99):
        out[f"p{q}"] = float(np.percentile(v, q))
    return {k: out[k] for k in (*STATS, "n")}


def as_rate(rate: Any) -> float:
    """Rates travel as numbers, or as the string "inf" in JSON (JSON has no infinity)."""
    return math.inf if isinstance(rate, str) and rate.lower() in ("inf", "infinity") else float(rate)


def chunk_times(token_times: list[float], chunks: Optional[list[int]] = None) -> list[float]:
    """The time of each delivery: of every token, or, with `chunks` (tokens per streamed chunk, an HTTP
    client's record), of every chunk (its tokens share its time). Sizes that do not add up to the tokens
    are ignored (every token is then its own delivery)."""
    if not chunks or sum(chunks) != len(token_times) or any(int(c) < 1 for c in chunks):
        return list(token_times)
    out, i = [], 0
    for c in chunks:
        out.append(token_times[i])
        i += int(c)
    return out


def timings(arrival: float, token_times: list[float], chunks: Optional[list[int]] = None) -> dict:
    """TTFT, E2EL, TPOT and the ITL gaps (seconds) of one request.

    TTFT = first token - arrival; E2EL = last token - arrival; ITL = consecutive gaps between deliveries:
    between tokens, or with `chunks` between streamed chunks; TPOT = (E2EL - TTFT) / (output tokens - 1), None
    with a single token. With chunks, ITL is per chunk and TPOT per token, as `vllm bench serve` has them.
    """
    if not token_times:
        return {"ttft": None, "e2el": None, "tpot": None, "itl": []}
    ttft = token_times[0] - arrival
    e2el = token_times[-1] - arrival
    n = len(token_times)
    times = chunk_times(token_times, chunks)
    return {"ttft": ttft, "e2el": e2el, "tpot": (e2el - ttft) / (n - 1) if n > 1 else None,
            "itl": [b - a for a, b in zip(times, times[1:])]}


def repeat_spans(per: list[dict]) -> tuple[float, Optional[float], int]:
    """(arrival span, duration, repeats) of records, summed over their repeats: a repeat's span runs from its
    first arrival to its last, its duration from its first arrival to its last completed request's last
    token. A repeat with no completed request adds no duration (there is no last token to end it), so a
    throughput over the sum is that of the repeats that completed something; its failures still count where
    requests are counted."""
    by: dict[int, list[dict]] = {}
    for r in per:
        by.setdefault(int(r.get("repeat") or 0), []).append(r)
    span, duration = 0.0, 0.0
    for rs in by.values():
        arrivals = [r["arrival"] for r in rs]
        span += max(arrivals) - min(arrivals)
        end = max((r["token_times"][-1] for r in rs if r["ok"]), default=None)
        if end is not None and end > min(arrivals):
            duration += end - min(arrivals)
    return span, duration or None, len(by)


def build_request_record(*, variant: str, rate: float, id: str, prompt_ids: list[int], output_ids: list[int],
                         arrival: float, token_times: list[float], slo: SLO, error: Optional[str] = None,
                         phases: Optional[dict] = None, workers: Optional[dict] = None, cached_tokens: int = 0,
                         warmup: bool = False, repeat: int = 0, delivery_lag: Optional[list[float]] = None,
                         route: Optional[str] = None, client: Optional[dict] = None) -> dict:
    """One requests.jsonl line from what the router collected: raw timestamps in, metrics and SLO verdict out.

    `workers`: {"prefill": name, "decode": name} (unified: the same name for both, or {"unified": name}).
    A request is ok when it has no error and at least one token. `token_times` are the workers' stamps;
    `delivery_lag` (seconds per token) is how long each took to reach the router. `route`: where its prompt
    was prefilled (`prefill_route`, one of constants.PREFILL_ROUTES; None when it never got that far).
    `client`: what an HTTP client of an external server saw (`chunks`, `usage`, ...), kept in the record.
    """
    workers = workers or {}
    client = client or {}
    t = timings(arrival, token_times, client.get("chunks"))
    ok = error is None and len(token_times) > 0
    rec = {"variant": variant, "rate": rate, "repeat": repeat, "id": id, "prompt_len": len(prompt_ids),
           "output_len": len(output_ids), "cached_tokens": int(cached_tokens or 0), "arrival": arrival,
           "token_times": list(token_times), "ttft": t["ttft"], "e2el": t["e2el"], "tpot": t["tpot"],
           "itl": t["itl"], "worst_gap": max(t["itl"]) if t["itl"] else None,
           "delivery_lag": list(delivery_lag or []), "prompt_ids": list(prompt_ids),
           "output_ids": list(output_ids), "ok": ok,
           "error": error}
    rec.update(request_slo(ok, t["ttft"], t["itl"], slo, t["tpot"]))
    rec.update({k: v for k, v in client.items() if k not in rec})
    rec["prefill_worker"] = workers.get("prefill", workers.get("unified"))
    rec["decode_worker"] = workers.get("decode", workers.get("unified"))
    rec["prefill_route"] = route
    rec["phases"] = dict(phases or {})
    if warmup:
        rec["warmup"] = True
    return rec


def summarize_rate(requests: list[dict], steps: list[dict], transfers: list[dict], slo: SLO,
                   rate: Optional[float] = None) -> dict:
    """The metrics of one (variant, repeat, rate), recomputed from raw fields (arrival, token_times, ok).

    Warm-up records (`warmup: true`) are ignored. Duration runs from the first arrival to the last token.
    The realised rate is (requests - 1) over the span of their arrivals, beside the nominal `rate`. Records of
    several repeats (pooled over repeats) are timed repeat by repeat: the duration and the span are the sums of
    each repeat's own, not the time from the first repeat's start to the last one's end, which holds the other
    rates run in between.
    """
    reqs = [r for r in requests if not r.get("warmup")]
    sent = len(reqs)
    per = []
    for r in reqs:
        ok = bool(r.get("ok")) and bool(r.get("token_times"))
        t = timings(r["arrival"], r.get("token_times") or [], r.get("chunks"))
        v = dict(r, ok=ok, **t, **request_slo(ok, t["ttft"], t["itl"], slo, t["tpot"]))
        per.append(v)
    good = [r for r in per if r["ok"]]
    met = sum(1 for r in per if r["slo_ok"])
    met_tpot = sum(1 for r in per if r["slo_tpot_ok"])
    misses = {k: 0 for k in MISS_KINDS}
    for r in per:
        k = miss_kind(r)
        if k:
            misses[k] += 1
    span, duration, groups = repeat_spans(per)
    out_tokens = sum(len(r["token_times"]) for r in good)
    in_tokens = sum(int(r.get("prompt_len") or 0) for r in good)

    def per_s(x: float) -> Optional[float]:
        return x / duration if duration else None

    parts = [ttft_parts(r["arrival"], r["token_times"][0], r.get("phases")) for r in good]
    gaps = attribute_gaps(good, steps, slo.itl_ms)
    xfer_ms = [(x["end"] - x["start"]) for x in transfers]
    cached = sum(int(r.get("cached_tokens") or 0) for r in good)
    return {
        "nominal_rate": rate, "realised_rate": (len(per) - groups) / span if span > 0 else None,
        "sent": sent, "completed": len(good), "failed": sent - len(good),
        "slo_met": met, "attainment": met / sent if sent else None,
        "attainment_tpot": met_tpot / sent if sent else None,
        "misses": misses,
        "prefill_routes": _count(r.get("prefill_route") for r in per),
        "duration_s": duration,
        "slo_met_per_s": per_s(met), "request_throughput": per_s(len(good)),
        "output_tok_s": per_s(out_tokens), "total_tok_s": per_s(out_tokens + in_tokens),
        "output_tokens": out_tokens, "input_tokens": in_tokens,
        "cached_tokens": cached, "prefix_hit_rate": cached / in_tokens if in_tokens else None,
        "ttft_ms": stats((r["ttft"] for r in good), 1000.0),
        "tpot_ms": stats((r["tpot"] for r in good), 1000.0),
        "itl_ms": stats((g for r in good for g in r["itl"]), 1000.0),
        "worst_gap_ms": stats((max(r["itl"]) for r in good if r["itl"]), 1000.0),
        "delivery_lag_ms": stats((x for r in good for x in r.get("delivery_lag") or []), 1000.0),
        "e2el_ms": stats((r["e2el"] for r in good), 1000.0),
        "ttft_parts_ms": {p: stats((x[p] for x in parts), 1000.0) for p in PARTS},
        "interference": interference_summary(gaps, good),
        # from token times only (pdlab.measure.client_attribution): what an engine without steps gets
        "interference_client": client_interference_summary(attribute_gaps_client(good, slo.itl_ms), good),
        "transfers": {"count": len(transfers), "bytes": sum(int(x.get("bytes") or 0) for x in transfers),
                      "saved_bytes": sum(int(x.get("saved_bytes") or 0) for x in transfers),
                      "copy_ms": stats(xfer_ms, 1000.0)},  # the whole copy; TTFT's exposed part: ttft_parts_ms
        "steps": len(steps),
    }


def _count(values: Iterable[Optional[str]]) -> dict:
    """How many requests prefilled where (prefill_route; records that never got that far are left out)."""
    out: dict = {}
    for v in values:
        if v is not None:
            out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
