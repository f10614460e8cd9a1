"""Validate the timing model on CPU: simulate a recipe that was measured for real, with a profile of the same
engine, and put predicted beside measured per variant (goodput, TTFT p50/p99 and ITL p99 at goodput,
saturation throughput). Also times the simulator itself (engine steps per second, one core).

    python benchmarks/bench_sim.py runs/long-input-20261130-053727 --profile cpu-demo-2core

The measured run's recipe.yaml gives the recipe (its seeds, so the workload is the same requests); the
profile replaces the real model in every variant. Target (issue 10): goodput within 25%, the same ranking.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import yaml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a run directory of `pdlab run` (real model)")
    ap.add_argument("--profile", default="cpu-demo-2core", help="timing profile for the simulation")
    args = ap.parse_args()

    from pdlab.measure.records import load_run
    from pdlab.measure.summary import summarize_run
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    measured = load_run(args.run, records=False)
    raw = measured.recipe
    for k in ("ttft", "itl"):  # recipe.yaml before 2026-11-30 09:00 wrote a relative SLO as a bare number
        if isinstance(raw["slo"].get(k), (int, float)):
            raw["slo"][k] = f"{raw['slo'][k]:g}x"
    for v in raw["variants"].values():
        v["model"] = dict(v["model"], timing=args.profile)
    recipe = parse_recipe(raw)
    workloads = {n: build_workload(v) for n, v in recipe.variants.items()}
    t0 = time.perf_counter()
    res = simulate_recipe(recipe, workloads)
    took = time.perf_counter() - t0
    grid = {n: recipe.rates for n in recipe.variant_names}
    sim = summarize_run(res.requests, res.steps, res.transfers, res.slo, grid=grid, **res.facts)

    def figures(vs: dict) -> dict:
        at = vs.get("at_goodput") or {}
        sat = vs.get("saturation") or {}
        return {"goodput": vs["goodput"]["mean"], "goodput_lo": vs["goodput"]["lo"], "goodput_hi": vs["goodput"]["hi"],
                "ttft_p50": (at.get("ttft_p50_ms") or {}).get("mean"), "ttft_p99": (at.get("ttft_p99_ms") or {}).get("mean"),
                "itl_p99": (at.get("itl_p99_ms") or {}).get("mean"),
                "sat_tok_s": (sat.get("output_tok_s") or {}).get("mean")}

    rows = []
    for name in recipe.variant_names:
        m, p = figures(measured.summary["variants"][name]), figures(sim["variants"][name])
        rows.append({"variant": name, "measured": m, "predicted": p,
                     "goodput_error": None if not m["goodput"] else (p["goodput"] - m["goodput"]) / m["goodput"]})
    rank = lambda key: [r["variant"] for r in sorted(rows, key=lambda r: -(r[key]["goodput"] or 0))]  # noqa: E731
    out = {"run": args.run, "profile": args.profile, "slo_measured": measured.summary["slo"], "slo_simulated":
           res.slo.to_raw(), "rows": rows, "same_ranking": rank("measured") == rank("predicted"),
           "simulated_s": took, "engine_steps": len(res.steps), "steps_per_s": len(res.steps) / took,
           "requests": len(res.requests)}
    print(json.dumps(out, indent=2, default=str))
    print(f"\n{'variant':<14}{'goodput meas.':>16}{'pred.':>8}{'err':>7}{'TTFT p50 m/p':>16}{'TTFT p99 m/p':>16}"
          f"{'ITL p99 m/p':>14}{'sat tok/s m/p':>16}", file=sys.stderr)
    for r in rows:
        m, p = r["measured"], r["predicted"]
        f = lambda x: "—" if x is None else f"{x:.0f}"  # noqa: E731
        print(f"{r['variant']:<14}{m['goodput']:>10.2f} ±{(m['goodput_hi'] or m['goodput']) - m['goodput']:.2f}"
              f"{p['goodput']:>8.2f}{(r['goodput_error'] or 0) * 100:>+6.0f}%{f(m['ttft_p50']) + '/' + f(p['ttft_p50']):>16}"
              f"{f(m['ttft_p99']) + '/' + f(p['ttft_p99']):>16}{f(m['itl_p99']) + '/' + f(p['itl_p99']):>14}"
              f"{f(m['sat_tok_s']) + '/' + f(p['sat_tok_s']):>16}", file=sys.stderr)
    print(f"same ranking: {out['same_ranking']}; simulated {out['requests']} requests, {out['engine_steps']} engine "
          f"steps in {took:.1f} s ({out['steps_per_s']:.0f} steps/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
