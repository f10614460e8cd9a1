"""The client's tags held against the server's own steps (a pdlab serve run's steps.jsonl, or any pdlab run's),
where client and server stamp one clock (time.monotonic() is system-wide: the same machine).

Each stream's gaps are matched to the steps of the worker that decoded it: the run's own record says which
(offline), or the server's record of the same response (`pdlab diagnose URL --steps-from SERVER_RUN`: the
server's record id is the response's SSE id plus `-<choice>`). Then:

- **precision**: of the gaps tagged stall, the share that overlap a step of their decode worker that carried
  prefill tokens;
- **recall**: of the gaps the server says a prefill interrupted (longer than the stand-out threshold, and
  overlapping such a step: pdlab's own prefill interruption, docs/design.md 2.10, at that threshold), the share
  tagged stall;
- **prefill time per 1k tokens** on the server: a line through (prefill tokens, duration) of the steps that
  carried prefill inside the fitted windows, beside the client's fitted stall per 1k tokens.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from pdlab.diagnose.fit import Fit
from pdlab.diagnose.streams import Stream
from pdlab.diagnose.tagging import Tagging
from pdlab.measure.attribution import StepIndex

CHOICE_SUFFIX = re.compile(r"-\d+$")


class ClockError(ValueError):
    """The steps and the client's times do not share a clock (another machine)."""


def workers(streams: list[Stream], server_requests: Optional[list[dict]]) -> dict[str, str]:
    """Stream id -> the server's decode worker, for every stream that can be matched."""
    by_response: dict[str, str] = {}
    for rec in server_requests or []:
        w, rid = rec.get("decode_worker"), str(rec.get("id"))
        if w is not None:
            by_response[rid] = w
            by_response.setdefault(CHOICE_SUFFIX.sub("", rid), w)
    out = {}
    for s in streams:
        w = s.worker if s.worker is not None else by_response.get(s.response_id or "")
        if w is not None:
            out[s.id] = w
    return out


def server_prefill_line(steps: list[dict], fit: Fit, tagging: Tagging) -> Optional[dict]:
    """The server's prefill time per 1k tokens, from the prefill steps inside the fitted windows."""
    windows = {w.id: w for w in tagging.windows}
    spans = [windows[p.window] for p in fit.points if p.window in windows]
    picked = [s for s in steps if int(s.get("prefill_tokens") or 0) > 0
              and any(s["start"] < w.end and s["end"] > w.start for w in spans)]
    x = np.asarray([int(s["prefill_tokens"]) for s in picked], dtype=float)
    if len(picked) < 3 or len(set(x.tolist())) < 2:
        return None
    y = np.asarray([1000.0 * (s["end"] - s["start"]) for s in picked], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return {"prefill_ms_per_1k_tokens": 1000.0 * float(slope), "intercept_ms": float(intercept), "steps": len(picked)}


def agreement(tagging: Tagging, streams: list[Stream], fit: Fit, steps: list[dict],
              server_requests: Optional[list[dict]] = None) -> dict:
    if not steps:
        raise ValueError("no steps to hold the tags against (steps.jsonl is empty)")
    of = workers(streams, server_requests)
    gaps = [g for g in tagging.gaps if g.stream in of]
    if gaps and (max(g.end for g in gaps) < min(s["start"] for s in steps)
                 or min(g.start for g in gaps) > max(s["end"] for s in steps)):
        raise ClockError("the steps and the client's token times do not overlap in time: they were not stamped on "
                         "one machine's clock (or belong to another session)")
    prefill = StepIndex([s for s in steps if int(s.get("prefill_tokens") or 0) > 0])
    limit = tagging.threshold.value_ms if tagging.threshold else None
    hit = {id(g): bool(prefill.overlapping(of[g.stream], g.start, g.end)) for g in gaps}
    stalls = [g for g in gaps if g.tag == "stall"]
    interrupted = [g for g in gaps if limit is not None and g.ms > limit and hit[id(g)]]
    coincide = sum(hit[id(g)] for g in stalls)
    tagged = sum(g.tag == "stall" for g in interrupted)
    server = server_prefill_line(steps, fit, tagging)
    client = fit.line.per_1k_ms if fit.line else None
    ratio = client / server["prefill_ms_per_1k_tokens"] if client is not None and server and \
        server["prefill_ms_per_1k_tokens"] > 0 else None
    return {"streams_matched": len({g.stream for g in gaps}), "streams": sum(s.background for s in streams),
            "stall_gaps": len(stalls), "stall_gaps_on_server_prefill": coincide,
            "precision": coincide / len(stalls) if stalls else None,
            "prefill_interrupted_gaps": len(interrupted), "prefill_interrupted_tagged_stall": tagged,
            "recall": tagged / len(interrupted) if interrupted else None,
            "server_prefill": server, "client_stall_ms_per_1k_tokens": client,
            "stall_over_prefill_per_1k": ratio}
