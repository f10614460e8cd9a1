"""How far is the modelled MORI-IO table from the published one, and how much slower would the modelled steps
have to be to close the gap? (issue 10, item 5; everything here is simulated from analytic profiles.)

    python benchmarks/mori_sensitivity.py                       # scales 1, 1.5, 2, 2.5, 3 at 8 req/s
    python benchmarks/mori_sensitivity.py --scales 1,2 --itl-stat p99

recipes/mori-table.yaml is simulated at one rate (the published 8 req/s) with every step-time term of each
variant's profile multiplied by a scale (the transfer figures unchanged): scale 2 asks "what if the kernels reach
half the efficiency the profile assumes". The shipped profiles are not changed, and no scale is fitted: the table
shows which scale, if any, gives the published pattern (unified 26 and 30 of 100, disaggregated 70 and 73, the
disaggregated misses all TTFT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import yaml

PUBLISHED = {"unified-1xTP8": 26, "unified-2xTP4": 30, "disagg-read": 70, "disagg-write": 73}
RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "mori-table.yaml")


def scaled(raw: dict, name: str, scale: float) -> dict:
    """The variant's model section with its profile's step terms times `scale` (inline, renamed)."""
    from pdlab.recipe import load_profile

    return dict(raw, timing=load_profile(name).scaled(scale).to_raw())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", default="1,1.5,2,2.5,3", help="step-time multipliers")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--itl-stat", default=None, help="per-request ITL statistic (default: the recipe's)")
    args = ap.parse_args()

    from pdlab.measure.slo import miss_kind
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    with open(RECIPE) as f:
        base = yaml.safe_load(f)
    base["rates"] = [args.rate]
    if args.itl_stat:
        base["slo"]["itl_stat"] = args.itl_stat
    print(f"recipes/mori-table.yaml at {args.rate:g} req/s, SLO {base['slo']}; SIMULATED from analytic profiles "
          "(step terms x scale); SLO met of 100 requests, mean over repeats [misses TTFT-only/ITL-only/both]")
    names = list(base["variants"])
    print(f"{'scale':>6}  " + "  ".join(f"{n:>22}" for n in names) + "   sim s")
    print(f"{'paper':>6}  " + "  ".join(f"{PUBLISHED.get(n, '-'):>22}" for n in names))
    for scale in (float(s) for s in args.scales.split(",")):
        raw = yaml.safe_load(yaml.safe_dump(base))
        for v in raw["variants"].values():
            model = dict(raw["model"], **v.get("model", {}))
            v["model"] = scaled(model, model["timing"], scale)
        recipe = parse_recipe(raw)
        t0 = time.perf_counter()
        res = simulate_recipe(recipe, {n: build_workload(v) for n, v in recipe.variants.items()})
        took = time.perf_counter() - t0
        cells = []
        for n in names:
            recs = [r for r in res.requests if r["variant"] == n and r.get("rate") == args.rate
                    and not r.get("warmup")]
            reps = max(1, len({r.get("repeat", 0) for r in recs}))
            met = sum(r["slo_ok"] for r in recs) / reps
            kinds = [sum(miss_kind(r) == k for r in recs) / reps for k in ("ttft_only", "itl_only", "both")]
            cells.append(f"{met:5.1f} [{kinds[0]:.0f}/{kinds[1]:.0f}/{kinds[2]:.0f}]")
        print(f"{scale:>6g}  " + "  ".join(f"{c:>22}" for c in cells) + f"   {took:5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
