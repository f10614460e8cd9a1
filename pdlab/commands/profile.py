"""`pdlab profile`: measure this device's engine steps, KV transfers and host time as a worker runs them, fit
a timing profile, write it; `pdlab profile --check RUN_DIR`: hold a profile against a run's own steps.

The profile (pdlab/recipe/timing.py) is what a recipe's `model.timing` takes: a timed run then waits out the
fitted step time instead of running the model, and the simulator steps on it. The steps are measured in a
spawned process set up as a worker is (pdlab.timing.process: pinned to a core, one torch thread, the
worker's engine with its kernel choice, malloc tuning and pool), on a designed set of prefill-only,
decode-only and mixed steps (pdlab.timing.measure); the step model is fitted by non-negative least squares
on relative residuals (pdlab.timing.fit) on a training split of the cases and judged on the held-out ones;
the transports usable here are probed for latency + bytes / bandwidth; and a small real deployment gives
the host time around steps (pdlab.timing.host_probe) that the simulator adds to it.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from typing import Optional

from pdlab.constants import DTYPES

DEFAULT_STEPS = 400
MIN_STEPS = 12
TEST_FRACTION = 0.3


def default_out(model: str, device: str) -> str:
    """profiles/<model>-<device>.yaml under the current directory: profiles/cpu-demo-cpu.yaml,
    profiles/gpu-0.6b-cuda0.yaml."""
    base = os.path.basename(os.path.normpath(os.path.expanduser(model))) or "model"
    return os.path.join("profiles", f"{base}-{re.sub(r'[^A-Za-z0-9]+', '', device)}.yaml")


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def default_cores(threads: int) -> list[int]:
    """The last `threads` cores this process may use (a worker on one core: the last one)."""
    mine = sorted(os.sched_getaffinity(0))
    return mine[-threads:]


def main(model: str = "cpu-demo", device: str = "cpu", dtype: Optional[str] = None, out: Optional[str] = None,
         steps: int = DEFAULT_STEPS, seed: int = 0, threads: Optional[int] = None, quiet: bool = False,
         cores: Optional[str] = None, host: bool = True, replay: bool = False,
         check_only: tuple[str, ...] = ()) -> int:
    """`check_only`: the --check options given without --check (an error: they would be ignored, and a
    --profile FILE then be overwritten by the new profile's default path)."""
    def say(msg: str = "") -> None:
        if not quiet:
            print(msg, flush=True)

    if replay:
        return _err("--replay goes with --check RUN_DIR: the run to replay")
    if check_only:
        return _err(f"{', '.join(check_only)} go{'es' if len(check_only) == 1 else ''} with --check RUN_DIR: "
                    "without it pdlab profile measures a new profile")
    if steps < MIN_STEPS:
        return _err(f"--steps must be at least {MIN_STEPS} (9 terms to fit and steps held out), got {steps}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return _err(f"--device must be cpu or cuda[:N], got {device!r}")
    if threads is not None and threads < 1:
        return _err(f"--threads must be at least 1, got {threads}")
    mine = sorted(os.sched_getaffinity(0))
    if cores is not None:
        try:
            picked = [int(c) for c in cores.split(",") if c.strip()]
        except ValueError:
            return _err(f"--cores must be core numbers such as 1 or 0,1, got {cores!r}")
        if not picked or any(c not in mine for c in picked):
            return _err(f"--cores {cores}: this process may use cores {','.join(map(str, mine))}")
    else:
        picked = default_cores(threads or 1)
    if dtype is not None:  # as a recipe spells it (bf16 is bfloat16): the profile records the one a run compares
        if dtype.lower() not in DTYPES:
            return _err(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype.lower()]
    if threads is not None and cores is not None and threads != len(picked):
        return _err(f"--threads {threads} with --cores {cores}: a worker runs one thread per core; give one")

    from pdlab.engine.model import PRESETS
    from pdlab.timing.process import MeasureError, job_for, measure

    if model not in PRESETS and not os.path.isdir(os.path.expanduser(model)):
        return _err(f"--model {model}: not a preset ({', '.join(sorted(PRESETS))}) nor a model directory")
    cuda = device.startswith("cuda")
    dtype = dtype or ("bfloat16" if cuda else "float32")
    out = out or default_out(model, device)
    say(f"profiling {model} ({dtype}) on {device}, as a worker on {'host ' if cuda else ''}core"
        f"{'s' if len(picked) > 1 else ''} {','.join(map(str, picked))}")
    try:
        res = measure(job_for(model, dtype, device, picked, steps, seed), progress=say)
    except MeasureError as e:
        return _err(str(e))
    except KeyboardInterrupt:  # the measuring process is ended on the way out (pdlab.timing.process.measure)
        print("interrupted (Ctrl-C): nothing written", file=sys.stderr)
        return 130
    host_est = None
    if host and cuda:
        say("host time: not probed on cuda (a GPU deployment per profile is costly); take it from a run with "
            "pdlab profile --check RUN_DIR --profile FILE --write-host")
    if host and not cuda:
        from pdlab.timing.host_probe import probe_host

        try:
            host_est = probe_host(model, dtype, mine[-2:] if len(mine) > 1 else mine, seed, say)
        except KeyboardInterrupt:  # the probe's cluster stops its workers on the way out
            print("interrupted (Ctrl-C): nothing written", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - the steps are measured: write them, say what is missing
            say(f"warning: host time not measured ({type(e).__name__}: {e}); the profile's host block stays empty")
    from pdlab.timing.build import build_profile
    from pdlab.timing.write import write_profile

    # a directory by its absolute path: a check from another folder still knows the model (timing.check)
    where = os.path.expanduser(model)
    stored = os.path.abspath(where) if os.path.isdir(where) else model
    raw, report = build_profile(res, model=stored, device=device, dtype=dtype, steps=steps, seed=seed,
                                test_fraction=TEST_FRACTION, host=host_est, name=_name(out))
    header = _header(model, device, dtype, steps, seed, res, picked)
    try:
        write_profile(out, raw, header)
    except OSError as e:
        return _err(f"cannot write {out}: {e.strerror or e}")
    for line in report:
        say(line)
    say(f"wrote {out}")
    return 0


def _name(out: str) -> str:
    return os.path.splitext(os.path.basename(out))[0]


def _header(model: str, device: str, dtype: str, steps: int, seed: int, res: dict, cores: list[int]) -> str:
    date = datetime.date.today().isoformat()
    return (f"Timing profile measured by `pdlab profile --model {model} --device {device} --dtype {dtype} "
            f"--steps {steps} --seed {seed}`\n"
            f"on {res['device']}, {date} ({len(res['steps'])} engine steps in {res['measured_s']:.0f} s), in a process "
            f"pinned as a worker on core{'s' if len(cores) > 1 else ''} {','.join(map(str, cores))}.\n"
            "step: ms per engine step = fixed_ms + prefill_token_ms x prefill tokens + prefill_attention_ms x "
            "(prefill token x context pairs) / 1000\n"
            "      + decode_seq_ms x decode sequences + context_token_ms x context tokens of the decodes\n"
            "      + chunk_ms x prefill chunks + fresh_pair_ms x (fresh chunk tokens x (tokens + 1) / 2) / 1000\n"
            "      + resumed_pair_ms x (resumed chunk tokens x (start + tokens)) / 1000\n"
            "      + resumed_context_ms x context tokens of resumed chunks (fresh: a prompt's first chunk;\n"
            "      resumed: a later one, or one after a prefix-cache hit)\n"
            "      + knee_token_ms x min(prefill tokens + decode sequences, knee_tokens) (small batches).\n"
            "host: a worker's own time between steps, a request's hop to its worker, a hand-over's hop, the\n"
            "router's time per request, a decode worker's time per hand-over it admits: the simulator adds them.\n"
            "kernels: the CPU kernels the measured steps ran (pdlab.engine.kernel_check).\n"
            "fit: percentage errors of the step model on held-out steps (mape = mean absolute percentage error).\n"
            "kv_memory_gb: the memory a timed engine takes kv_memory_fraction of (the free device memory; on CPU\n"
            "min(available, 1 GiB / the default fraction), so a timed pool matches the real one).\n"
            "transfer: latency + bytes / bandwidth fitted to pdlab.kv.probe hand-overs (best of 10).")


def check(run_dir: str, profile: Optional[str] = None, write_host: bool = False, replay: bool = False,
          write_drift: bool = False) -> int:
    """`pdlab profile --check RUN_DIR [--profile P] [--write-host] [--write-drift] [--replay]`. With both writes
    the host time goes first and the drift is read against the profile it leaves."""
    from pdlab.measure.records import RunDirError, load_run
    from pdlab.recipe import RecipeError, load_profile, parse_recipe
    from pdlab.timing.check import CheckError, check_run, env_pace_reads, lines

    flag = " and ".join(f for f, on in (("--write-host", write_host), ("--write-drift", write_drift)) if on)
    if (write_host or write_drift) and profile is None:
        return _err(f"{flag} {'need' if ' and ' in flag else 'needs'} --profile FILE: the profile to write the run's "
                    "figures into")
    if (write_host or write_drift) and not os.path.isfile(os.path.expanduser(profile)):
        return _err(f"{flag}: --profile {profile} is not a file (a shipped profile is never written: copy it to "
                    "a file and name that)")
    try:
        run = load_run(run_dir)
        given = load_profile(profile, "--profile") if profile else None
        recipe = parse_recipe(run.recipe) if run.recipe else None
    except (RunDirError, RecipeError) as e:
        return _err(str(e))
    if recipe is None:
        return _err(f"{run_dir}: no recipe.yaml: cannot tell which variant is which")
    if run.env.get("simulated"):
        return _err(f"{run_dir}: a simulated run: its steps are the profile's by construction; check a real run")
    variants = {n: recipe.resolved(n) for n in recipe.variant_names}
    try:
        checks = check_run(variants, run.steps, run.requests, given, run.env.get("cpu_kernels"),
                           run.env.get("worker_pace_ms"), run.env.get("worker_memory_pace_ms"),
                           env_pace_reads(run.env))
    except CheckError as e:
        return _err(f"{run_dir}: {e}")
    if not checks:
        return _err(f"{run_dir}: no variant with steps and a profile to check them against (give --profile, or "
                    "name one in the recipe: model.check_timing or model.timing)")
    out, warnings = lines(checks)
    print(f"profile check of {run_dir} (pdlab profile --check): each kind of step, MAPE of the profile's prediction")
    for line in out:
        print(f"  {line}")
    for w in warnings:
        print(f"warning: {w}")
    if write_host or write_drift:
        other = [f"{n} {c['other_model']}" for n, c in checks.items() if c.get("other_model")]
        if other:
            return _err(f"{flag}: this run ran another model or dtype than {profile} was measured on "
                        f"({'; '.join(other)}): its figures would measure the mismatch, not the box; nothing written")
    if replay:
        code = _replay(run, given, checks)
        if code:
            return code
    if write_host and (code := _write_host(checks, profile)):
        return code
    if write_drift:
        return _write_drift(run, checks, profile)
    return 0


def _replay(run: object, given: object, checks: dict) -> int:
    """The run simulated at its own pace, beside the run (pdlab.timing.replay)."""
    from pdlab.engine.model import ModelLoadError
    from pdlab.recipe import RecipeError
    from pdlab.timing.replay import TARGETS, ReplayError, replay, table, within
    from pdlab.workload import WorkloadError

    try:
        res = replay(run, given, checks)
    except (ReplayError, RecipeError, WorkloadError, ModelLoadError) as e:  # a trace or model not on this machine
        return _err(f"--replay: {e}")
    paces = "; ".join(f"{v}: " + ", ".join(f"{w} x{p.factor:.2f}" for w, p in ws.items())
                      for v, ws in res["paces"].items())
    print(f"replay (simulated, not measured): the run's recipe, rates and SLO in the simulator, each worker at its "
          f"pace in the run ({paces}: its step time over the profile's prediction, rate by rate; its gaps between "
          "steps drawn as they were); real / simulated and the error, ! beyond the target")
    cmp = res["comparison"]
    for line in table(cmp):
        print(f"  {line}")
    met = within(cmp["rows"])
    print("  within target: " + ", ".join(f"{k} (±{TARGETS[k]:g}{'' if k == 'attainment' else ' rel'}) {a}/{b}"
                                          for k, (a, b) in met.items() if b))
    return 0


def _write_host(checks: dict, path: str) -> int:
    """The host time this run measured, into the profile file checked (--profile): each figure from the first
    variant that measured it (a unified one has no hand-over: a disaggregated one gives that), the contention
    from the first that has it, filled in from the others."""
    from pdlab.timing.contention import describe
    from pdlab.timing.host import FIGURES

    ran = [c for c in checks.values() if not c["modelled"] and c["host"].get("gap_ms") is not None]
    if not ran:
        return _err("--write-host: no variant of this run ran its model and measured host time")
    est = {k: next((c["host"][k] for c in ran if c["host"].get(k) is not None), None) for k in FIGURES}
    contention: dict = {}
    for c in ran:
        contention = {**(c.get("contention") or {}), **contention}
    raw, file, head = _read_profile(path)
    raw["host"] = {**(raw.get("host") or {}), **{k: v for k, v in est.items() if v is not None}}
    if "handoff_ms" not in raw["host"] and "hop_ms" in raw["host"]:
        raw["host"]["handoff_ms"] = raw["host"]["hop_ms"]  # as pdlab.timing.host.host_raw: a hand-over is a hop
    if contention:  # pdlab.timing.contention: what the run's workers cost each other and after idling
        raw["contention"] = {**(raw.get("contention") or {}), **contention}
    _write(file, raw, head)
    print(f"wrote the run's host time into {file}: {raw['host']}"
          + (f"; its contention: {describe(raw['contention'])}" if contention else ""))
    return 0


def _write_drift(run: object, checks: dict, path: str) -> int:
    """The run's pace against the profile file checked (--profile), added to its drift (pdlab.timing.drift)."""
    from pdlab.recipe import RecipeError, load_profile
    from pdlab.timing.drift import checked_variants, merged, run_factors, taken

    try:
        profile = load_profile(path, "--profile")  # as it stands: after --write-host, with the run's host time
    except RecipeError as e:
        return _err(str(e))
    source = str(run.env.get("time") or "")  # type: ignore[attr-defined]
    if taken(profile.drift, source):
        return _err(f"--write-drift: this run (started {source}) is in {path}'s drift already")
    factors = run_factors(profile, run.steps, checked_variants(checks), run.requests)  # type: ignore[attr-defined]
    if not factors:
        return _err("--write-drift: no variant of this run ran its model and took steps to read its pace from")
    drift = merged(profile.drift, factors, source)
    raw, file, head = _read_profile(path)
    raw["drift"] = drift.to_raw()
    _write(file, raw, head)
    print(f"wrote the run's pace into {file}'s drift: {len(factors)} paces (each worker's, rate by rate), "
          f"x{min(factors):.2f}-{max(factors):.2f}; its drift now {drift.describe()}")
    return 0


def _read_profile(path: str) -> tuple[dict, str, str]:
    """(the profile file's plain data, its path, its header comment)."""
    import yaml

    from pdlab.recipe.timing import profile_path

    file = profile_path(path)
    with open(file) as f:
        text = f.read()
    return yaml.safe_load(text), file, "".join(ln[2:] + "\n" for ln in text.splitlines() if ln.startswith("# "))


def _write(file: str, raw: dict, head: str) -> None:
    from pdlab.timing.write import write_profile

    write_profile(file, raw, head)
