"""Held-out validation of the timing model (issue 25, item 5): measure a profile of this box, then run three
recipes it was never fitted on for real and in the simulator, and set the figures side by side.

    python benchmarks/timing_validation.py --out runs/timing-validation            # ~15 min on 2 cores
    python benchmarks/timing_validation.py --out DIR --profile box.yaml            # an existing profile
    python benchmarks/timing_validation.py --out DIR --requests 24 --repeats 2      # tighter figures

Each recipe is cpu-demo on two single-core workers, unified (2 replicas) against a 1P1D deployment, with a
length mix of its own: short prompts and outputs (pull), long prompts (push), and a wide mix under chunked
prefill (pull). Its rates are fractions of the saturation rate the simulator predicts for it from the profile
(around and above saturation) plus saturation itself, and its SLO is a multiple of the simulated one-request
figures, so the real run and the simulation are held to the same absolute rates and targets. The real run
names the profile (model.check_timing), so it ends with `pdlab profile --check`'s line.

Per variant and rate: TTFT p50 and p90, the p90 over requests of each request's p99 ITL, attainment; per
variant the saturation output throughput; per recipe whether the deployments rank the same (by saturation
throughput, and by mean attainment over the finite rates). The targets (issue 25) are printed beside: TTFT
p50 within 20%, TTFT p90 and ITL p90 within 25%, attainment within 0.15, saturation within 15%, the same
ranking. DIR/validation.json keeps every figure; the runs stay in DIR for pdlab compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"ttft_p50": 0.20, "ttft_p90": 0.25, "itl_p90": 0.25, "attainment": 0.15, "saturation": 0.15}
RATE_FRACTIONS = (0.5, 0.9, 1.3)  # of the simulated saturation rate; saturation itself (inf) is run too
SLO_X = {"ttft": 4.0, "itl": 10.0}  # of the simulated one-request TTFT and ITL
UNIFIED = {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}


def disagg(mode: str) -> dict:
    return {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm", "mode": mode}


# name -> (workload lengths, engine overrides, disaggregated mode)
RECIPES = {
    "short-mix": ({"input_len": {"kind": "uniform", "min": 64, "max": 400},
                   "output_len": {"kind": "uniform", "min": 32, "max": 96}}, {}, "pull"),
    "long-mix": ({"input_len": {"kind": "uniform", "min": 800, "max": 2000},
                  "output_len": {"kind": "fixed", "value": 64}}, {}, "push"),
    "chunked-mix": ({"input_len": {"kind": "uniform", "min": 100, "max": 1500},
                     "output_len": {"kind": "uniform", "min": 48, "max": 160}},
                    {"chunked_prefill": True, "token_budget": 256}, "pull"),
}


def base_recipe(name: str, requests: int, repeats: int) -> dict:
    lengths, engine, mode = RECIPES[name]
    return {"name": f"tv-{name}", "seed": 7, "warmup": 1, "repeats": repeats,
            "model": {"preset": "cpu-demo"},
            "engine": {"block_size": 16, "kv_blocks": "auto", "max_running": 32, "prefix_caching": False, **engine},
            "workload": {"requests": requests, "arrival": {"kind": "poisson"}, **lengths},
            "variants": {"unified-2x": {"deployment": UNIFIED}, f"1P1D-{mode}": {"deployment": disagg(mode)}}}


def plan_rates(raw: dict, profile: str) -> dict:
    """The recipe with absolute rates and SLO from the profile's simulation (the same for both runs)."""
    from pdlab.measure.summary import summarize_run
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    probe = dict(raw, rates=[math.inf], repeats=1, slo={"ttft": "5x", "itl": "10x"},
                 model=dict(raw["model"], timing=profile))
    r = parse_recipe(probe)
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    s = summarize_run(res.requests, res.steps, res.transfers, res.slo, grid={n: r.rates for n in r.variants},
                      **res.facts)
    sat = min(s["variants"][n]["rates"]["inf"]["request_throughput"] for n in r.variants)
    alone = res.facts["alone"]
    out = dict(raw, rates=[round(f * sat, 3) for f in RATE_FRACTIONS] + [".inf"],
               slo={"ttft_ms": round(SLO_X["ttft"] * alone["ttft_ms"]),
                    "itl_ms": round(SLO_X["itl"] * alone["itl_ms"], 1), "itl_stat": "p99", "attainment": 0.9})
    out["model"] = dict(raw["model"], check_timing=profile)  # the real run ends with the profile check
    return out


def run(cmd: list[str], log: str) -> str:
    t = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True)
    with open(log, "a") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}; see {log}")
    print(f"  pdlab {' '.join(cmd[3:5])}: {time.monotonic() - t:.0f} s", flush=True)
    return p.stdout


def figures(run_dir: str) -> dict:
    """variant -> rate tag -> {ttft_p50, ttft_p90, itl_p90, attainment, output_tok_s} from the run's records."""
    reqs = [json.loads(x) for x in open(os.path.join(run_dir, "requests.jsonl"))]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    out: dict = {}
    for v, vs in summary["variants"].items():
        for tag, rs in vs["rates"].items():
            mine = [r for r in reqs if r["variant"] == v and _tag(r["rate"]) == tag and not r.get("warmup") and r["ok"]]
            ttft = [r["ttft"] * 1000 for r in mine]
            p99 = [float(np.percentile(r["itl"], 99)) * 1000 for r in mine if r["itl"]]
            out.setdefault(v, {})[tag] = {
                "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "itl_p90": _pct(p99, 90),
                "attainment": rs["attainment"], "output_tok_s": rs["output_tok_s"]}
    return out


def _tag(rate: object) -> str:
    r = float(rate)
    return "inf" if math.isinf(r) else f"{r:g}"


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def rel(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or real in (None, 0) else (sim - real) / real


def compare(real: dict, sim: dict) -> dict:
    rows, ranks = [], {}
    for v in real:
        for tag in real[v]:
            a, b = real[v][tag], sim.get(v, {}).get(tag, {})
            row = {"variant": v, "rate": tag}
            for k in ("ttft_p50", "ttft_p90", "itl_p90"):
                e = rel(b.get(k), a[k])
                row[k] = {"real": a[k], "sim": b.get(k), "error": e, "ok": e is not None and abs(e) <= TARGETS[k]}
            d = None if a["attainment"] is None or b.get("attainment") is None else b["attainment"] - a["attainment"]
            row["attainment"] = {"real": a["attainment"], "sim": b.get("attainment"), "error": d,
                                 "ok": d is not None and abs(d) <= TARGETS["attainment"]}
            if tag == "inf":
                e = rel(b.get("output_tok_s"), a["output_tok_s"])
                row["saturation"] = {"real": a["output_tok_s"], "sim": b.get("output_tok_s"), "error": e,
                                     "ok": e is not None and abs(e) <= TARGETS["saturation"]}
            rows.append(row)
    for side, figs in (("real", real), ("sim", sim)):
        by_sat = sorted(figs, key=lambda v: -(figs[v].get("inf", {}).get("output_tok_s") or 0))
        by_att = sorted(figs, key=lambda v: -np.mean([x["attainment"] or 0 for t, x in figs[v].items() if t != "inf"]))
        ranks[side] = {"saturation": by_sat, "attainment": by_att}
    ranks["same"] = ranks["real"] == ranks["sim"]
    return {"rows": rows, "ranking": ranks}


def cell(x: dict, digits: int = 0, absolute: bool = False) -> str:
    """'real / sim error' with a ! where the target is missed; the error relative (%) or absolute."""
    if x["real"] is None:
        return "-"
    sim = "-" if x["sim"] is None else f"{x['sim']:.{digits}f}"
    err = "" if x["error"] is None else f" {x['error']:+.2f}" if absolute else f" {x['error'] * 100:+.0f}%"
    return f"{x['real']:.{digits}f} / {sim}{err}{'' if x['ok'] else ' !'}"


def render(name: str, cmp: dict, check: str) -> None:
    print(f"\n{name}: real / simulated and the error (! beyond the target)")
    print(f"  {'variant @ rate (req/s)':28} {'TTFT p50 ms':>20} {'TTFT p90 ms':>20} {'p99 ITL p90 ms':>20} "
          f"{'attainment':>20}")
    for r in cmp["rows"]:
        print(f"  {r['variant'] + ' @ ' + r['rate']:28} {cell(r['ttft_p50']):>20} {cell(r['ttft_p90']):>20} "
              f"{cell(r['itl_p90'], 1):>20} {cell(r['attainment'], 2, absolute=True):>20}")
        if "saturation" in r:
            print(f"  {'':28} saturation output tok/s {cell(r['saturation'])}")
    rk = cmp["ranking"]
    print(f"  ranking by saturation: real {rk['real']['saturation']}, sim {rk['sim']['saturation']}; by attainment: "
          f"real {rk['real']['attainment']}, sim {rk['sim']['attainment']}: {'same' if rk['same'] else 'DIFFERENT'}")
    for line in check.splitlines():
        print(f"  {line}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new directory for the profile, recipes, runs and results")
    ap.add_argument("--profile", help="an existing profile (default: measure one first with pdlab profile)")
    ap.add_argument("--steps", type=int, default=400, help="pdlab profile --steps (default 400)")
    ap.add_argument("--requests", type=int, default=16, help="requests per rate (default 16)")
    ap.add_argument("--repeats", type=int, default=1, help="repeats of each rate (default 1)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"which of {', '.join(RECIPES)}")
    args = ap.parse_args()
    names = [n for n in args.recipes.split(",") if n]
    if any(n not in RECIPES for n in names):
        print(f"error: --recipes: expected names from {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and os.listdir(args.out):
        print(f"error: --out {args.out}: exists and is not empty", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    py = [sys.executable, "-m", "pdlab.cli"]
    t0 = time.monotonic()
    profile = os.path.abspath(args.profile or os.path.join(args.out, "box.yaml"))
    if not args.profile:
        print(f"measuring the profile ({args.steps} steps) ...", flush=True)
        print(run(py + ["profile", "--model", "cpu-demo", "--steps", str(args.steps), "--out", profile],
                  os.path.join(args.out, "profile.log")))
    results = {"profile": profile, "targets": TARGETS, "recipes": {}}
    for name in names:
        print(f"{name}: planning rates from the profile's simulation", flush=True)
        raw = plan_rates(base_recipe(name, args.requests, args.repeats), profile)
        path = os.path.join(args.out, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f, sort_keys=False)
        real, sim = os.path.join(args.out, f"{name}-real"), os.path.join(args.out, f"{name}-sim")
        run(py + ["run", path, "--out", real], os.path.join(args.out, f"{name}-real.log"))
        run(py + ["run", path, "--simulate", "--set", f"model.timing={profile}", "--out", sim],
            os.path.join(args.out, f"{name}-sim.log"))
        check = run(py + ["profile", "--check", real, "--profile", profile],
                    os.path.join(args.out, f"{name}-check.log"))
        cmp = compare(figures(real), figures(sim))
        results["recipes"][name] = {"recipe": raw, "comparison": cmp, "check": check}
        render(name, cmp, check)
    rows = [r for x in results["recipes"].values() for r in x["comparison"]["rows"]]
    met = {k: (sum(r[k]["ok"] for r in rows if k in r), sum(k in r for r in rows)) for k in TARGETS}
    same = sum(x["comparison"]["ranking"]["same"] for x in results["recipes"].values())
    results["met"] = {k: {"within": a, "of": b} for k, (a, b) in met.items()}
    results["ranking_same"] = {"recipes": same, "of": len(names)}
    results["took_s"] = time.monotonic() - t0
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("\nwithin target: " + ", ".join(f"{k} (±{TARGETS[k]:g}{'' if k == 'attainment' else ' rel'}) {a}/{b}"
                                          for k, (a, b) in met.items()) + f"; same ranking {same}/{len(names)}")
    print(f"{time.monotonic() - t0:.0f} s; wrote {os.path.join(args.out, 'validation.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
