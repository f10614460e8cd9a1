"""Interference attribution from the client's side: for engines whose steps pdlab cannot see (vLLM).

Without step records, a slow ITL gap of request A is matched to the prefills that may have run at that
moment on the server that produced A's tokens: the window of every other request B from its arrival to its
first token, where B was prefilled on that same server (a unified server, or any server with both roles).
A gap that overlaps such a window is a *prefill interruption*; otherwise its cause is `other` (slow decode
steps, preemption, the network: the client cannot tell them apart).

A window runs from arrival, not from the moment B's prefill began (the client cannot see that), so the
client-side count is an upper bound of the engine-side one. On pdlab's own engine both exist for the same
run, and tests/test_client_attribution.py checks that they agree there.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

CAUSES = ("prefill", "other")


def prefill_windows(requests: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """Per server: (arrival, first token, request id) of every request prefilled there whose first token
    came from that same server (prefill and decode on one server), sorted by arrival."""
    by: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for r in requests:
        times = r.get("token_times") or []
        worker = r.get("prefill_worker")
        if not times or worker is None or r.get("decode_worker") not in (None, worker):
            continue  # disaggregated: its prefill ran where no decode runs
        by[worker].append((r["arrival"], times[0], r.get("id")))
    return {w: sorted(v) for w, v in by.items()}


def attribute_gaps_client(requests: list[dict], itl_ms: float) -> list[dict]:
    """Every ITL gap above `itl_ms`, with the other requests whose prefill window overlaps it."""
    windows = prefill_windows(requests)
    starts = {w: [x[0] for x in v] for w, v in windows.items()}
    longest = {w: max((b - a for a, b, _ in v), default=0.0) for w, v in windows.items()}
    limit = itl_ms / 1000.0
    out = []
    for r in requests:
        times = r.get("token_times") or []
        worker = r.get("decode_worker") or r.get("prefill_worker")
        own = windows.get(worker, [])
        for i in range(len(times) - 1):
            t0, t1 = times[i], times[i + 1]
            if t1 - t0 <= limit:
                continue
            lo = bisect.bisect_left(starts.get(worker, []), t0 - longest.get(worker, 0.0))
            hi = bisect.bisect_left(starts.get(worker, []), t1)
            hits = [rid for a, b, rid in own[lo:hi] if rid != r.get("id") and b > t0 and a < t1]
            out.append({"req_id": r.get("id"), "worker": worker, "index": i + 1, "start": t0, "end": t1,
                        "gap": t1 - t0, "cause": "prefill" if hits else "other", "prefills": hits})
    return out


def client_interference_summary(gaps: list[dict], requests: list[dict]) -> dict:
    """Counts for summary.json, beside the engine-side `interference`."""
    by = {c: sum(1 for g in gaps if g["cause"] == c) for c in CAUSES}
    hit = {g["req_id"] for g in gaps if g["cause"] == "prefill"}
    return {"slow_gaps": len(gaps), "prefill_interruptions": by["prefill"], "by_cause": by,
            "requests_interrupted": len(hit), "requests": len(requests)}
