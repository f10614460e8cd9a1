"""`pdlab compare`: runs side by side, in the shape of published PD results, as plain data (`compare --json`)
that the tables (pdlab.report.tables), the HTML report and the plots all read.

One row per (run, variant) (pdlab.report.rows). Goodput with its interval and bound, goodput relative to the
row's baseline, per device, TPOT goodput, output tok/s at saturation; latencies at one rate per row (on a
grid the *focus rate*: the highest rate every row measured at which every row's median TTFT still meets the
target; `--rate` picks another; with a rate search, each row's own last passing rate); misses by kind and
prefill interruptions over the finite rates; attainment per rate or the rates each search tried.

Like is paired with like: each engine family (pdlab, vllm, endpoint) has its own baseline (its first unified
variant), and each row is judged against its family's (pdlab.report.verdict). Where several families ran,
each row of the others is also judged against the first family's row of the same layout, as a cross-engine
comparison that says it is one. `--baseline` judges every row against one, naming the cross-engine pairs.

Runs are compared only when they share the SLO and the workload: anything else would judge unrelated numbers
against each other. A run cut short is named with its reason (`partial`); pdlab compare then exits 3.
"""

from __future__ import annotations

import math
from typing import Optional, Union

from pdlab.measure.metrics import as_rate
from pdlab.measure.records import Run
from pdlab.report.load import LoadedRun, from_run
from pdlab.report.rows import Row, build_row
from pdlab.report.stats import legend
from pdlab.report.terminal import render  # noqa: F401 - compare's printer, where callers look for it
from pdlab.report.verdict import Side, Verdict, judge, ratio_of
from pdlab.report.wording import sentence
from pdlab.traces.report import describe as describe_trace
from pdlab.workload import rate_tag


def _check_comparable(runs: list[LoadedRun]) -> None:
    """One line and a refusal when the runs were judged by different SLOs or fed different workloads."""
    first = runs[0]
    for run in runs[1:]:
        a, b = first.recipe, run.recipe
        for what, x, y in (("SLO", first.summary["slo"], run.summary["slo"]),
                           ("workload", a and a.shared.workload, b and b.shared.workload),
                           ("seed", a and a.seed, b and b.seed)):
            if x != y:
                raise ValueError(f"cannot compare {first.name} with {run.name}: different {what} "
                                 f"({x} vs {y}); compare runs of one recipe, or rerun with the same {what}")


def rows_of(runs: list[LoadedRun]) -> list[Row]:
    return [build_row(lr, v, v if len(runs) == 1 else f"{lr.name}/{v}") for lr in runs for v in lr.summary["variants"]]


def _focus(rows: list[Row], ttft_ms: Optional[float]) -> Optional[str]:
    """The highest rate every row measured at which every row's median TTFT meets the TTFT target."""
    common = [t for t in sorted({t for r in rows for t in r.met}, key=as_rate)
              if t != "inf" and all(t in r.met for r in rows)]
    target = ttft_ms or math.inf
    calm = [t for t in common if all((r.summary["rates"][t]["ttft_ms"]["p50"] or math.inf) <= target for r in rows)]
    return (calm or common[:1] or [None])[-1]


def pairs(rows: list[Row], baseline: Optional[Row] = None) -> tuple[dict[str, Row], list[tuple[Row, Row]]]:
    """(each row's baseline by label, the (baseline, row) pairs to judge); see the module docstring."""
    if baseline is not None:
        return {r.label: baseline for r in rows}, [(baseline, r) for r in rows if r is not baseline]
    families = list(dict.fromkeys(r.engine for r in rows))
    base = {f: next((r for r in rows if r.engine == f and r.layout == "unified" and r.ran),
                    next(r for r in rows if r.engine == f)) for f in families}
    out = [(base[r.engine], r) for r in rows if r is not base[r.engine]]
    for r in rows:
        if r.engine == families[0]:
            continue
        twin = next((x for x in rows if x.engine == families[0] and x.layout == r.layout and x.ran), None)
        if twin is not None:
            out.append((twin, r))
        elif not any(r in p for p in out):  # alone in its family, no twin: against the first family's baseline
            out.append((base[families[0]], r))
    return {r.label: base[r.engine] for r in rows}, out


def side(r: Row, ttft_p50: Optional[dict]) -> Side:
    """What the verdict reads of a row (its median TTFT at the latency table's rate)."""
    g = r.goodput
    return Side(r.label, g.stat.estimate(), engine=r.engine, layout=r.layout, timing=r.timing, bound=g.bound,
                open_above=g.open_above, open_below=g.open_below, capped=g.capped, limit=r.limit,
                itl_misses=r.itl_misses, ttft_misses=r.ttft_misses, prefill_interruptions=r.prefill_interruptions,
                throughput=r.saturation_tok_s.estimate() if r.saturation_tok_s.mean is not None else None,
                ttft_p50=ttft_p50["ttft_p50_ms"].estimate() if ttft_p50 else None, token_budget=r.token_budget,
                chunked=r.chunked, ran=r.ran, partial=r.partial)


def _row_dict(r: Row, base: Row, lat: Optional[dict]) -> dict:
    g, b = r.goodput.stat.mean, base.goodput.stat.mean
    return {"label": r.label, "run": r.run, "variant": r.variant, "engine": r.engine, "kind": r.layout,
            "timing": r.timing, "config": r.config, "ran": r.ran, "partial": r.partial, "baseline": base.label,
            "mode": r.mode,
            "goodput": r.goodput.to_dict(), "goodput_tpot": r.goodput_tpot.to_dict(),
            "relative_goodput": g / b if g is not None and b else None,
            "relative_bound": ratio_of(side(base, None), side(r, None))[1],
            "devices": r.devices, "goodput_per_device": g / r.devices if g is not None and r.devices else None,
            "saturation_tok_s": r.saturation_tok_s.to_dict() if r.saturation_tok_s.mean is not None else None,
            "met": {t: list(x) for t, x in r.met.items()},
            "attainment": {t: s.to_dict() for t, s in r.attainment.items()},
            "trials": [[list(x) for x in t] for t in r.trials], "saturation_rps": r.saturation_rps,
            "misses": r.misses, "sent": r.sent,
            "itl_misses": r.itl_misses, "ttft_misses": r.ttft_misses, "prefill_routes": r.prefill_routes,
            "prefill_interruptions": r.prefill_interruptions, "limit": r.limit, "mdl1": r.mdl1,
            "latencies": None if lat is None else {k: (v if k == "at" else v.to_dict()) for k, v in lat.items()}}


def _box(lr: LoadedRun) -> list[str]:
    """The box's lines (pdlab.measure.box): printed on their own, above the tables, not among the warnings."""
    return lr.summary["box"]["lines"] if lr.summary["box"] else []


def _about(runs: list[LoadedRun]) -> dict:
    """What the result says of the runs themselves, whatever they measured."""
    one = len(runs) == 1
    return {
        "runs": [{**lr.facts.to_dict(), "recipe_error": lr.recipe_error} for lr in runs],
        "partial": [{"run": lr.name, "reason": lr.summary["reason"] or "the run was cut short"}
                    for lr in runs if lr.summary["partial"]],
        "slo": runs[0].summary["slo"],
        "modelled": {("" if one else f"{lr.name}/") + v: d for lr in runs for v, d in lr.summary["modelled"].items()},
        # variant -> one line: the CPU kernels its workers ran (pdlab.measure.kernels)
        "kernels": {("" if one else f"{lr.name}/") + v: k["describe"] for lr in runs
                    for v, k in lr.summary["kernels"].items()},
        "box": [("" if one else f"{lr.name}: ") + x for lr in runs for x in _box(lr)],
        "warnings": [("" if one else f"{lr.name}: ") + w for lr in runs for w in lr.summary["warnings"]
                     if w not in _box(lr)]
        + [f"{lr.name}: configuration not shown: {lr.recipe_error}" for lr in runs if lr.recipe_error],
        "plan": next((lr.plan for lr in runs if lr.plan), None),
        # a run that replayed a trace: one line, the trace's reuse beside the prefix hits measured
        "traces": [("" if one else f"{lr.name}: ") + describe_trace(lr.summary["trace"]) for lr in runs
                   if lr.summary["trace"]],
    }


def compare(runs: list[Union[Run, LoadedRun]], baseline: Optional[str] = None, rate: Optional[float] = None) -> dict:
    """The comparison as plain data (what --json prints), of run directories as pdlab.report.load reads them
    (or as pdlab.measure.records.load_run does: completed here). A run stopped before it measured anything
    (a worker that failed to start) gives a result with no rows and its reason in `partial`. Raises ValueError
    for runs that cannot be compared, an unknown baseline, or complete runs without results."""
    runs = [r if isinstance(r, LoadedRun) else from_run(r) for r in runs]
    _check_comparable(runs)
    rows, about = rows_of(runs), _about(runs)
    if not rows:
        if not about["partial"]:
            raise ValueError("no variants with results in these runs")
        return {**about, "baseline": None, "baselines": {}, "mode": "grid", "focus_rate": None, "rates": [],
                "rows": [], "verdicts": [], "verdict": [], "legend": []}
    chosen = None
    if baseline is not None:
        chosen = next((r for r in rows if baseline in (r.label, r.variant)), None)
        if chosen is None:
            raise ValueError(f"baseline {baseline!r} not found; rows are: {', '.join(r.label for r in rows)}")
    base_of, judged = pairs(rows, chosen)
    slo = about["slo"]
    search = all(r.mode == "search" for r in rows)
    focus = None if search else (rate_tag(rate) if rate is not None else _focus([r for r in rows if r.ran],
                                                                                slo["ttft_ms"] if slo else None))
    lats = {r.label: r.latencies(focus) for r in rows}
    verdicts: list[Verdict] = [judge(side(b, lats[b.label]), side(r, lats[r.label])) for b, r in judged]
    stats = [s for r in rows for s in (r.goodput.stat, r.goodput_tpot.stat, r.saturation_tok_s)] + [
        s for lat in lats.values() if lat for k, s in lat.items() if k != "at"]
    return {
        **about,
        "baseline": base_of[rows[0].label].label,
        "baselines": {r.engine: base_of[r.label].label for r in rows},
        "mode": "search" if search else "grid", "focus_rate": focus,
        "rates": sorted({t for r in rows for t in r.met}, key=as_rate),
        "rows": [_row_dict(r, base_of[r.label], lats[r.label]) for r in rows],
        "verdicts": [v.to_dict() | {"sentence": sentence(v)} for v in verdicts],
        "verdict": [sentence(v) for v in verdicts],
        "legend": legend(stats),
    }
