"""Run directories built the way `pdlab run` builds them, from request records: build_request_record for every
request, summarize_run over them, the recipe resolved by parse_recipe and written as recipe.yaml. Report tests
read these, so what they judge has the shapes real runs have (open brackets, warm-up records, repeats).

A plan says, per variant, what its deployment and engine are and, per (repeat, rate), how many of its 10
requests miss how: `ttft` (a 300 ms TTFT against the 100 ms target), `itl` (one 200 ms gap over a prefill step
of its decoding worker, against the 50 ms target), `failed` (an error, no token). The others take 50 ms to
the first token and 20 ms a gap. All at once (`inf`), requests arrive together and finish 100 ms apart.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import yaml

from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir
from pdlab.measure.summary import summarize_run
from pdlab.recipe import SLO, dump_recipe, parse_recipe

SLO_ = SLO(ttft_ms=100.0, itl_ms=50.0, itl_stat="max", attainment=0.9)
UNIFIED = {"unified": {"devices": ["cpu:0"]}}
DISAGG = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm", "mode": "push"}
N = 10

Misses = dict  # {"ttft": n, "itl": n, "failed": n}
Plan = Union[Misses, Callable[[int, float], Misses]]  # per (repeat, rate), or the same everywhere


def variant(deployment: dict, misses: Plan, engine: Optional[dict] = None, model: Optional[dict] = None,
            ttft_ms: float = 50.0) -> dict:
    return {"deployment": deployment, "misses": misses, "engine": engine or {}, "model": model, "ttft_ms": ttft_ms}


def _records(name: str, v: dict, rate: float, repeat: int, t0: float) -> tuple[list[dict], list[dict]]:
    plan = v["misses"](repeat, rate) if callable(v["misses"]) else v["misses"]
    ttft_bad, itl_bad, failed = plan.get("ttft", 0), plan.get("itl", 0), plan.get("failed", 0)
    disagg = "prefill" in v["deployment"]
    worker = "decode0" if disagg else "unified0"
    workers = {"prefill": "prefill0", "decode": worker} if disagg else {"unified": worker}
    reqs, steps = [], []
    reqs.append(build_request_record(variant=name, rate=rate, id="w", prompt_ids=[3] * 20, output_ids=[4] * 3,
                                     arrival=t0 - 5, token_times=[t0 - 4.9, t0 - 4.88], slo=SLO_, workers=workers,
                                     repeat=repeat, warmup=True))
    for k in range(N):
        a = t0 + (0.0 if math.isinf(rate) else k / rate)
        first = a + (0.1 * (k + 1) if math.isinf(rate) else (0.3 if k < ttft_bad else v["ttft_ms"] / 1000))
        times = [first, first + 0.02, first + 0.04]
        if ttft_bad <= k < ttft_bad + itl_bad:
            times[2] = times[1] + 0.2
            steps.append({"variant": name, "rate": rate, "repeat": repeat, "worker": worker, "role": "unified",
                          "start": times[1] + 0.01, "end": times[2] - 0.01, "prefill_tokens": 1500,
                          "decode_seqs": 1})
        bad = k >= N - failed
        reqs.append(build_request_record(variant=name, rate=rate, id=str(k), prompt_ids=[3] * 20,
                                         output_ids=[] if bad else [4] * 3, arrival=a, token_times=[] if bad else times,
                                         slo=SLO_, workers=workers, repeat=repeat,
                                         error="worker died" if bad else None))
    return reqs, steps


def make(path: Any, variants: dict[str, dict], rates: tuple = (1.0, 2.0, math.inf), repeats: int = 1,
         env: Optional[dict] = None, partial: Optional[str] = None, not_run: tuple = (),
         alone: Optional[dict] = None, expect: Optional[dict] = None) -> str:
    """A run directory of `variants` (name -> variant(...)) at `rates`, `repeats` times; `not_run`: variants
    the run never reached (a run cut short by `partial`, its reason)."""
    raw = {"name": "synthetic", "seed": 0, "rates": list(rates), "repeats": repeats, "slo": SLO_.to_raw(),
           "workload": {"requests": N}, "model": {"preset": "tiny-llama"},
           "variants": {n: {k: x for k, x in (("deployment", v["deployment"]), ("engine", v["engine"]),
                                             ("model", v["model"])) if x} for n, v in variants.items()}}
    if expect:
        raw["expect"] = expect
    recipe = parse_recipe(raw, "synthetic")
    reqs, steps = [], []
    for vi, (name, v) in enumerate(variants.items()):
        if name in not_run:
            continue
        for j in range(repeats):
            for ri, rate in enumerate(rates):
                r, s = _records(name, v, rate, j, 10000.0 * vi + 1000.0 * j + 100.0 * ri)
                reqs += r
                steps += s
    modelled = {n: v.model.timing.describe() for n, v in recipe.variants.items() if v.model.modelled}
    with RunDir(str(path)) as rd:
        rd.write_recipe(yaml.safe_load(dump_recipe(recipe)))
        rd.write_env({"time": "2026-12-01T10:00:00+0000", "ended": "2026-12-01T10:05:00+0000",
                      "cpu_model": "Test CPU", **(env or {})})
        rd.append("requests", reqs)
        rd.append("steps", steps)
        rd.write_summary(summarize_run(
            reqs, steps, [], SLO_, grid={n: list(rates) for n in variants}, partial=partial is not None,
            reason=partial, modelled=modelled, alone=alone, expect=recipe.shared.expect,
            prefill_workers={n: 1 for n in variants},
            run={"recipe": "synthetic", "started": "2026-12-01T10:00:00+0000", "ended": "2026-12-01T10:05:00+0000",
                 "cpu_model": "Test CPU", "simulated": bool((env or {}).get("simulated"))}))
    return str(path)
