"""Contention: what a worker's steps cost beyond the step model on a host it shares with other workers, read
from steps recorded together (a run's, or `pdlab profile`'s host probe's).

The profile's steps are measured in one process, alone on the box and back to back. A deployment's workers are
neither: on a CPU box they share the last-level cache and the memory bandwidth, so a step runs slower while
the others step (co-running), and a worker that waited for work finds its weights and KV evicted, or its core
asleep, and its next step runs slower (a cold step). On this project's 2-core boxes both showed in runs held
against a fresh profile: prefill steps x1.07-1.16 beside a stepping neighbour, decode steps x1.02-1.06, and a
step after 50 ms idle +1.5-2.8 ms (BENCHMARKS.md, issue 25). They are a host's figures, like the host time
(pdlab.timing.host): measured where the workers run, not assumed; on a box where workers do not share (GPUs
on their own memory) they come out at x1 and 0 ms.

Each step's context (`context`): the share of the other workers of its (variant, rate, repeat) stepping during
it, and the time since its worker's previous step ended (None for a worker's first step). `estimate` reads
the profile's ContentionTiming from steps and the step model that predicts them:

- cold_ms: the median of measured - predicted over cold steps with no other worker stepping (the step model
  was fitted on warm ones: what is left over is the cold cost), predicted at the pace of the warm steps of its
  kind (prefill or decode-only) with none stepping (a run on a box slower than its profile's does not count
  its slowness as cold time; a kind with too few such steps leaves its cold steps out);
- prefill_x, decode_x: the median of measured / predicted over steps of that kind while the other workers
  stepped (TOGETHER or more of the step's time; a cold step's cold_ms taken off first), over the same for warm
  steps with none stepping (with fewer of those than MIN_SAMPLES, over the warm alone steps of any kind:
  the model's own steps were warm and alone, so on the profile's box that is about 1); the excess is divided
  by the mean share the steps were together, so x is for all others stepping.

- decode_spread, decode_spread_beside: the quantiles (constants.SPREAD_LEVELS) of measured / predicted over
  warm decode-only steps alone (beside: with the others stepping TOGETHER or more), each over its median: how
  a decode step's time spreads around its model, by context. On the 2-core Xeon the steps of a decode worker
  beside a prefill worker spread to x1.44-1.49 at p99 (alone x1.16-1.28) with their median at x1.0-1.05: a
  run's p99 ITL is that tail, which a mean factor does not give.

- after_prefill_x, after_prefill_decay: a decode-only step right after its worker's step with prefill tokens
  over settled ones (SETTLED_AFTER or more decode steps after one), and how much of that excess each next
  decode step keeps (after_prefill_fit). Unified workers on the 2-core Xeon: x1.33-1.61 right after, x1.19-1.39
  the next, about x0.7 of the excess kept each step. A disaggregated decode worker never prefills: none.

- join_ktok_ms (with the steps' requests): a decode worker's step after it admitted hand-overs, per 1000 tokens
  admitted, over its plain steps (pdlab.timing.join); the spreads then leave out those steps and the ones after.

A figure with fewer than MIN_SAMPLES steps behind it is not estimated (None); a spread, with fewer than
MIN_SPREAD.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pdlab.constants import COLD_AFTER_MS, SPREAD_LEVELS
from pdlab.recipe.timing import ContentionTiming
from pdlab.sim.pace import quantiles
from pdlab.timing.fit import predict
from pdlab.timing.join import join_fit, join_rows, joins
from pdlab.timing.records import samples

MIN_SAMPLES = 5
MIN_SPREAD = 20  # steps behind a spread: its p99 is then about the largest of them
AFTER_STEPS = 6  # decode steps after a prefill the after-prefill fit reads (k = 0..5)
SETTLED_AFTER = 12  # decode steps after a prefill that count as settled (its excess gone: x1.02-1.09 by then)
# shares of the others stepping (time-weighted) that count as alone and as stepping together: a worker stepping
# back to back covers ~90-95% of the time (its gaps between steps), so together starts below that
ALONE, TOGETHER = 0.1, 0.75


@dataclass(frozen=True)
class StepContext:
    others_busy: float  # the share of the other workers stepping during the step, time-weighted (0 with none)
    idle_ms: Optional[float]  # since the worker's previous step ended; None: its first step
    since_prefill: Optional[int] = None  # decode-only steps since its worker's last one with prefill tokens

    @property
    def cold(self) -> bool:
        return self.idle_ms is None or self.idle_ms >= COLD_AFTER_MS


def _group(s: dict) -> tuple:
    return s.get("variant"), s.get("rate"), s.get("repeat", 0), bool(s.get("warmup"))


def context(steps: list[dict]) -> list[StepContext]:
    """Each step's context, in the order given (steps grouped by variant, rate, repeat and warm-up; a
    worker's steps follow each other by start time)."""
    groups: dict[tuple, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, s in enumerate(steps):
        groups[_group(s)][s.get("worker")].append(i)
    out: list[Optional[StepContext]] = [None] * len(steps)
    for workers in groups.values():
        spans = {w: _Spans(sorted((steps[i]["start"], steps[i]["end"]) for i in idx)) for w, idx in workers.items()}
        for w, idx in workers.items():
            others = [spans[o] for o in spans if o != w]
            prev_end, since = None, None
            for i in sorted(idx, key=lambda i: steps[i]["start"]):
                a, b = steps[i]["start"], steps[i]["end"]
                busy = sum(sp.overlap(a, b) for sp in others) / (max(b - a, 1e-9) * len(others)) if others else 0.0
                idle = None if prev_end is None else max(0.0, a - prev_end) * 1e3
                out[i] = StepContext(min(busy, 1.0), idle, since)
                prev_end = b
                since = 0 if steps[i].get("prefill_tokens") else None if since is None else since + 1
    return out  # type: ignore[return-value]


class _Spans:
    """One worker's steps, (start, end) sorted and disjoint: how much of [a, b) they cover."""

    def __init__(self, spans: list[tuple[float, float]]):
        self.spans = spans
        self.ends = [e for _, e in spans]

    def overlap(self, a: float, b: float) -> float:
        total, i = 0.0, bisect.bisect_right(self.ends, a)
        while i < len(self.spans) and self.spans[i][0] < b:
            s, e = self.spans[i]
            total += max(0.0, min(b, e) - max(a, s))
            i += 1
        return total


def estimate(coef: dict, steps: list[dict], own_cpu: bool = False, requests: Optional[list[dict]] = None) -> dict:
    """{prefill_x, decode_x, cold_ms, after_prefill_x, after_prefill_decay, decode_spread, decode_spread_beside,
    main_step_ms} (None where not estimated), {alone: kind -> the median of warm steps alone over the model (None
    with fewer than MIN_SAMPLES)} and {samples}: from `steps` (records with step counts) against the
    step model `coef` (StepTiming.to_raw()). A decode step's factor beside stepping workers and its spread are
    read with what its worker's last prefill left taken off, so that a simulation applying both counts it once.
    `own_cpu`: each step measured by its own CPU time (`cpu_s`, where it has it) rather than its wall time, its
    context still from the wall times (what the main process took is then main_step_ms's alone). With
    `requests` (their records: admitted times), join_ktok_ms too (pdlab.timing.join)."""
    ctx = context(steps)
    modelled = _modelled(coef, steps)
    rows = [_Row(s.get("prefill_tokens", 0) > 0, s.get("decode_seqs", 0),
                 s["cpu_s"] * 1e3 if own_cpu and s.get("cpu_s") is not None else mp[0], mp[1], c, i)
            for i, (s, mp, c) in enumerate(zip(steps, modelled, ctx)) if mp is not None]
    warm = [r for r in rows if not r.c.cold and r.c.others_busy <= ALONE]
    pace = statistics.median(r.ratio for r in warm) if len(warm) >= MIN_SAMPLES else 1.0
    # A run on a slower box is not cold time: each cold step is predicted at the pace of the warm steps of its kind
    # alone. A kind with too few of those leaves its cold steps out (with warm steps too few of any kind, the
    # model's own pace, 1): one kind's pace is not the other's, and over a prefill of hundreds of tokens the gap is
    # more than a cold cost (2026-12-07, a unified run's cold steps, all prefills, at its decode steps' pace x0.80
    # while its prefills stepped x1.08-1.16: +46 ms "cold" against 2.8 ms from its 1P1D run)
    paces = ({kind: statistics.median(xs) for kind in (True, False)
              if len(xs := [r.ratio for r in warm if r.prefill == kind]) >= MIN_SAMPLES}
             if len(warm) >= MIN_SAMPLES else {True: 1.0, False: 1.0})
    cold = [r.m - r.p * paces[r.prefill] for r in rows
            if r.c.cold and r.c.others_busy <= ALONE and r.prefill in paces]
    cold_ms = statistics.median(cold) if len(cold) >= MIN_SAMPLES else None
    off = max(cold_ms or 0.0, 0.0)
    out: dict = {"cold_ms": None if cold_ms is None else max(cold_ms, 0.0), "samples": {"cold": len(cold)}}
    decode = [r for r in rows if not r.prefill and not r.c.cold]
    fitted = after_prefill_fit({k: [r.ratio for r in decode if r.c.since_prefill == k] for k in range(AFTER_STEPS)},
                               [r.ratio for r in decode if r.c.since_prefill is None
                                or r.c.since_prefill >= SETTLED_AFTER])
    out["after_prefill_x"], out["after_prefill_decay"] = fitted or (None, None)
    out["samples"]["after_prefill"] = sum(1 for r in decode if r.c.since_prefill == 0)
    left = ContentionTiming(after_prefill_x=fitted[0], after_prefill_decay=fitted[1]) if fitted else ContentionTiming()

    def own(r: _Row) -> float:
        """A step's measured time less what its worker's last prefill left to it (counted once, there)."""
        return r.m if r.prefill else r.m / left.after_prefill(r.c.since_prefill)

    for kind, prefill in (("prefill", True), ("decode", False)):
        mine = [((own(r) - (off if r.c.cold else 0.0)) / max(r.p, 1e-9), r.c.others_busy) for r in rows
                if r.prefill == prefill and r.c.others_busy >= TOGETHER]
        alone = [own(r) / max(r.p, 1e-9) for r in rows
                 if r.prefill == prefill and not r.c.cold and r.c.others_busy <= ALONE]
        mid = statistics.median(alone) if len(alone) >= MIN_SAMPLES else None
        out.setdefault("alone", {})[kind] = mid
        base = mid if mid is not None else pace
        x = None
        if len(mine) >= MIN_SAMPLES:  # the excess at the share these stepped beside, taken to all the others
            share = statistics.mean(b for _, b in mine)
            x = max(1.0 + (statistics.median(q for q, _ in mine) / base - 1.0) / share, 1e-3)
        out[f"{kind}_x"] = x
        out["samples"][kind] = {"together": len(mine), "alone": len(alone)}
    out["main_step_ms"], out["samples"]["main"] = main_step(steps, ctx)
    joined: set[int] = set()  # a join step and the one after it: join_ktok_ms is theirs, not the spreads'
    if requests is not None:
        ktok, after = joins(steps, requests)
        cold = {i for i, c in enumerate(ctx) if c.cold}
        out["join_ktok_ms"], out["samples"]["join"] = join_fit(join_rows(steps, modelled, ktok, after, cold))
        joined = set(ktok) | after
    for key, keep in (("decode_spread", lambda c: c.others_busy <= ALONE),
                      ("decode_spread_beside", lambda c: c.others_busy >= TOGETHER)):
        rs = [(r.seqs, own(r) / max(r.p, 1e-9)) for r in rows
              if not r.prefill and not r.c.cold and keep(r.c) and r.i not in joined]
        out[key] = spread(rs) if len(rs) >= MIN_SPREAD else None
        out["samples"][key] = len(rs)
    return out


def main_step(steps: list[dict], ctx: list[StepContext]) -> tuple[Optional[float], int]:
    """(main_step_ms, steps read): the main process's time per worker step as pdlab.sim.host_load takes it,
    from what the steps lost to other processes (wall time less their own CPU time, `cpu_s`) while the other
    workers stepped. In each (variant, rate, repeat) it takes D = main_step_ms x the steps' rate from the workers
    while every worker steps, so what they lose then is D times the time they all step (each step's
    others-stepping share times its time, summed over the workers' steps and divided by their number; with one
    worker, its steps' time). None where no steps carry cpu_s (timed workers, GPUs, older runs)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        if s.get("cpu_s") is not None and not s.get("warmup"):
            groups[_group(s)].append(i)
    lost = together_steps = 0.0
    read = 0
    for idx in groups.values():
        span = max(steps[i]["end"] for i in idx) - min(steps[i]["start"] for i in idx)
        workers = {steps[i].get("worker") for i in idx}
        if span <= 0 or len(idx) < MIN_SAMPLES:
            continue
        walls = {i: steps[i]["end"] - steps[i]["start"] for i in idx}
        together = (sum(walls.values()) if len(workers) == 1 else
                    sum(ctx[i].others_busy * walls[i] for i in idx) / len(workers))
        # what a step lost while the others stepped: the rest went to its own threads (a pull's copy), or to a
        # process the scheduler could have put on an idle core
        lost += sum(max(walls[i] - steps[i]["cpu_s"], 0.0) * (1.0 if len(workers) == 1 else ctx[i].others_busy)
                    for i in idx)
        together_steps += len(idx) / span * together  # worker steps in the time they all stepped
        read += len(idx)
    if not read or together_steps <= 0:
        return None, read
    return 1000.0 * lost / together_steps, read


@dataclass(frozen=True)
class _Row:
    prefill: bool  # the step has prefill tokens
    seqs: int  # its decode sequences
    m: float  # measured ms
    p: float  # the step model's ms
    c: StepContext
    i: int = -1  # its index in the steps read

    @property
    def ratio(self) -> float:
        return self.m / max(self.p, 1e-9)


def after_prefill_fit(by_k: dict[int, list[float]], settled: list[float]) -> Optional[tuple[float, float]]:
    """(after_prefill_x, after_prefill_decay) from decode steps' measured / predicted by k, the decode steps
    since their worker's last prefill (0..AFTER_STEPS-1), over the median of `settled` ones (SETTLED_AFTER or
    more after one, or none before): x is k = 0's, and the decay the ratio of the excesses' sums over k >= 1
    and k < AFTER_STEPS - 1 (exact for a geometric fall). None with fewer than MIN_SAMPLES at any k or
    settled."""
    if len(settled) < MIN_SAMPLES or any(len(by_k.get(k, ())) < MIN_SAMPLES for k in range(AFTER_STEPS)):
        return None
    base = statistics.median(settled)
    excess = [max(statistics.median(by_k[k]) / base - 1.0, 0.0) for k in range(AFTER_STEPS)]
    decay = sum(excess[1:]) / sum(excess[:-1]) if sum(excess[:-1]) > 0 else 0.0
    return 1.0 + excess[0], min(max(decay, 0.0), 1.0)


def spread(ratios: list[tuple[int, float]]) -> tuple[float, ...]:
    """The quantiles at SPREAD_LEVELS of (batch size, measured / predicted) ratios, each over the median of its
    batch size's (of all of them, for a batch size with fewer than MIN_SAMPLES steps): the step model's error
    by step shape is not spread, and a probe's steps come in a few shapes it fits less well than a run's."""
    by: dict[int, list[float]] = defaultdict(list)
    for n, r in ratios:
        by[n].append(r)
    whole = float(np.median([r for _, r in ratios]))
    mid = {n: float(np.median(rs)) if len(rs) >= MIN_SAMPLES else whole for n, rs in by.items()}
    return quantiles([x / max(mid[n], 1e-9) for n, x in ratios], SPREAD_LEVELS)


SPREADS = ("decode_spread", "decode_spread_beside")
FIGURES = ("prefill_x", "decode_x", "cold_ms", "after_prefill_x", "after_prefill_decay") + SPREADS + (
    "main_step_ms", "join_ktok_ms")  # its keys


def contention_raw(est: dict) -> dict:
    """A profile's `contention` block from an estimate: the figures it has."""
    return {k: [round(x, 4) for x in est[k]] if k in SPREADS else round(est[k], 4)
            for k in FIGURES if est.get(k) is not None}


def tail(qs: object) -> str:
    """'p90 x1.07, p99 x1.24' of a spread (its quantiles at SPREAD_LEVELS)."""
    q = dict(zip(SPREAD_LEVELS, qs))  # type: ignore[call-overload]
    return f"p90 x{q[0.9]:.2f}, p99 x{q[0.99]:.2f}"


def describe(raw: dict) -> str:
    """'prefill x1.09, decode x1.03 beside stepping workers; a cold step +2.1 ms; decode steps spread p90 x1.07,
    p99 x1.24 alone, p90 x1.15, p99 x1.5 beside' from a contention block (the figures it has; 'none' without
    any)."""
    parts = []
    beside = [f"{k[:-2]} x{raw[k]:.3g}" for k in ("prefill_x", "decode_x") if raw.get(k) is not None]
    if beside:
        parts.append(", ".join(beside) + " beside stepping workers")
    if raw.get("cold_ms") is not None:
        parts.append(f"a cold step +{raw['cold_ms']:.3g} ms")
    if raw.get("after_prefill_x") is not None:
        parts.append(f"a decode step after a prefill x{raw['after_prefill_x']:.3g}, each next one keeping "
                     f"{raw.get('after_prefill_decay', 0.0):.2g} of the excess")
    spreads = [f"{tail(raw[k])} {'beside' if k.endswith('beside') else 'alone'}" for k in SPREADS if raw.get(k)]
    if spreads:
        parts.append("decode steps spread " + ", ".join(spreads))
    if raw.get("join_ktok_ms") is not None:
        parts.append(f"a decode worker's step after it admits +{raw['join_ktok_ms']:.3g} ms per 1000 tokens admitted")
    if raw.get("main_step_ms") is not None:
        parts.append(f"the main process {raw['main_step_ms']:.3g} ms a worker step")
    return "; ".join(parts) or "none"


def predicted_ms(profile: object, steps: list[dict], requests: Optional[list[dict]] = None) -> list[Optional[float]]:
    """Each step's time as the simulator would model it in the step's own context: the step model, with the
    profile's contention (None for a step that computed nothing); with `requests` (the run's records: when each
    hand-over was admitted), a decode worker's join step carries join_ktok_ms too (pdlab.timing.join), as the
    simulator's does. Without them it does not: about 2% of a disaggregated decode worker's steps."""
    coef = profile.step.to_raw()  # type: ignore[attr-defined]
    con = profile.contention  # type: ignore[attr-defined]
    ktok = joins(steps, requests)[0] if requests is not None and con.join_ktok_ms > 0 else {}
    return [None if mp is None else 1e3 * con.step_s(mp[1] / 1e3, s.get("prefill_tokens", 0) > 0, c.others_busy,
                                                      c.cold, since_prefill=c.since_prefill)
            + con.join_ktok_ms * ktok.get(i, 0.0)
            for i, (s, mp, c) in enumerate(zip(steps, _modelled(coef, steps), context(steps)))]


def _modelled(coef: dict, steps: list[dict]) -> list[Optional[tuple[float, float]]]:
    """Each step's (measured ms, the step model's ms), in one prediction over all of them; None for a step
    that computed nothing or was preempted (pdlab.timing.records.samples leaves it out)."""
    out: list[Optional[tuple[float, float]]] = [None] * len(steps)
    idx, ss = [], []
    for i, s in enumerate(steps):
        for sample in samples([s]):  # none, or the step as a sample
            idx.append(i)
            ss.append(sample)
    for i, sample, p in zip(idx, ss, predict(coef, ss) if ss else []):
        out[i] = (sample.ms, float(p))
    return out
