"""Where TTFT goes, and what caused each slow ITL gap.

TTFT parts follow the request through its phase timestamps (monotonic seconds, the router's clock):

    arrival -> prefill_start -> prefill_end -> transfer_end -> admitted -> first token at the router
     queue       prefill         transfer        admission        delivery

`transfer` is the *exposed* transfer: prefill_end -> transfer_end, i.e. what the request waited for its KV
after its prefill finished (in push mode most of the copy overlaps the prefill and is hidden; the full
copy durations are in transfers.jsonl). A part whose timestamps are missing is None; a stage that ends
after the first token reached the router (first_token: prefill) is not part of TTFT and is None too.
When every timestamp is present, the parts add up to TTFT.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Optional

PARTS = ("queue", "prefill", "transfer", "admission", "delivery")


def ttft_parts(arrival: float, first_token: Optional[float], phases: Optional[dict]) -> dict:
    """Seconds per TTFT part (None where unknown)."""
    out: dict[str, Optional[float]] = {p: None for p in PARTS}
    if first_token is None or not phases:
        return out
    ph = {k: v for k, v in phases.items() if v is not None and v <= first_token + 1e-9}
    chain = [("queue", "arrival", "prefill_start"), ("prefill", "prefill_start", "prefill_end"),
             ("transfer", "prefill_end", "transfer_end"), ("admission", "transfer_end", "admitted")]
    ph["arrival"] = arrival
    for part, a, b in chain:
        if a in ph and b in ph:
            out[part] = max(0.0, ph[b] - ph[a])
    # Transfer is the copy left exposed after prefill; time the decode side spent before the copy began
    # (waiting for KV room, the router hop) is admission, not transfer. The parts still sum the same.
    if out["transfer"] is not None and "transfer_start" in ph:
        wait = max(0.0, ph["transfer_start"] - ph["prefill_end"])
        out["transfer"] = max(0.0, ph["transfer_end"] - max(ph["prefill_end"], ph["transfer_start"]))
        out["admission"] = (out["admission"] or 0.0) + wait
    last = max((ph[k] for k in ("prefill_end", "transfer_end", "admitted") if k in ph), default=None)
    if last is not None:
        out["delivery"] = max(0.0, first_token - last)
    return out


class StepIndex:
    """Steps of each worker sorted by start, for fast "which steps overlap (t0, t1)" queries."""

    def __init__(self, steps: list[dict]):
        by: dict[str, list[dict]] = defaultdict(list)
        for s in steps:
            by[s["worker"]].append(s)
        self.steps = {w: sorted(v, key=lambda s: s["start"]) for w, v in by.items()}
        self.starts = {w: [s["start"] for s in v] for w, v in self.steps.items()}
        # steps of one worker do not overlap each other, so the longest step bounds how far back to look
        self.longest = {w: max((s["end"] - s["start"] for s in v), default=0.0) for w, v in self.steps.items()}

    def overlapping(self, worker: str, t0: float, t1: float) -> list[dict]:
        if worker not in self.steps:
            return []
        starts, steps = self.starts[worker], self.steps[worker]
        lo = bisect.bisect_left(starts, t0 - self.longest[worker])
        hi = bisect.bisect_left(starts, t1)
        return [s for s in steps[lo:hi] if s["end"] > t0 and s["start"] < t1]


def attribute_gaps(requests: list[dict], steps: list[dict], itl_ms: float) -> list[dict]:
    """Every ITL gap above `itl_ms`, with its cause.

    A gap is matched to the steps of the worker that produced the request's tokens (`decode_worker`)
    that overlap it. cause: `prefill` if one of them carried prefill tokens (a prefill interruption),
    else `preemption` if one preempted, else `decode` (slow decode steps only), else `no_step` (the
    worker ran no step in the gap: transport, delivery or the router).
    """
    index = StepIndex(steps)
    limit = itl_ms / 1000.0
    out = []
    for r in requests:
        times = r.get("token_times") or []
        worker = r.get("decode_worker")
        for i in range(len(times) - 1):
            gap = times[i + 1] - times[i]
            if gap <= limit:
                continue
            over = index.overlapping(worker, times[i], times[i + 1]) if worker else []
            prefill_tokens = sum(int(s.get("prefill_tokens") or 0) for s in over)
            if prefill_tokens > 0:
                cause = "prefill"
            elif any(s.get("preempted") for s in over):
                cause = "preemption"
            elif over:
                cause = "decode"
            else:
                cause = "no_step"
            out.append({"req_id": r.get("id"), "worker": worker, "index": i + 1, "start": times[i],
                        "end": times[i + 1], "gap": gap, "cause": cause, "prefill_tokens": prefill_tokens,
                        "steps": len(over)})
    return out


def interference_summary(gaps: list[dict], requests: list[dict]) -> dict:
    """Counts for summary.json: slow gaps by cause, and requests hit by at least one prefill interruption."""
    by = {c: 0 for c in ("prefill", "preemption", "decode", "no_step")}
    for g in gaps:
        by[g["cause"]] += 1
    hit = {g["req_id"] for g in gaps if g["cause"] == "prefill"}
    return {"slow_gaps": len(gaps), "prefill_interruptions": by["prefill"], "by_cause": by,
            "requests_interrupted": len(hit), "requests": len(requests)}
