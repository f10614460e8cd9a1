"""Held-out validation of the timing model (issue 25, item 5): measure a profile of this box, then run three
recipes it was never fitted on for real and in the simulator, and set the figures side by side.

    python benchmarks/timing_validation.py --out runs/timing-validation            # ~16 min on 2 cores
    python benchmarks/timing_validation.py --out DIR --profile box.yaml            # an existing profile
    python benchmarks/timing_validation.py --out DIR --requests 16 --repeats 1 --no-again --no-calibrate  # ~3 min
    python benchmarks/timing_validation.py --out DIR --model path/to/saved-model --dtype float32   # another model
    python benchmarks/timing_validation.py --out DIR --isa x86-64-v3   # an AVX-512 box standing in for AVX2

Each recipe is a model (cpu-demo unless --model) on two single-core workers, unified (2 replicas) against a
1P1D deployment, with a length mix of its own: short prompts and outputs (pull), long prompts (push), and a wide
mix under chunked prefill (pull); prompts are cut to fit the model's context (and it says so). Its rates are
fractions of the saturation rate the simulator predicts for it from the profile (around and above saturation)
plus saturation itself, and its SLO is a multiple of the simulated one-request
figures, so the real run and the simulation are held to the same absolute rates and targets. The real run
names the profile (model.check_timing), so it ends with `pdlab profile --check`'s line.

Per variant and rate: TTFT p50 and p90, the p90 over requests of each request's p99 ITL, attainment; per
variant the saturation output throughput; per recipe whether the deployments rank the same (by saturation
throughput, and by mean attainment over the finite rates). The targets (issue 25) are printed beside: TTFT
p50 within 20%, TTFT p90 and ITL p90 within 25%, attainment within 0.15, saturation within 15%, the same
ranking. Each real run is then replayed at its own pace (pdlab.timing.replay: each worker's steps at their
measured / predicted time in the run, rate by rate, with the run's gaps and hops), and the same figures are
counted again: the forecast's miss is the box's drift between the profile and the run plus the simulator's own
error; the replay's is the latter alone. Each real run is also run a second time right after it (--no-again
skips it), and the two real runs are held to the same targets against each other: the measurement's own
reproducibility, the floor under any forecast's miss at this many requests. It is why the default is 48
requests a rate, twice: at 16 once, a real run met the targets against itself in 20 of 24 ITL p90 cells, at 24
twice in 22-23 (BENCHMARKS.md). A ranking that differs only between deployments within the target of each other on both
sides (a tie) is counted apart.

A point forecast cannot know how fast the box will be minutes later. With --calibrate (the default) one more recipe,
of a length mix of its own, runs for real right after the profile, and its workers' pace against the profile goes
into the profile's drift (pdlab profile --check --write-drift); every forecast then carries a band, the recipe
simulated with every worker at the slow and the fast end of that drift (pdlab.sim.band), and each real figure is
counted inside the band and within its target of it; the band's centre (every worker at the drift's median) is
scored as a forecast too. A recipe's runs never feed its own forecast, and none feeds the
step model. A second forecast is scored beside the first, from a copy of the profile that also took the calibration
run's host time and contention (--write-host: the run's own in place of the profile's host probe's). With
--accumulate (the default with --calibrate; with --no-calibrate, the drift of the profile, given or measured, grows
from the first recipe's runs) each recipe's real runs go into the drift once that recipe is scored, as
a user adds each run checked (`--write-drift`): the next recipes' bands then hold the box's pace over minutes of
sustained load, which one short calibration right after the profile does not see; a recipe's own runs never feed its
own forecast, and the point forecast never reads the drift. DIR/validation.json keeps every figure; the runs stay in
DIR for pdlab compare.

--isa x86-64-v3 runs everything (profile, calibration, recipes) as bench_vllm_matrix's AVX2 stand-in: pdlab's
kernels built for that target and torch's capped at AVX2, so each kernel races torch's AVX2 path as on an
AVX2-only CPU (the kernels' choice differs: prefill attention and RMSNorm go to torch on this project's Xeon).
The code paths are an AVX2 CPU's; the caches, memory and clock are still this box's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_vllm import AVX2_CAPS, AVX2_STAND_IN  # noqa: E402
from pdlab.constants import KERNEL_MARCH_ENV  # noqa: E402
from pdlab.engine.model import PRESETS, ModelLoadError, model_config  # noqa: E402
from pdlab.recipe import RecipeError, load_profile  # noqa: E402
from pdlab.recipe.model import ModelSpec  # noqa: E402
from pdlab.recipe.timing import profile_path  # noqa: E402
from pdlab.timing.check import other_model  # noqa: E402
from pdlab.timing.replay import TARGETS, compare, covered, figures as replay_figures, table, within  # noqa: E402

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


# the calibration run (--calibrate): a length mix of its own, run once for real before the held-out recipes; its
# workers' pace against the profile becomes the profile's drift (pdlab profile --check --write-drift), which
# gives each forecast its band (pdlab.sim.band); with --accumulate each recipe's runs join it once scored
CALIBRATION = ({"input_len": {"kind": "uniform", "min": 200, "max": 1000},
                "output_len": {"kind": "uniform", "min": 24, "max": 128}}, {}, "pull")


MIN_PROMPT = 32  # tokens: a context that leaves prompts fewer than this beside the longest output is refused


def model_raw(model: str, dtype: str | None) -> dict:
    """A recipe's model section for `model`: a preset's name, a directory (made absolute: the runs start
    elsewhere), or anything else as a path (a hub id in the local cache, or one the recipe's check refuses)."""
    local = os.path.expanduser(model)
    if model in PRESETS:
        out = {"preset": model}
    elif os.path.isdir(local) or model.startswith((".", "/", "~")):
        out = {"path": os.path.abspath(local)}
    else:
        out = {"path": model}
    return dict(out, dtype=dtype) if dtype else out


def fitted(lengths: dict, context: int) -> dict:
    """`lengths` (uniform prompts; uniform or fixed outputs) with prompts cut so that a prompt and its longest
    output fit `context` tokens. ValueError where fewer than MIN_PROMPT tokens would be left for a prompt."""
    out, inp = lengths["output_len"], dict(lengths["input_len"])
    room = context - int(out["max"] if out["kind"] == "uniform" else out["value"])
    if room < MIN_PROMPT:
        raise ValueError(f"a context of {context} tokens leaves {max(room, 0)} for prompts beside outputs of "
                         f"{context - room}")
    inp["max"] = min(inp["max"], room)
    inp["min"] = min(inp["min"], inp["max"])
    return dict(lengths, input_len=inp)


def base_recipe(name: str, requests: int, repeats: int, model: dict | None = None, context: int = 1 << 30) -> dict:
    lengths, engine, mode = CALIBRATION if name == "calibration" else RECIPES[name]
    return {"name": f"tv-{name}", "seed": 7, "warmup": 1, "repeats": repeats,
            "model": model or {"preset": "cpu-demo"},
            "engine": {"block_size": 16, "kv_blocks": "auto", "max_running": 32, "prefix_caching": False, **engine},
            "workload": {"requests": requests, "arrival": {"kind": "poisson"}, **fitted(lengths, context)},
            "variants": {"unified-2x": {"deployment": UNIFIED}, f"1P1D-{mode}": {"deployment": disagg(mode)}}}


def plan_rates(raw: dict, profile: str) -> dict:
    """The recipe with absolute rates and SLO from the profile's simulation (the same for both runs)."""
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    probe = dict(raw, rates=[math.inf], repeats=1, slo={"ttft": "5x", "itl": "10x"},
                 model=dict(raw["model"], timing=profile))
    r = parse_recipe(probe)
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    s = res.summary()
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
    from pdlab.measure.records import load_run

    r = load_run(run_dir)
    return replay_figures(r.requests, r.summary)


def band_lines(rows: list[dict]) -> list[str]:
    """Each real figure against the forecast's band: 'real in lo-hi', + where inside, ~ within the target of it,
    ! beyond."""
    def one(x: dict, digits: int) -> str:
        if x["lo"] is None:
            return "-"
        mark = "+" if x["inside"] else "~" if x["ok"] else "!"
        return f"{x['real']:.{digits}f} in {x['lo']:.{digits}f}-{x['hi']:.{digits}f} {mark}"

    out = []
    for r in rows:
        out.append(f"{r['variant'] + ' @ ' + r['rate']:28} {one(r['ttft_p50'], 0):>22} {one(r['ttft_p90'], 0):>22} "
                   f"{one(r['itl_p90'], 1):>22} {one(r['attainment'], 2):>22}"
                   + (f"  saturation {one(r['saturation'], 0)}" if "saturation" in r else ""))
    return out


def render(name: str, cmp: dict, check: str, paced: dict | None, again: dict | None = None,
           band: list[dict] | None = None, centre: dict | None = None) -> None:
    print(f"\n{name}: real / simulated and the error (! beyond the target)")
    for line in table(cmp):
        print(f"  {line}")
    if band:
        print("  the real run against the forecast's band (the profile's drift; + inside, ~ within the target of it):")
        for line in band_lines(band):
            print(f"    {line}")
    if centre:
        print("  the band's centre (every worker at the drift's median pace) as a forecast:")
        for line in table(centre):
            print(f"    {line}")
    for line in check.splitlines():
        print(f"  {line}")
    if paced:
        pace = "; ".join(f"{v}: " + ", ".join(f"{w} x{p['factor']:.2f}" for w, p in ws.items())
                         for v, ws in paced["paces"].items())
        print(f"  replayed at the run's own pace ({pace}; pdlab profile --check --replay):")
        for line in table(paced["comparison"]):
            print(f"    {line}")
    if again:
        print("  the real run against itself run again (pdlab run, the same recipe, right after):")
        for line in table(again, ("run", "rerun")):
            print(f"    {line}")


def centre(real: dict, band: dict | None) -> dict | None:
    """The band's centre (pdlab.sim.band: every worker at the drift's median) against `real` (figures: variant ->
    rate tag -> figure) as a forecast is scored (compare), for the variants the band has; None without one."""
    if not band or not band.get("mid"):
        return None
    return compare({v: f for v, f in real.items() if v in band["variants"]}, band["mid"])


def tally(rows: list[dict], recipes: list[dict]) -> dict:
    met = within(rows)
    return {"met": {k: {"within": a, "of": b} for k, (a, b) in met.items()},
            "ranking_same": {"recipes": sum(c["ranking"]["same"] for c in recipes), "of": len(recipes)},
            "ranking_agree": {"recipes": sum(c["ranking"]["agree"] for c in recipes),
                              "of": len(recipes)}}


def say_tally(what: str, t: dict) -> None:
    print(f"{what}: " + ", ".join(f"{k} (±{TARGETS[k]:g}{'' if k == 'attainment' else ' rel'}) {m['within']}/{m['of']}"
                                  for k, m in t["met"].items()) +
          f"; same ranking {t['ranking_same']['recipes']}/{t['ranking_same']['of']}"
          f" ({t['ranking_agree']['recipes']} with ties within the target read as ties)")


def replayed(run_dir: str, profile: str) -> dict:
    """The real run simulated at its own pace (pdlab.timing.replay): what is left of the miss once the box's
    drift between the profile and the run is taken out."""
    from pdlab.measure.records import load_run
    from pdlab.sim.pace import draw
    from pdlab.timing.replay import replay

    res = replay(load_run(run_dir), load_profile(profile, "--profile"))
    res["paces"] = {v: {w: {"factor": p.factor, "by_run": [list(x) for x in p.by_run],
                            "gap_ms_p50": draw(p.gaps_ms, 0.5) if p.gaps_ms else None,
                            "gap_ms_p99": draw(p.gaps_ms, 0.99) if p.gaps_ms else None}
                        for w, p in ws.items()} for v, ws in res["paces"].items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new directory for the profile, recipes, runs and results")
    ap.add_argument("--profile", help="an existing profile (default: measure one first with pdlab profile)")
    ap.add_argument("--model", default="cpu-demo", help="a preset's name or a saved model's directory (default "
                                                        "cpu-demo)")
    ap.add_argument("--dtype", help="the model's dtype (default: the recipe's, float32)")
    ap.add_argument("--steps", type=int, default=400, help="pdlab profile --steps (default 400)")
    ap.add_argument("--requests", type=int, default=48, help="requests per rate (default 48)")
    ap.add_argument("--repeats", type=int, default=2, help="repeats of each rate (default 2)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"which of {', '.join(RECIPES)}")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="run a calibration recipe of its own length mix once, for real, and write its pace into the "
                         "profile's drift (pdlab profile --check --write-drift), so each forecast has a band "
                         "(default: on; a given --profile is copied into --out first)")
    ap.add_argument("--accumulate", action=argparse.BooleanOptionalAction, default=None,
                    help="write each recipe's real runs into the profile's drift once it is scored, for the bands of "
                         "the recipes after it (default: on with --calibrate, off with --no-calibrate; "
                         "--no-calibrate --accumulate grows the profile's drift, given or new, from the first "
                         "recipe's runs)")
    ap.add_argument("--again", action=argparse.BooleanOptionalAction, default=True,
                    help="run each real recipe twice and hold the two real runs to the targets against each other "
                         "(default: on)")
    ap.add_argument("--isa", choices=("native", AVX2_STAND_IN), default="native",
                    help=f"native, or {AVX2_STAND_IN}: every run as an AVX2-only CPU's code paths (pdlab's kernels "
                         "built for it, torch's capped at AVX2; default native)")
    args = ap.parse_args()
    if args.isa == AVX2_STAND_IN:  # inherited by every pdlab command below, and their workers
        os.environ.update({**AVX2_CAPS, KERNEL_MARCH_ENV: AVX2_STAND_IN})
    accumulate = args.calibrate if args.accumulate is None else args.accumulate
    names = [n for n in args.recipes.split(",") if n]
    if any(n not in RECIPES for n in names):
        print(f"error: --recipes: expected names from {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and os.listdir(args.out):
        print(f"error: --out {args.out}: exists and is not empty", file=sys.stderr)
        return 2
    model = model_raw(args.model, args.dtype)
    try:
        spec = ModelSpec.from_raw(model, "model")
        context = int(getattr(model_config(spec), "max_position_embeddings", None) or 4096)
        for name in names + ["calibration"]:
            lengths = (CALIBRATION if name == "calibration" else RECIPES[name])[0]
            cut = fitted(lengths, context)
            if cut != lengths:
                print(f"{name}: prompts {lengths['input_len']['min']}-{lengths['input_len']['max']} cut to "
                      f"{cut['input_len']['min']}-{cut['input_len']['max']} tokens (the model's context: {context})")
    except (RecipeError, ModelLoadError, OSError, ValueError) as e:
        print(f"error: --model {args.model}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    given = None
    if args.profile:
        given = profile_path(args.profile)  # a file, or a shipped profile's name
        if given is None:
            print(f"error: --profile {args.profile}: no such file or shipped profile", file=sys.stderr)
            return 2
        differs = other_model(load_profile(given, "--profile"), spec)
        if differs:  # its drift would refuse the runs (pdlab profile --check --write-drift), after the first
            print(f"error: --profile {args.profile}: not of --model ({differs})", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    py = [sys.executable, "-m", "pdlab.cli"]
    t0 = time.monotonic()
    profile = os.path.abspath(os.path.join(args.out, "box.yaml"))
    if given is not None:
        shutil.copyfile(given, profile)  # the calibration writes into it: never into the one given
    else:
        print(f"measuring the profile ({args.steps} steps) ...", flush=True)
        print(run(py + ["profile", "--model", model.get("preset") or model["path"], "--steps", str(args.steps),
                        "--out", profile] + (["--dtype", args.dtype] if args.dtype else []),
                  os.path.join(args.out, "profile.log")))
    results = {"model": model, "isa": args.isa, "profile": profile, "given_profile": args.profile, "targets": TARGETS,
               "recipes": {}}
    if args.calibrate:
        print("calibration: one real run of its own length mix, its pace into the profile's drift", flush=True)
        raw = plan_rates(base_recipe("calibration", args.requests // 2, 1, model, context), profile)
        path, cal = os.path.join(args.out, "calibration.yaml"), os.path.join(args.out, "calibration-real")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f, sort_keys=False)
        run(py + ["run", path, "--out", cal], os.path.join(args.out, "calibration-real.log"))
        # beside the profile, a copy with the calibration's host time and contention in place of the host probe's
        # (--write-host: prefill_x and decode_x beside stepping workers among them): does one run's worth help?
        # Copied before the drift is written: a drift is read against the profile it is kept in
        calibrated = os.path.join(args.out, "box-calibrated.yaml")
        shutil.copyfile(profile, calibrated)
        out = run(py + ["profile", "--check", cal, "--profile", profile, "--write-drift"],
                  os.path.join(args.out, "calibration-check.log"))
        results["calibration"] = {"recipe": raw, "drift": out.strip().splitlines()[-1],
                                  "drift_raw": load_profile(profile).drift.to_raw()}  # before any recipe's runs
        print(f"  {results['calibration']['drift']}")
        out = run(py + ["profile", "--check", cal, "--profile", calibrated, "--write-host"],
                  os.path.join(args.out, "calibration-host.log"))
        results["calibration"]["host"] = out.strip().splitlines()[-1]
    for name in names:
        print(f"{name}: planning rates from the profile's simulation", flush=True)
        raw = plan_rates(base_recipe(name, args.requests, args.repeats, model, context), profile)
        path = os.path.join(args.out, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f, sort_keys=False)
        real, sim = os.path.join(args.out, f"{name}-real"), os.path.join(args.out, f"{name}-sim")
        run(py + ["run", path, "--out", real], os.path.join(args.out, f"{name}-real.log"))
        real2 = os.path.join(args.out, f"{name}-real-again")
        if args.again:
            run(py + ["run", path, "--out", real2], os.path.join(args.out, f"{name}-real-again.log"))
        run(py + ["run", path, "--simulate", "--set", f"model.timing={profile}", "--out", sim],
            os.path.join(args.out, f"{name}-sim.log"))
        check = run(py + ["profile", "--check", real, "--profile", profile],
                    os.path.join(args.out, f"{name}-check.log"))
        again = compare(figures(real), figures(real2)) if args.again else None
        cmp = compare(figures(real), figures(sim))
        paced = replayed(real, profile)
        fb = json.load(open(os.path.join(sim, "summary.json"))).get("forecast_band")
        band = covered(figures(real), fb) if fb else None
        results["recipes"][name] = {"recipe": raw, "comparison": cmp, "check": check, "replay": paced,
                                    "again": again, "band": fb, "band_rows": band,
                                    "drift": (fb or {}).get("variants"),  # each variant's pace band, as forecast
                                    "centre": centre(figures(real), fb)}
        if args.calibrate:
            sim2 = os.path.join(args.out, f"{name}-sim-calibrated")
            run(py + ["run", path, "--simulate", "--set", f"model.timing={calibrated}", "--out", sim2],
                os.path.join(args.out, f"{name}-sim-calibrated.log"))
            results["recipes"][name]["calibrated"] = compare(figures(real), figures(sim2))
        if accumulate:  # scored: its runs join the drift of the recipes after it
            for i, done in enumerate([real] + ([real2] if args.again else [])):
                run(py + ["profile", "--check", done, "--profile", profile, "--write-drift"],
                    os.path.join(args.out, f"{name}-drift{i}.log"))
        render(name, cmp, check, paced, again, band, results["recipes"][name]["centre"])
        if args.calibrate:
            print("  the forecast from the profile with the calibration run's host time and contention "
                  "(--write-host):")
            for line in table(results["recipes"][name]["calibrated"]):
                print(f"    {line}")
    recs = results["recipes"].values()
    results.update(tally([r for x in recs for r in x["comparison"]["rows"]], [x["comparison"] for x in recs]))
    results["replay_met"] = tally([r for x in recs for r in x["replay"]["comparison"]["rows"]],
                                  [x["replay"]["comparison"] for x in recs])
    band_rows = [r for x in recs for r in (x["band_rows"] or [])]
    if band_rows:
        for key, by in (("band_met", "ok"), ("band_inside", "inside")):
            results[key] = {k: {"within": a, "of": b} for k, (a, b) in within(band_rows, by).items()}
    if args.calibrate:
        results["calibrated_met"] = tally([r for x in recs for r in x["calibrated"]["rows"]],
                                          [x["calibrated"] for x in recs])
    centres = [x["centre"] for x in recs if x.get("centre")]
    if centres:
        results["centre_met"] = tally([r for c in centres for r in c["rows"]], centres)
    if args.again:
        results["again_met"] = tally([r for x in recs for r in x["again"]["rows"]], [x["again"] for x in recs])
    results["took_s"] = time.monotonic() - t0
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(results, f, indent=2)
    print()
    say_tally("within target, forecast (the profile as measured before the runs)", results)
    if args.calibrate:
        say_tally("within target, forecast with the calibration run's host time and contention",
                  results["calibrated_met"])
    if centres:
        say_tally(f"within target, the band's centre (the forecast at its drift's median pace; {len(centres)} of "
                  f"{len(recs)} recipes had a band)", results["centre_met"])
    say_tally("within target, replayed at each run's own pace", results["replay_met"])
    if args.again:
        say_tally("within target, the real run against itself run again", results["again_met"])
    if band_rows:
        for what, key in (("within the target of the forecast's band", "band_met"),
                          ("inside the forecast's band", "band_inside")):
            print(f"{what}: " + ", ".join(f"{k} {m['within']}/{m['of']}" for k, m in results[key].items()))
    print(f"{time.monotonic() - t0:.0f} s; wrote {os.path.join(args.out, 'validation.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
