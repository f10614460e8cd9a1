"""The join step: a decode worker's first step after it admitted hand-overs, read from a run's steps and requests.

A hand-over's KV is written by another core than the decode worker's: on a push by the prefill worker, straight into
the decode worker's blocks; on a pull by the copy beside the decode worker's loop. On a CPU host the workers share the
memory, and the decode worker's first step over that KV (the step the request joins) reads lines another core wrote
last: it runs longer by about the KV it reads. On the 2-core AVX2 EPYC (cpu-demo, 2 KB of KV a token) a push decode
worker's join step ran 0.57-0.64 ms per 1000 prompt tokens over its plain steps' pace (the step after it 0.12-0.16
more), a pull decode worker's 0.37-0.53 (BENCHMARKS.md, 2026-12-07 third session). Every request's second token
waits for its own join step, and a decode worker's slowest steps are its joins: a request's p99 ITL is there. The
step model (measured on steps whose KV the measuring process wrote itself) leaves it out; the contention block
carries it (`join_ktok_ms`) and the simulator adds it to a decode worker's next step after an admit.

`join_fit` reads it, per decode worker and (variant, rate, repeat): the join steps (decode-only, with hand-overs
admitted since the worker's step before, and warm: a join after its worker idled is a cold step, whose excess is
contention.cold_ms's) against the plain ones (decode-only, warm, none admitted since either of the two steps before:
the step after a join is not plain); each join step's excess is its measured time less its model's times the plain
steps' median measured / model; then the slope of a Theil-Sen line through (thousands of tokens admitted, excess ms),
where the tokens span MIN_SPAN_KTOK (else the median of excess / thousands of tokens), no
less than 0. The line's foot (-0.3 to 0.3 ms in those runs) is left out: the cost is the KV read.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Optional

MIN_SAMPLES = 5  # join steps behind the figure
MIN_PLAIN = 20  # plain steps behind a worker's pace
MIN_SPAN_KTOK = 0.2  # thousands of tokens the joins must span for a line
MAX_ROWS = 800  # join steps a line is drawn through


def admitted(requests: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
    """(variant, rate, repeat, decode worker) -> sorted (admitted time, thousands of prompt tokens handed over):
    the hand-overs each decode worker admitted (not a request prefilled where it decodes)."""
    out: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for r in requests:
        ph = r.get("phases") or {}
        if r.get("decode_worker") and r.get("decode_worker") != r.get("prefill_worker") and "admitted" in ph:
            tokens = (r.get("prompt_len") or 0) - (r.get("cached_tokens") or 0)
            out[(r.get("variant"), r.get("rate"), r.get("repeat", 0), r["decode_worker"])].append(
                (ph["admitted"], max(tokens, 0) / 1000.0))
    return {k: sorted(v) for k, v in out.items()}


def joins(steps: list[dict], requests: list[dict]) -> tuple[dict[int, float], set[int]]:
    """({index of a decode worker's step: thousands of tokens it admitted since its step before}, {the index of
    each such step's next step}), over `steps` (a run's records) and the `requests` that say when they were
    admitted."""
    got = admitted(requests)
    ktok: dict[int, float] = {}
    after: set[int] = set()
    for k, idx in decode_steps(steps).items():
        mine = got.get(k)
        if not mine:
            continue
        times = [t for t, _ in mine]
        prev_end, prev = None, None
        for i in idx:  # the hand-overs admitted since the worker's step before (all before its first)
            lo = 0 if prev_end is None else bisect.bisect_left(times, prev_end)
            n = sum(x for _, x in mine[lo:bisect.bisect_right(times, steps[i]["start"])])
            if n > 0:
                ktok[i] = n
            if prev in ktok:
                after.add(i)
            prev_end, prev = steps[i]["end"], i
    return ktok, after


def decode_steps(steps: list[dict]) -> dict[tuple, list[int]]:
    """(variant, rate, repeat, worker) -> the indices of its decode worker's steps (warm-up left out), by start."""
    by: dict[tuple, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        if s.get("role") == "decode" and not s.get("warmup"):
            by[(s.get("variant"), s.get("rate"), s.get("repeat", 0), s.get("worker"))].append(i)
    for idx in by.values():
        idx.sort(key=lambda i: steps[i]["start"])
    return by


def join_rows(steps: list[dict], modelled: list, ktok: dict[int, float], after: set[int],
              cold: set[int]) -> list[tuple[float, float]]:
    """(thousands of tokens admitted, excess ms) per decode-only join step, against its worker's plain steps'
    pace. `modelled`: each step's (measured ms, model ms) or None, in the order of `steps`; `ktok` and `after`:
    `joins` of them; `cold`: the steps after their worker idled (pdlab.timing.contention.context), which are
    neither: a cold step's excess is contention.cold_ms's, which the simulator adds to it too, and a worker that
    idled until a hand-over came (requests one at a time: the host probe's first ones, a run's lowest rates) has
    only such joins."""
    out = []
    for mine in decode_steps(steps).values():
        idx = [i for i in mine if i not in cold and modelled[i] is not None and not steps[i].get("prefill_tokens")]
        plain = [modelled[i][0] / modelled[i][1] for i in idx
                 if i not in ktok and i not in after and modelled[i][1] > 0]
        if len(plain) < MIN_PLAIN or not any(i in ktok for i in idx):
            continue
        pace = statistics.median(plain)
        out += [(ktok[i], modelled[i][0] - modelled[i][1] * pace) for i in idx if i in ktok]
    return out


def join_fit(rows: list[tuple[float, float]]) -> tuple[Optional[float], int]:
    """(join_ktok_ms, join steps read) from `join_rows`; None with fewer than MIN_SAMPLES."""
    if len(rows) < MIN_SAMPLES:
        return None, len(rows)
    n = len(rows)
    rows = rows[::-(-n // MAX_ROWS)]  # the pairs' slopes grow as n^2: a run's joins, evenly thinned
    xs = [x for x, _ in rows]
    if max(xs) - min(xs) < MIN_SPAN_KTOK:  # joins all alike: no line, the median per thousand tokens
        return max(statistics.median(y / x for x, y in rows), 0.0), n
    slopes = [(yb - ya) / (xb - xa) for i, (xa, ya) in enumerate(rows) for xb, yb in rows[i + 1:]
              if abs(xb - xa) >= MIN_SPAN_KTOK / 4]
    return (max(statistics.median(slopes), 0.0) if slopes else 0.0), n
