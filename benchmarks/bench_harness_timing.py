"""How closely the harness keeps time: the figures tests/test_harness_timing.py used to bound, measured on a
quiet box instead (a test asserts correctness, never a wall-clock bound; these move with the machine's load).

On a model double whose steps take known times (model.timing: a 40-token prefill takes 82 ms, a decode step
of one sequence 6 ms), one unified worker, 24 Poisson requests at 2 and 8 req/s:

  host alone     one request alone (the run's calibration): TTFT minus the modelled prefill: the client's
                 send, the router's hop and the worker's wake-up
  M/D/1          mean TTFT at 2 req/s against M/D/1 on the modelled prefill, and with the host time added
                 (the test's bound was 10%)
  step           median decode step (one sequence) against the modelled 6 ms: the sleep's overshoot (10%)
  gap            median token gap against that step plus the worker's median time between steps (8%)
  simulator      the same recipe in virtual time: mean TTFT and median ITL per rate against the run, the
                 simulator's figures plus the run's host time (10%)
  wait_until     pdlab.engine.timed.wait_until's median overshoot for 0.5, 3 and 12 ms waits, with and
                 without the final spin (2 ms)

    python benchmarks/bench_harness_timing.py [--runs 3] [--json out.json]

Run it on a quiet box: every figure here is a wall-clock figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

PROMPT, OUT = 40, 8
TIMING = {"fixed_ms": 2.0, "prefill_token_ms": 2.0, "decode_seq_ms": 4.0}
PREFILL_S = (TIMING["fixed_ms"] + PROMPT * TIMING["prefill_token_ms"]) / 1000
DECODE_S = (TIMING["fixed_ms"] + TIMING["decode_seq_ms"]) / 1000
RATES = (2, 8)
RECIPE = {
    "name": "double", "seed": 3, "warmup": 1,
    "model": {"preset": "tiny-llama", "timing": TIMING},
    "engine": {"block_size": 8, "kv_blocks": 128, "token_budget": 256, "max_running": 16},
    "workload": {"requests": 24, "arrival": {"kind": "poisson"}, "input_len": {"kind": "fixed", "value": PROMPT},
                 "output_len": {"kind": "fixed", "value": OUT}},
    "rates": list(RATES),
    "slo": {"ttft_ms": 1000, "itl_ms": 50, "itl_stat": "p99", "attainment": 0.9},
    "deployment": {"unified": {"devices": ["cpu:0"]}},
}


def run_double(workdir: str) -> tuple[dict, list[dict], list[dict]]:
    path = os.path.join(workdir, "double.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(RECIPE, f)
    out = os.path.join(workdir, "run")
    r = subprocess.run([sys.executable, "-m", "pdlab.cli", "run", path, "--out", out], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"pdlab run failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "requests.jsonl")) as f:
        reqs = [x for x in map(json.loads, f) if not x.get("warmup")]
    with open(os.path.join(out, "steps.jsonl")) as f:
        steps = [json.loads(x) for x in f]
    return summary, reqs, steps


def host_gap(steps: list[dict], rate: float) -> float:
    """The worker's median time between back-to-back steps (it had work waiting): sending tokens, taking in
    requests, scheduling."""
    by_worker: dict = {}
    for s in steps:
        if s["rate"] == rate:
            by_worker.setdefault(s["worker"], []).append(s)
    gaps = [b["start"] - a["end"] for ss in by_worker.values() for a, b in zip(ss, ss[1:])
            if b["start"] - a["end"] < DECODE_S]
    return float(np.median(gaps))


def pct(a: float, b: float) -> float:
    return 100 * (a - b) / b


def figures(summary: dict, reqs: list[dict], steps: list[dict]) -> dict:
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    host = summary["alone"]["ttft_ms"] / 1000 - PREFILL_S
    low = [r for r in reqs if r["rate"] == RATES[0]]
    rho = RATES[0] * PREFILL_S
    md1 = PREFILL_S + rho * PREFILL_S / (2 * (1 - rho))
    ttft = float(np.mean([r["token_times"][0] - r["arrival"] for r in low]))
    step = float(np.median([s["end"] - s["start"] for s in steps if s["rate"] == RATES[0]
                            and s["decode_seqs"] == 1 and s["prefill_tokens"] == 0]))
    gap = float(np.median([b - a for r in low for a, b in zip(r["token_times"], r["token_times"][1:])]))
    hg = host_gap(steps, RATES[0])
    out = {"host_alone_ms": 1000 * host, "ttft_ms": 1000 * ttft, "md1_ms": 1000 * md1,
           "ttft_vs_md1_pct": pct(ttft, md1), "ttft_vs_md1_plus_host_pct": pct(ttft, md1 + host),
           "step_ms": 1000 * step, "step_over_model_pct": pct(step, DECODE_S), "gap_ms": 1000 * gap,
           "host_gap_ms": 1000 * hg, "gap_vs_step_plus_host_pct": pct(gap, step + hg), "sim": {}}
    r = parse_recipe(RECIPE)
    sim = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    for rate in RATES:
        real = [x for x in reqs if x["rate"] == rate]
        virt = [x for x in sim.requests if x["rate"] == rate]
        same = (sorted((x["id"], x["output_ids"]) for x in real) == sorted((x["id"], x["output_ids"]) for x in virt))
        hg = host_gap(steps, rate)
        t_real, t_sim = np.mean([x["ttft"] for x in real]), np.mean([x["ttft"] for x in virt])
        i_real = np.median([g for x in real for g in x["itl"]])
        i_sim = np.median([g for x in virt for g in x["itl"]])
        out["sim"][str(rate)] = {"tokens_equal": same, "ttft_run_ms": 1000 * t_real, "ttft_sim_ms": 1000 * t_sim,
                                 "ttft_pct": pct(t_real, t_sim + host), "itl_run_ms": 1000 * i_real,
                                 "itl_sim_ms": 1000 * i_sim, "itl_pct": pct(i_real, i_sim + hg)}
    return out


def wait_overshoot() -> dict:
    from pdlab.engine.timed import wait_until

    out = {}
    for spin in (0.0, 0.0005):
        for wait in (0.0005, 0.003, 0.012):
            over = []
            for _ in range(25):
                deadline = time.monotonic() + wait
                over.append(wait_until(deadline, spin_s=spin) - deadline)
            out[f"{wait * 1000:g} ms, spin {spin * 1000:g} ms"] = 1000 * statistics.median(over)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="pdlab runs of the double (each about a minute)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="pdlab-bench-timing-") as d:
            f = figures(*run_double(d))
        results.append(f)
        print(f"run {i + 1}: host alone {f['host_alone_ms']:.1f} ms; mean TTFT @{RATES[0]} {f['ttft_ms']:.1f} ms vs "
              f"M/D/1 {f['md1_ms']:.1f} ms ({f['ttft_vs_md1_pct']:+.1f}%; with the host time "
              f"{f['ttft_vs_md1_plus_host_pct']:+.1f}%)")
        print(f"  decode step {f['step_ms']:.2f} ms vs 6 ms ({f['step_over_model_pct']:+.1f}%); token gap "
              f"{f['gap_ms']:.2f} ms vs step + host gap {f['host_gap_ms']:.2f} ms "
              f"({f['gap_vs_step_plus_host_pct']:+.1f}%)")
        for rate, s in f["sim"].items():
            print(f"  simulator @{rate}: tokens {'equal' if s['tokens_equal'] else 'DIFFER'}; TTFT run "
                  f"{s['ttft_run_ms']:.1f} vs sim {s['ttft_sim_ms']:.1f} ms ({s['ttft_pct']:+.1f}% with host); ITL "
                  f"{s['itl_run_ms']:.2f} vs {s['itl_sim_ms']:.2f} ms ({s['itl_pct']:+.1f}% with host gap)")
    waits = wait_overshoot()
    print("wait_until median overshoot: " + ", ".join(f"{k}: {v:.3f} ms" for k, v in waits.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "wait_until_overshoot_ms": waits}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
