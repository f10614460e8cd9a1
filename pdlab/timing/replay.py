"""A run replayed in the simulator at the run's own pace: `pdlab profile --check RUN_DIR --replay`.

Why: on a shared box the same step takes longer minutes later (decode steps of one shape drifted x1.16 within
eight quiet minutes on the developers' 2-core VM, and runs took x1.07-1.7 their profile's steps; BENCHMARKS.md,
issue 25). A simulation from a profile measured before a run then misses by the box's drift, and that miss
says nothing of what the simulator adds to the step model: the scheduler and queueing, host time, hand-overs.
The replay takes the drift out worker by worker: each worker's pace (pdlab.sim.pace.WorkerPace) is read from
its own steps in the run: its busy time over what the profile predicts for the same steps (in all and rate by
rate), and the gaps between its steps. Each variant is then simulated with those paces and the run's own
hops (arrival, hand-over and send times, pdlab.timing.host; the profile's where the run has too few samples)
and the profile's transfer figures, at the rates and SLO the run resolved, with the run's seeds,
and its figures are set beside the run's: TTFT p50 and p90, the p90 over requests of each request's p99 ITL,
attainment, and output throughput at saturation.

The paces are read from the run, so a replay is not a prediction of the run: it holds everything but the
box's speed and noise to account (scheduling, queueing, placement, hand-overs). A forecast (a profile, then
`pdlab run --simulate`) carries both errors.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from pdlab.measure.metrics import repeat_spans
from pdlab.recipe.timing import TimingProfile
from pdlab.sim.pace import WorkerPace, paced_profile, quantiles
from pdlab.timing.check import busy_ratio
from pdlab.timing.contention import predicted_ms
from pdlab.timing.host import FIGURES, gaps
from pdlab.workload import rate_tag

# issue 25's targets for a simulation against its run: relative for the latencies and the saturation
# throughput, absolute for attainment
TARGETS = {"ttft_p50": 0.20, "ttft_p90": 0.25, "itl_p90": 0.25, "attainment": 0.15, "saturation": 0.15}
LATENCIES = ("ttft_p50", "ttft_p90", "itl_p90")
# host times a replay takes from the run; not its gaps, which its WorkerPace draws from, nor admit_ms: those
# drawn gaps hold the ones a hand-over lengthened, which the replay then does not add again
HOPS = tuple(k for k in FIGURES if k not in ("gap_ms", "admit_ms", "admit_ktok_ms"))


class ReplayError(ValueError):
    """A run that cannot be replayed (one line)."""


def worker_paces(profile: TimingProfile, steps: list[dict], workers: Sequence[str] = (),
                 requests: Optional[list[dict]] = None) -> dict[str, WorkerPace]:
    """worker -> its pace in `steps` (one variant's step records; warm-up left out, as the figures leave its
    requests out) against `profile`: its steps' measured time over their predicted time (in all, and per rate
    and repeat), and the quantiles of its gaps between back-to-back steps. Predicted as the simulator steps
    them: the step model with the profile's contention in each step's own context in the run (the others
    stepping, the worker idle before it; pdlab.timing.contention), so the pace is what contention leaves
    unexplained. A worker of `workers` that took no step (an idle replica) steps at the pace of all the others'
    steps together, not at the profile's. With `requests` (the run's records), a join step is predicted with its
    join_ktok_ms, as the simulator steps it."""
    steps = [s for s in steps if not s.get("warmup")]
    timed = [(s, p) for s, p in zip(steps, predicted_ms(profile, steps, requests)) if p is not None]

    def factor(rows: list[tuple[dict, float]]) -> Optional[float]:
        return busy_ratio([(s["end"] - s["start"]) * 1e3 for s, _ in rows], [p for _, p in rows]) if rows else None

    out = {}
    for w in sorted({s.get("worker") for s in steps if s.get("worker")}):
        rows = [(s, p) for s, p in timed if s.get("worker") == w]
        total = factor(rows)
        if total is None:
            continue
        runs = sorted({(rate_tag(float(s["rate"])), int(s.get("repeat") or 0)) for s, _ in rows})
        by_run = tuple((t, r, f) for t, r in runs
                       if (f := factor([(s, p) for s, p in rows if rate_tag(float(s["rate"])) == t
                                        and int(s.get("repeat") or 0) == r])) is not None)
        mine = [s for s in steps if s.get("worker") == w]
        out[w] = WorkerPace(total, quantiles([g * 1000.0 for g in gaps(mine)]), by_run)
    pooled = factor(timed) if out else None
    for w in workers:
        if w not in out and pooled is not None:
            out[w] = WorkerPace(pooled)
    return out


def figures(requests: list[dict], summary: dict) -> dict:
    """variant -> rate tag -> {ttft_p50, ttft_p90, itl_p90 (ms), attainment, output_tok_s} of a run's measured
    requests (warm-up left out; attainment as its summary has it; the output throughput from the requests,
    timed repeat by repeat, so a summary.json written before its pooled rates were timed so reads the same)."""
    out: dict = {}
    for v, vs in summary.get("variants", {}).items():
        for tag, rs in (vs.get("rates") or {}).items():
            sent = [r for r in requests if r.get("variant") == v and rate_tag(float(r["rate"])) == tag
                    and not r.get("warmup")]
            mine = [r for r in sent if r.get("ok")]
            ttft = [r["ttft"] * 1000 for r in mine]
            p99 = [float(np.percentile(r["itl"], 99)) * 1000 for r in mine if r.get("itl")]
            duration = repeat_spans(sent)[1]  # from each repeat's first arrival, as summarize_rate times it
            tok_s = sum(len(r["token_times"]) for r in mine) / duration if duration else None
            out.setdefault(v, {})[tag] = {"ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90),
                                          "itl_p90": _pct(p99, 90), "attainment": rs.get("attainment"),
                                          "output_tok_s": tok_s}
    return out


def _pct(xs: list[float], q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs else None


def _rel(sim: Optional[float], real: Optional[float]) -> Optional[float]:
    return None if sim is None or not real else (sim - real) / real


def compare(real: dict, sim: dict) -> dict:
    """{rows: per variant and rate {figure: {real, sim, error, ok}}, ranking: {real, sim, same, agree}}: the
    error of each figure against TARGETS (relative; attainment absolute; saturation only at the rate inf);
    `same`: the two orders of deployments (by saturation throughput, by mean attainment) are equal; `agree`:
    they are, but for ties within the target (_concordant)."""
    rows = []
    for v in real:
        for tag, a in real[v].items():
            b = sim.get(v, {}).get(tag, {})
            row: dict[str, Any] = {"variant": v, "rate": tag}
            for k in LATENCIES:
                e = _rel(b.get(k), a[k])
                row[k] = {"real": a[k], "sim": b.get(k), "error": e, "ok": e is not None and abs(e) <= TARGETS[k]}
            d = (None if a["attainment"] is None or b.get("attainment") is None
                 else b["attainment"] - a["attainment"])
            row["attainment"] = {"real": a["attainment"], "sim": b.get("attainment"), "error": d,
                                 "ok": d is not None and abs(d) <= TARGETS["attainment"]}
            if tag == "inf":
                e = _rel(b.get("output_tok_s"), a["output_tok_s"])
                row["saturation"] = {"real": a["output_tok_s"], "sim": b.get("output_tok_s"), "error": e,
                                     "ok": e is not None and abs(e) <= TARGETS["saturation"]}
            rows.append(row)
    ranks: dict[str, Any] = {}
    scores: dict[str, dict[str, dict[str, float]]] = {}
    for side, figs in (("real", real), ("sim", sim)):
        scores[side] = {"saturation": {v: figs[v].get("inf", {}).get("output_tok_s") or 0.0 for v in figs},
                        "attainment": {v: float(np.mean([x["attainment"] or 0 for t, x in figs[v].items()
                                                         if t != "inf"] or [0])) for v in figs}}
        ranks[side] = {k: sorted(figs, key=lambda v, k=k: -scores[side][k][v]) for k in scores[side]}
    ranks["same"] = ranks["real"] == ranks["sim"]
    ranks["agree"] = all(_concordant(scores["real"][k], scores["sim"][k], TARGETS[k], relative=k == "saturation")
                         for k in ("saturation", "attainment"))
    return {"rows": rows, "ranking": ranks}


def _concordant(real: dict[str, float], sim: dict[str, float], tol: float, relative: bool) -> bool:
    """Whether no two deployments are ordered one way by one side and the other way by the other, where either
    side sets them apart by more than `tol` (relative to their mean, or absolute). Two deployments within the
    target of each other on both sides are a tie, not a ranking: the order of a tie is noise (BENCHMARKS.md:
    the same run, run twice, swaps it)."""
    def diff(x: dict[str, float], a: str, b: str) -> float:
        d = x[a] - x[b]
        return d / ((x[a] + x[b]) / 2) if relative and x[a] + x[b] > 0 else d

    if set(real) != set(sim):
        return False  # a deployment one side lacks: no ranking to agree on
    names = list(real)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            dr, ds = diff(real, a, b), diff(sim, a, b)
            if dr * ds < 0 and max(abs(dr), abs(ds)) > tol:
                return False
    return True


def within(rows: list[dict], key: str = "ok") -> dict[str, tuple[int, int]]:
    """figure -> (rows within its target, rows with the figure); `key` "inside": rows whose real figure lies within
    a band itself (covered's rows)."""
    return {k: (sum(r[k][key] for r in rows if k in r), sum(k in r for r in rows)) for k in TARGETS}


def covered(real: dict, band: dict) -> list[dict]:
    """Each figure of `real` (figures: variant -> rate tag -> figure) against a forecast's band (pdlab.sim.band:
    its `lo` and `hi` figures): rows as compare's, each figure {real, lo, hi, inside: within the band, ok: within
    its target of some value in the band (the band widened by the target: relative for the latencies and the
    saturation throughput, absolute for attainment)}. Only variants the band has, and only rates both its ends
    simulated (a searched rate, or a relative one resolved otherwise, has nothing to be held against)."""
    rows = []
    for v in band.get("variants", {}):
        for tag, a in real.get(v, {}).items():
            ends = [band[e].get(v, {}).get(tag) for e in ("lo", "hi")]
            if None in ends:
                continue
            row: dict[str, Any] = {"variant": v, "rate": tag}
            keys = [(k, k) for k in LATENCIES + ("attainment",)] + ([("saturation", "output_tok_s")]
                                                                    if tag == "inf" else [])
            for k, f in keys:
                x, pair = a.get(f), [e.get(f) for e in ends]
                if x is None or None in pair:
                    row[k] = {"real": x, "lo": None, "hi": None, "inside": False, "ok": False}
                    continue
                lo, hi = sorted(pair)
                tol = TARGETS[k] if k == "attainment" else TARGETS[k] * abs(x)
                row[k] = {"real": x, "lo": lo, "hi": hi, "inside": lo <= x <= hi,
                          "ok": lo - tol <= x <= hi + tol}
            rows.append(row)
    return rows


def cell(x: dict, digits: int = 0, absolute: bool = False) -> str:
    """'real / sim error' with a ! where the target is missed; the error relative (%) or absolute."""
    if x["real"] is None:
        return "-"
    sim = "-" if x["sim"] is None else f"{x['sim']:.{digits}f}"
    err = "" if x["error"] is None else f" {x['error']:+.2f}" if absolute else f" {x['error'] * 100:+.0f}%"
    return f"{x['real']:.{digits}f} / {sim}{err}{'' if x['ok'] else ' !'}"


def table(cmp: dict, sides: tuple[str, str] = ("real", "simulated")) -> list[str]:
    """The comparison as lines of text: one per variant and rate, saturation beneath the rate inf; `sides`
    names the two figures set side by side (the cells read "first / second")."""
    out = [f"{'variant @ rate (req/s)':28} {'TTFT p50 ms':>20} {'TTFT p90 ms':>20} {'p99 ITL p90 ms':>20} "
           f"{'attainment':>20}"]
    for r in cmp["rows"]:
        out.append(f"{r['variant'] + ' @ ' + r['rate']:28} {cell(r['ttft_p50']):>20} {cell(r['ttft_p90']):>20} "
                   f"{cell(r['itl_p90'], 1):>20} {cell(r['attainment'], 2, absolute=True):>20}")
        if "saturation" in r:
            out.append(f"{'':28} saturation output tok/s {cell(r['saturation'])}")
    rk = cmp["ranking"]
    same = "the same" if rk["same"] else "the same but for a tie within the target" if rk.get("agree") else "DIFFERENT"
    a, b = sides
    out.append(f"ranking by saturation: {a} {rk['real']['saturation']}, {b} {rk['sim']['saturation']}; by "
               f"attainment: {a} {rk['real']['attainment']}, {b} {rk['sim']['attainment']}: {same}")
    return out


def replay_raw(raw: dict, summary: dict, requests: list[dict], variant: str, profile: TimingProfile) -> dict:
    """The run's recipe (raw, as recipe.yaml has it) for one variant, simulated with `profile`: the rates
    and SLO the run resolved (its requests' rates; summary.json's absolute SLO)."""
    if raw.get("rates") == "auto":
        raise ReplayError("the run searched its rates (rates: auto): a replay sets grid rates side by side; run the "
                          "recipe with a list of rates")
    rates = sorted({float(r["rate"]) for r in requests if r.get("variant") == variant})
    if not rates:
        raise ReplayError(f"variant {variant}: no requests in the run")
    slo = {k: v for k, v in (summary.get("slo") or {}).items() if v is not None}
    model = {k: v for k, v in dict(raw.get("model") or {}).items() if k != "check_timing"}
    model["timing"] = profile.to_raw()
    one = dict((raw.get("variants") or {})[variant] or {})
    if isinstance(one.get("model"), dict):
        one["model"] = {k: v for k, v in one["model"].items() if k not in ("timing", "check_timing")}
    return dict(raw, model=model, rates=[".inf" if math.isinf(r) else r for r in rates], slo=slo,
                variants={variant: one}, simulate=True)


def replay(run: Any, profile: Optional[TimingProfile] = None, checks: Optional[dict] = None) -> dict:
    """{paces: variant -> worker -> WorkerPace, profiles: variant -> profile name, comparison: compare's result}:
    each variant of `run` (pdlab.measure.records.Run) that ran its model and has a profile to check (`profile`,
    else the one its recipe names: pdlab.timing.check.profile_for), simulated at its workers' paces and set
    beside the run. `checks`: check_run's result for the same run and profile, where the caller has it (else it
    is computed here). Raises ReplayError (and pdlab.timing.check.CheckError)."""
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.timing.check import check_run, profile_for
    from pdlab.workload import build_workload

    if not run.recipe or not run.summary:
        raise ReplayError(f"{run.path}: no recipe.yaml or summary.json: nothing to replay")
    if run.env.get("simulated"):
        raise ReplayError(f"{run.path}: a simulated run: replay a real one")
    recipe = parse_recipe(run.recipe)
    variants = {n: recipe.resolved(n) for n in recipe.variant_names}
    if checks is None:
        checks = check_run(variants, run.steps, run.requests, profile)
    real, sim, paces, names = figures(run.requests, run.summary), {}, {}, {}
    for name, c in checks.items():
        if c["modelled"]:
            continue
        base = profile if profile is not None else profile_for(name, variants)[0]
        workers = [w.name for w in variants[name].deployment.workers]
        mine = worker_paces(base, [s for s in run.steps if s.get("variant") == name], workers, run.requests)
        if not mine:
            continue
        if set(mine) - set(workers):
            raise ReplayError(f"variant {name}: the run's steps name workers its deployment does not have "
                              f"({', '.join(sorted(set(mine) - set(workers)))}): was the recipe edited after the run?")
        own = {k: c["host"][k] for k in HOPS if c["host"].get(k) is not None}  # the run's, where it measured them
        base = paced_profile(base).replace(host=base.host.replace(**own, admit_ms=0.0, admit_ktok_ms=0.0))
        r = parse_recipe(replay_raw(run.recipe, run.summary, run.requests, name, base))
        res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()}, paces={name: mine})
        sim.update(figures(res.requests, res.summary()))
        paces[name], names[name] = mine, base.name
    if not paces:
        raise ReplayError(f"{run.path}: no variant that ran its model has steps and a profile to replay them with")
    return {"paces": paces, "profiles": names, "comparison": compare({v: real.get(v, {}) for v in paces}, sim)}
