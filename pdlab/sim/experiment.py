"""A whole recipe in virtual time: what `pdlab run` does (calibration, every variant, repeats, a grid or a
goodput search), with the Simulator in place of worker processes. The records it returns are a run's, so
summarize_run, compare and plots read them unchanged; every variant is labelled simulated, from its profile.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from pdlab.measure.search import RateSearch
from pdlab.measure.summary import summarize_run
from pdlab.recipe import SLO, Deployment, Recipe, Variant
from pdlab.recipe.recipe import relative_rate
from pdlab.sim.pace import WorkerPace
from pdlab.sim.simulator import Simulator
from pdlab.timing.check import modelled_warnings
from pdlab.workload import Workload, build_requests, trace_facts

ALONE_REQUESTS = 3


@dataclass
class SimResult:
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    transfers: list[dict] = field(default_factory=list)
    slo: Optional[SLO] = None
    facts: dict = field(default_factory=dict)  # what summarize_run takes beyond the records
    recipe: Optional[Recipe] = None  # the recipe simulated, relative rates resolved

    def add(self, recs: tuple[list[dict], list[dict], list[dict]]) -> list[dict]:
        self.requests += recs[0]
        self.steps += recs[1]
        self.transfers += recs[2]
        return recs[0]

    def summary(self) -> dict:
        """The summary of the records (pdlab.measure.summary.summarize_run), with the facts and each variant's
        planned rates."""
        return summarize_run(self.requests, self.steps, self.transfers, self.slo,
                             grid={n: v.rates for n, v in self.recipe.variants.items()}, **self.facts)


def simulated(variant: Variant) -> str:
    return f"simulated in virtual time; {variant.model.timing.describe()}"


def _alone(v: Variant, slo: SLO, wl: Workload) -> dict:
    """One request at a time on the variant's deployment: median TTFT and median gap (ms)."""
    sim = Simulator(v, slo.resolved(1.0, 1.0) if slo.relative else slo)
    reqs = build_requests(v.workload, math.inf, v.seed, wl.vocab, wl.tokenizer, wl.dataset, n=ALONE_REQUESTS,
                          stream="alone")
    ttfts, gaps = [], []
    for r in reqs:
        (rec,), _, _ = sim.run([r], math.inf)
        ttfts.append(rec["ttft"])
        gaps += rec["itl"]
    return {"ttft_ms": 1000 * statistics.median(ttfts), "itl_ms": 1000 * statistics.median(gaps) if gaps else
            float("nan"), "requests": len(reqs), "devices": "simulated"}


def unified_one(v: Variant) -> Variant:
    """The variant on one unified worker: the calibration's reference."""

    first = v.deployment.workers[0]
    return replace(v, deployment=Deployment.from_raw({"unified": {"devices": list(first.devices), "tp": first.tp}},
                                                     "calibration"))


def _point(out: SimResult, sim: Simulator, wl: Workload, rate: float, seed: int, repeat: int) -> list[dict]:
    """One (rate, repeat) as pdlab.harness measures it: a cold prefix cache, the warm-up requests (records
    kept, marked warm-up), then the measured ones, which find the warm-up's prefixes cached; their records."""
    if wl.n_warmup:
        out.add(sim.run(list(wl.warmup(seed)), rate, repeat, warmup=True))
    return out.add(sim.run(list(wl.at(rate, seed)), rate, repeat, cold=not wl.n_warmup))


def simulate_recipe(recipe: Recipe, workloads: dict[str, Workload], progress: Any = None,
                    paces: Optional[dict[str, dict[str, WorkerPace]]] = None) -> SimResult:
    """Every variant of `recipe` (all modelled) through the simulator, as `pdlab run` would run it. `paces`:
    variant -> worker -> its pace (pdlab.sim.pace; a run replayed at its own pace)."""
    out = SimResult()
    first = recipe.resolved(recipe.variant_names[0])
    alone = _alone(unified_one(first), recipe.slo, workloads[first.name])
    written = recipe.relative_rates  # 0.5x: of 1 / TTFT alone (here the model's), as pdlab run resolves them
    recipe = recipe.with_rates_for(alone["ttft_ms"])
    out.recipe = recipe
    slo = recipe.slo.resolved(alone["ttft_ms"], alone["itl_ms"]) if recipe.slo.relative else recipe.slo
    out.slo = slo
    floors, by_variant = {}, {}
    for name, v in recipe.variants.items():
        wl = workloads[name]
        by_variant[name] = _alone(v, slo, wl)
        sim = Simulator(v, slo, (paces or {}).get(name))
        for repeat, seed in enumerate(v.seeds()):
            if not v.auto:
                for rate in v.rates:
                    _point(out, sim, wl, rate, seed, repeat)
                continue
            sat = _point(out, sim, wl, math.inf, seed, repeat)
            ok = [r for r in sat if r["ok"]]
            span = max(r["token_times"][-1] for r in ok) - min(r["arrival"] for r in sat) if ok else 0.0
            if span <= 0:
                continue
            rs = RateSearch(slo.attainment, len(ok) / span, max_trials=v.search.max_trials, rel_tol=v.search.rel_tol,
                            start_fraction=v.search.start)
            floors[(name, repeat)] = rs.floor
            while (rate := rs.next_rate()) is not None:
                recs = _point(out, sim, wl, rate, seed, repeat)
                rs.record(rate, sum(r["slo_ok"] for r in recs) / len(recs) if recs else 0.0)
        if progress is not None:
            progress(name)
    out.facts = {"alone": alone, "alone_by_variant": by_variant,
                 "relative": {"ttft": recipe.slo.ttft, "itl": recipe.slo.itl} if recipe.slo.relative else None,
                 "prefill_workers": {n: sum(w.role != "decode" for w in v.deployment.workers)
                                     for n, v in recipe.variants.items()},
                 "max_running": {n: v.engine.max_running for n, v in recipe.variants.items()},
                 "floors": floors, "warnings": modelled_warnings({n: recipe.resolved(n) for n in recipe.variant_names}),
                 "rates_resolved": {w: relative_rate(w) * 1000.0 / alone["ttft_ms"] for w in written},
                 "modelled": {n: simulated(v) for n, v in recipe.variants.items()}, "trace": trace_facts(workloads)}
    return out
