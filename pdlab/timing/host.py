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
- admit_ktok: what a pull adds to that per 1000 prompt tokens. A pull's copy runs beside the decode worker's
  loop on its core (pdlab.kv.pull), so the worker's next step waits for part of it: on the 2-core Xeon a gap
  with one pull admitted grew 0.5-0.9 ms per 1000 tokens (cpu-demo, 2 KB a token; admit about 0.6 ms at none).
  Read only where the pulls' prompts span MIN_SPAN_KTOK or more (else 0 and admit is the plain median), by a
  Theil-Sen line through each gap's (prompt tokens, time) per hand-over: a few gaps the OS stretched do not
  tilt it. A push's KV is written by its prefill worker: its admits have no such term.

Each figure is the median over its samples (None without any); the samples counted are reported beside.
Steps and requests are a run's steps.jsonl and requests.jsonl lines (or the same fields from a cluster).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Optional

MIN_SAMPLES = 3  # fewer than this: the figure is not estimated
FIGURES = ("gap_ms", "hop_ms", "handoff_ms", "send_ms", "admit_ms", "admit_ktok_ms")  # host_times's `host` keys
MIN_SPAN_KTOK = 0.2  # thousands of prompt tokens the pulls admitted must span for admit_ktok_ms to be read


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


def median_ms(xs: list[float]) -> Optional[float]:
    """The median of seconds `xs` in ms; None with fewer than MIN_SAMPLES (the figure is not estimated)."""
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
    admit_ms, ktok_ms = admit_fit(ad)
    return {"gap_ms": median_ms(g), "hop_ms": median_ms(hops), "handoff_ms": median_ms(handoffs),
            "send_ms": median_ms(sn),
            "admit_ms": admit_ms, "admit_ktok_ms": ktok_ms,
            "samples": {"gaps": len(g), "hops": len(hops), "handoffs": len(handoffs), "sends": len(sn),
                        "admits": len(ad)}}


def admits(steps: list[dict], requests: list[dict]) -> list[tuple[float, float, bool]]:
    """One row per gap between back-to-back steps of a decode worker in which it admitted hand-overs: (seconds
    per hand-over beyond its median gap with none admitted, in the same variant, rate and repeat; thousands of
    prompt tokens per hand-over; whether every one of them was a pull)."""
    admitted: dict[tuple, list[tuple[float, float, bool]]] = defaultdict(list)
    for r in requests:
        ph = r.get("phases") or {}
        if r.get("decode_worker") and r.get("decode_worker") != r.get("prefill_worker") and "admitted" in ph:
            pulled = "transfer_start" in ph and "prefill_end" in ph and ph["transfer_start"] >= ph["prefill_end"]
            tokens = (r.get("prompt_len") or 0) - (r.get("cached_tokens") or 0)
            admitted[_key(r, r["decode_worker"])].append((ph["admitted"], tokens / 1000.0, pulled))
    out = []
    for k, pairs in back_to_back([s for s in steps if s.get("role") == "decode"]).items():
        got = sorted(admitted.get(k, []))
        times = [t for t, _, _ in got]
        rows = []
        for a, b in pairs:
            ins = got[bisect.bisect_left(times, a["end"]):bisect.bisect_right(times, b["start"])]
            rows.append((b["start"] - a["end"], ins))
        plain = [g for g, ins in rows if not ins]
        if len(plain) < MIN_SAMPLES:
            continue
        base = statistics.median(plain)
        out += [((g - base) / len(ins), sum(t for _, t, _ in ins) / len(ins), all(p for _, _, p in ins))
                for g, ins in rows if ins]
    return out


def admit_fit(rows: list[tuple[float, float, bool]]) -> tuple[Optional[float], Optional[float]]:
    """(admit_ms, admit_ktok_ms) from `admits` rows: a Theil-Sen line through the pulls' (thousands of tokens,
    ms) where their tokens span MIN_SPAN_KTOK, its slope no less than 0; else the median of every row, and 0
    for pulls all alike (their copy is in the median), None for pushes. Neither figure is below 0, however the
    gaps scatter. (None, None): fewer than MIN_SAMPLES rows."""
    if len(rows) < MIN_SAMPLES:
        return None, None
    pulls = [(x, y * 1000.0) for y, x, pulled in rows if pulled]
    if len(pulls) < MIN_SAMPLES:  # pushes: nothing said of a pull's copy
        return max(median_ms([y for y, _, _ in rows]), 0.0), None
    xs = [x for x, _ in pulls]
    if max(xs) - min(xs) < MIN_SPAN_KTOK:  # pulls all alike: the median holds their copy
        return max(median_ms([y for y, _, _ in rows]), 0.0), 0.0
    slopes = [(yb - ya) / (xb - xa) for i, (xa, ya) in enumerate(pulls) for xb, yb in pulls[i + 1:]
              if abs(xb - xa) >= MIN_SPAN_KTOK / 4]
    slope = max(statistics.median(slopes), 0.0) if slopes else 0.0
    base = statistics.median(y - slope * x for x, y in pulls)
    if base >= 0.0:
        return base, slope
    # An admission takes no negative time: where the gaps' noise puts the line's foot below 0 (a fast host, tiny
    # hand-overs), the line goes through 0 and its slope is the pulls' median ms per thousand tokens.
    through = [y / x for x, y in pulls if x > 0]  # not empty: the pulls' tokens span MIN_SPAN_KTOK
    return 0.0, max(statistics.median(through), 0.0)


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
