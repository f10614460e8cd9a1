"""A worker's host time, read from a run's records: what the step model leaves out and the simulator adds.

- gap: a worker's own time between two back-to-back steps (the earlier one left work: running or waiting
  requests), next start - previous end. It sends the step's tokens and record, reads its messages, and
  goes round its loop.
- hop: a request's scheduled arrival to the start of its first step, for requests that found their worker
  idle (no step running at the arrival, none started before its own): the harness's send, the router, the
  socket, the worker's poll. TTFT counts it.
- handoff: a finished prefill to the decode worker acting on it, for hand-overs that found the decode
  worker idle: pull, prefill end -> transfer start (PrefillDone to the router, Pull to the decode worker);
  push, the later of prefill end and transfer end -> admitted (PrefillDone, then Admit).
- send: the harness and router's own time per request, between two requests' arrivals at the router
  (`queued`) where the later one was due before the earlier one got there (a backlog: a burst, or requests
  at rate inf). Requests one at a time leave none.
- admit: a decode worker's own time per hand-over it admits between two back-to-back steps: the gap over the
  worker's median gap with none admitted, divided by the hand-overs admitted in it (`phases.admitted`). On the
  2-core Xeon 0.6-1.1 ms each (a gap of 0.2 ms with none, 0.8-1.35 with one, 4.6 with six), a stall in the
  ITL of every request the worker decodes.

Each figure is the median over its samples (None without any); the samples counted are reported beside.
Steps and requests are a run's steps.jsonl and requests.jsonl lines (or the same fields from a cluster).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Optional

MIN_SAMPLES = 3  # fewer than this: the figure is not estimated
FIGURES = ("gap_ms", "hop_ms", "handoff_ms", "send_ms", "admit_ms")  # what host_times estimates (`host` keys)


class _Timeline:
    """One worker's steps in one (variant, rate, repeat): is it stepping at t, did a step start in [a, b)."""

    def __init__(self, steps: list[dict]):
        steps = sorted(steps, key=lambda s: s["start"])
        self.starts = [s["start"] for s in steps]
        self.ends = [s["end"] for s in steps]

    def busy(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and self.ends[i] > t

    def started_between(self, a: float, b: float) -> bool:
        return bisect.bisect_left(self.starts, b) > bisect.bisect_left(self.starts, a)


def _key(r: dict, worker: Optional[str]) -> tuple:
    return r.get("variant"), r.get("rate"), r.get("repeat", 0), worker


def _median(xs: list[float]) -> Optional[float]:
    return 1000.0 * statistics.median(xs) if len(xs) >= MIN_SAMPLES else None


def back_to_back(steps: list[dict]) -> dict[tuple, list[tuple[dict, dict]]]:
    """Each worker's (in a variant, rate and repeat) pairs of consecutive steps where the earlier one left work
    behind (running or waiting requests): the later one started as soon as its worker could."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        by[_key(s, s.get("worker"))].append(s)
    out = {}
    for k, ss in by.items():
        ss.sort(key=lambda s: s["start"])
        out[k] = [(a, b) for a, b in zip(ss, ss[1:])
                  if (a.get("running") or 0) + (a.get("waiting") or 0) > 0 and b["start"] >= a["end"]]
    return out


def gaps(steps: list[dict]) -> list[float]:
    """Seconds between back-to-back steps of each worker (the earlier one left work behind)."""
    return [b["start"] - a["end"] for pairs in back_to_back(steps).values() for a, b in pairs]


def host_times(steps: list[dict], requests: list[dict]) -> dict:
    """{gap_ms, hop_ms, handoff_ms} (None where not estimated) and {gaps, hops, handoffs}: the samples."""
    lines: dict[tuple, _Timeline] = {}
    by: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        by[_key(s, s.get("worker"))].append(s)
    lines = {k: _Timeline(v) for k, v in by.items()}
    hops, handoffs = [], []
    for r in requests:
        ph = r.get("phases") or {}
        if not r.get("ok") or "prefill_start" not in ph:
            continue
        pre = lines.get(_key(r, r.get("prefill_worker")))
        arrival, first = r["arrival"], ph["prefill_start"]
        if pre is not None and first >= arrival and not pre.busy(arrival) and not pre.started_between(arrival, first):
            hops.append(first - arrival)
        dec = lines.get(_key(r, r.get("decode_worker")))
        if dec is None or r.get("decode_worker") == r.get("prefill_worker") or "prefill_end" not in ph:
            continue
        if "transfer_start" in ph and ph["transfer_start"] >= ph["prefill_end"]:  # pull: the transfer follows
            a, b = ph["prefill_end"], ph["transfer_start"]
        elif "admitted" in ph and "transfer_end" in ph:  # push: admitted once the KV has landed
            a = max(ph["prefill_end"], ph["transfer_end"])
            b = ph["admitted"]
        else:
            continue
        if b >= a and not dec.busy(a) and not dec.started_between(a, b):
            handoffs.append(b - a)
    g, sn, ad = gaps(steps), sends(requests), admits(steps, requests)
    return {"gap_ms": _median(g), "hop_ms": _median(hops), "handoff_ms": _median(handoffs), "send_ms": _median(sn),
            "admit_ms": _median(ad),
            "samples": {"gaps": len(g), "hops": len(hops), "handoffs": len(handoffs), "sends": len(sn),
                        "admits": len(ad)}}


def admits(steps: list[dict], requests: list[dict]) -> list[float]:
    """Seconds a decode worker spent per hand-over it admitted between two back-to-back steps, beyond its
    median gap with none admitted (in the same variant, rate and repeat)."""
    admitted: dict[tuple, list[float]] = defaultdict(list)
    for r in requests:
        ph = r.get("phases") or {}
        if r.get("decode_worker") and r.get("decode_worker") != r.get("prefill_worker") and "admitted" in ph:
            admitted[_key(r, r["decode_worker"])].append(ph["admitted"])
    out = []
    for k, pairs in back_to_back([s for s in steps if s.get("role") == "decode"]).items():
        times = sorted(admitted.get(k, []))
        rows = [(b["start"] - a["end"], bisect.bisect_right(times, b["start"]) - bisect.bisect_left(times, a["end"]))
                for a, b in pairs]
        plain = [g for g, n in rows if n == 0]
        if len(plain) < MIN_SAMPLES:
            continue
        base = statistics.median(plain)
        out += [(g - base) / n for g, n in rows if n > 0]
    return out


def sends(requests: list[dict]) -> list[float]:
    """Seconds between consecutive arrivals at the router of requests that queued behind each other: the later
    one was due (`arrival`) before the earlier one reached the router (`phases.queued`)."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in requests:
        if "queued" in (r.get("phases") or {}):
            by[_key(r, None)].append(r)
    out = []
    for rs in by.values():
        rs.sort(key=lambda r: r["phases"]["queued"])
        for a, b in zip(rs, rs[1:]):
            if b["arrival"] <= a["phases"]["queued"]:
                out.append(b["phases"]["queued"] - a["phases"]["queued"])
    return out


def host_raw(est: dict) -> dict:
    """A profile's `host` block from an estimate: every figure it has (handoff, when not seen: the hop)."""
    out = {k: est[k] for k in FIGURES if est.get(k) is not None}
    if "handoff_ms" not in out and "hop_ms" in out:
        out["handoff_ms"] = out["hop_ms"]
    return out
