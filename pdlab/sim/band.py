"""A forecast's band: the recipe simulated again with every worker at the slow and at the fast end of the box's
drift against its profile (the profile's `drift`, pdlab.timing.drift), and at its median (the band's centre),
at the rates and SLO the forecast resolved, so that a forecast says how far the box's pace alone moves each
figure at the same absolute load, and where the runs checked with the profile put it.
A recipe written relative to the box (rates `0.5x`, a relative SLO) is held at what the forecast resolved
too: a real run on a slower box resolves lower rates and a looser SLO, which the band does not follow.

Why: a forecast steps every worker at the profile's pace, and a shared box does not keep it: on the developers'
2-core VM a forecast met every target against one run and missed 7 of 108 checks against the next, 4 of
them cells that the replay of that run at its own pace met (BENCHMARKS.md, issue 25). The band is what the
runs the profile was checked against say about that drift; a profile checked against none gives none.

How: in each variant whose profile has a band, every worker steps at the band's factor
(pdlab.sim.pace.WorkerPace: the step model with the profile's contention, times the factor), as the replay
steps a run's workers at their own pace, so the factors mean what they meant when they were read; the main
process's share of the workers' cores is not added again (the factors hold it, as the replay's paces do).
Gaps, hops and transfers are the profile's. The figures are the replay's and the validation's
(pdlab.timing.replay.figures): TTFT p50 and p90, the p90 over requests of each request's p99 ITL, attainment,
and output throughput at saturation (rate inf); and, where a variant searched its rates, its goodput.

The centre: the point forecast steps every worker at the profile's own pace, the pace of the minute it was
measured in; the drift's median is the pace the box's checked runs stepped at. Over six validations on the
developers' Xeon (BENCHMARKS.md, 2026-12-07 fifth session; benchmarks/band_rescore.py) the centre, from the drift
the profile had when each recipe was forecast (a calibration run's, then each scored recipe's runs), met 576 of 612
figures where the point forecast met 553 (the worst validation 88 of 102 where the point forecast's worst was 78;
better in four validations, 3 figures worse in each of two), and from the calibration run's drift alone 563; a
seventh, scored as it ran (timing_validation), met 85 against the point forecast's 87. Both are printed: the point
forecast is the profile's, the centre what the runs checked with it say.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from pdlab.constants import DRIFT_LEVELS, PACE_DRIFT
from pdlab.measure.slots import slots_warning
from pdlab.recipe import SLO, Recipe
from pdlab.sim.pace import WorkerPace, paced_profile


def bands(recipe: Recipe) -> dict[str, tuple[float, float]]:
    """variant -> its profile's band (lo, hi), for the variants whose profile has one."""
    out = {}
    for name, v in recipe.variants.items():
        timing = v.model.timing
        band = timing.drift.band() if timing is not None else None
        if band is not None:
            out[name] = band
    return out


def at_pace(recipe: Recipe, slo: SLO, variants: dict[str, float]) -> tuple[Recipe, dict[str, dict[str, WorkerPace]]]:
    """The recipe of `variants` (name -> factor) with `slo` fixed and the main process's share left to the
    factors; each of their workers' pace."""
    chosen = {}
    for name, factor in variants.items():
        v = recipe.variants[name]
        chosen[name] = replace(v, slo=slo, model=v.model.replace(timing=paced_profile(v.model.timing)))
    fixed = replace(recipe, shared=recipe.shared.replace(slo=slo), variants=chosen)
    paces = {n: {w.name: WorkerPace(f) for w in recipe.variants[n].deployment.workers} for n, f in variants.items()}
    return fixed, paces


def forecast_band(recipe: Recipe, slo: SLO, workloads: dict[str, Any]) -> Optional[dict]:
    """{levels, variants: name -> {pace: [lo, hi], median, paces, runs}, lo, mid, hi: figures at each end and at
    the drift's median (variant -> rate tag -> figure), goodput: {lo, mid, hi}: variant -> goodput where searched,
    slots: {lo, mid, hi}: variant -> its decode_slots}; None where no variant's profile has a band.
    `recipe`: as the forecast resolved it (absolute rates); `slo`: the absolute SLO it resolved."""
    # deferred: torch
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.timing.replay import figures

    found = bands(recipe)
    if not found:
        return None
    drifts = {n: recipe.variants[n].model.timing.drift for n in found}
    out: dict = {"levels": list(DRIFT_LEVELS),
                 "variants": {n: {"pace": list(b), "median": drifts[n].median(),
                                  "paces": len(drifts[n].factors), "runs": drifts[n].runs} for n, b in found.items()},
                 "goodput": {}}
    for end in ("lo", "mid", "hi"):
        fixed, paces = at_pace(recipe, slo, {n: drifts[n].median() if end == "mid" else b[end == "hi"]
                                             for n, b in found.items()})
        res = simulate_recipe(fixed, workloads, paces=paces)
        s = res.summary()
        out[end] = figures(res.requests, s)
        out["goodput"][end] = {n: (vs.get("goodput") or {}).get("mean") for n, vs in s["variants"].items()
                               if vs.get("mode") == "search"}
        # each decode worker's slots at this end (pdlab.measure.slots): where the pace moves it to the cliff
        out.setdefault("slots", {})[end] = {n: vs["decode_slots"] for n, vs in s["variants"].items()
                                            if vs.get("decode_slots")}
    return out


def _off(band: dict, recipe: Recipe) -> list[str]:
    """A line for each profile whose drift's median lies PACE_DRIFT or more off its own pace: the runs checked with
    it mostly stepped slower (or faster) than it, so its point forecast is likely off the same way. A direction,
    not a size: near saturation a figure moves more than the pace.

    Why: on the developers' box 70 of the 74 figures the point forecasts of six validations missed were the
    simulation running fast, and the three forecasts that met fewest (78-89 of 102) had drifts with medians of
    x1.14-1.25 (one that met 96 had x1.14 too); their bands met 101-102 (BENCHMARKS.md, 2026-12-03 seventh
    session). The band's figures are there; this says which end to read."""
    out, seen = [], set()
    for v, d in band["variants"].items():
        timing = recipe.variants[v].model.timing
        m = d.get("median")
        if m is None or (timing.name, m) in seen or abs(m - 1) < PACE_DRIFT - 1e-9:
            continue
        seen.add((timing.name, m))
        slow = m > 1
        out.append(f"  note: the runs checked with profile {timing.name} stepped x{m:.2f} its pace (the median of its "
                   f"drift): its point forecast is likely {'fast' if slow else 'slow'} (latencies "
                   f"{'low' if slow else 'high'}, attainment and throughput {'high' if slow else 'low'}); the band's "
                   "centre (in brackets) is the forecast at that pace, or measure the profile again (pdlab profile) "
                   "if the box has changed")
    return out


def _span(a: Optional[float], b: Optional[float], digits: int, mid: Optional[float] = None) -> str:
    """'95-120', or with the centre '95-120 (104)'."""
    if a is None or b is None:
        return "-"
    lo, hi = sorted((a, b))
    return f"{lo:.{digits}f}-{hi:.{digits}f}" + (f" ({mid:.{digits}f})" if mid is not None else "")


def lines(band: Optional[dict], recipe: Recipe) -> list[str]:
    """What a simulation prints of its band; without one, a line naming the measured profiles that have none."""
    banded = set(band["variants"]) if band else set()
    missing = {v.model.timing.name: v.model.timing.drift.describe() for n, v in recipe.variants.items()
               if n not in banded and v.model.timing is not None and v.model.timing.source == "measured"}
    out = [f"no forecast band for profile {p}: {why}" for p, why in sorted(missing.items())]
    if band is None:
        return out
    out.insert(0, "forecast band (simulated, not measured): each variant again with every worker at the slow and "
                  "the fast end of the box's drift against its profile, and in brackets at the drift's median (the "
                  "pace the runs checked with the profile stepped at), at the forecast's rates and SLO (" +
               "; ".join(f"{n}: {recipe.variants[n].model.timing.drift.describe()}" for n in band["variants"]) + ")")
    out += _off(band, recipe)
    lo, hi, centre = band["lo"], band["hi"], band.get("mid") or {}
    for v in band["variants"]:
        for tag, a in lo.get(v, {}).items():
            if tag not in hi.get(v, {}):
                continue  # a rate one end's search tried and the other's did not: its goodput line says it
            b, m = hi[v][tag], centre.get(v, {}).get(tag, {})

            def span(k: str, digits: int) -> str:
                return _span(a[k], b.get(k), digits, m.get(k))

            out.append(f"  {v} @ {tag} req/s: TTFT p50 {span('ttft_p50', 0)} ms, p90 {span('ttft_p90', 0)} ms; "
                       f"p99 ITL p90 {span('itl_p90', 1)} ms; attainment {span('attainment', 2)}"
                       + (f"; output {span('output_tok_s', 0)} tok/s" if tag == "inf" else ""))
        g = [band["goodput"][e].get(v) for e in ("lo", "hi")]
        if all(x is not None for x in g):
            out.append(f"  {v}: goodput {_span(g[0], g[1], 2, band['goodput'].get('mid', {}).get(v))} req/s")
        for end, what, i in (("hi", "slow", 1), ("lo", "fast", 0)):  # the slow end first: where the cliff comes
            slots = band.get("slots", {}).get(end, {}).get(v)
            w = slots_warning(v, slots["rates"], slots["max_running"], "simulated") if slots else None
            if w:
                out.append(f"  at the {what} end (x{band['variants'][v]['pace'][i]:.2f}): {w}")
    return out
