"""`pdlab run RECIPE`: every variant at every rate, into one run directory."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Optional

from pdlab.engine.model import ModelLoadError
from pdlab.measure.records import RunDir, collect_env, default_run_path, load_run


def _err(msg: str) -> int:
    print(f"pdlab run: error: {msg}", file=sys.stderr)
    return 2


def place_main_process(recipe: object) -> tuple[list[int], list[str]]:
    """Keep the main process (router, harness) off the workers' cores when the machine has spare ones.
    Returns its cores and the warnings to record."""
    # deferred: numpy
    from pdlab.harness import worker_cores
    from pdlab.serve.topology import cpu_cores

    mine = set(cpu_cores())
    spare = sorted(mine - worker_cores(recipe))
    if spare and len(spare) < len(mine):
        os.sched_setaffinity(0, spare)
        return spare, []
    if spare:
        return spare, []
    return sorted(mine), ["the main process shares cores with the workers (this machine has no spare core): token "
                          "times are the workers' own stamps, but sends may be late and delivery lag high under load"]


def main(recipe_path: str, sets: list[str], out: Optional[str], variants: Optional[str],
         simulate: Optional[bool] = None) -> int:
    """`simulate`: run every variant in virtual time (pdlab.sim) instead of on worker processes; every
    variant needs a modelled timing. None: as the recipe's `simulate` key says."""
    # deferred: numpy
    from pdlab.harness import Harness, RunAborted, check_machine
    from pdlab.measure.finish import finalize
    from pdlab.recipe import RecipeError, load_recipe
    from pdlab.report.live import LiveView
    from pdlab.serve.topology import ClusterError
    from pdlab.workload import WorkloadError, build_workload

    # Everything that can be wrong with the recipe is found here, before anything starts.
    try:
        recipe = load_recipe(recipe_path, sets, variants)
        flag = "--simulate" if simulate else "simulate: true"
        simulate = recipe.shared.simulate if simulate is None else simulate
        if simulate:
            for name, v in recipe.variants.items():
                if not v.model.modelled:
                    raise RecipeError(f"{flag}: variant {name} has no model.timing; give it a profile (e.g. "
                                      "model.timing: cpu-demo-2core) to simulate it")
        else:
            check_machine(recipe)
        workloads = {name: build_workload(v) for name, v in recipe.variants.items()}
    except (RecipeError, ClusterError, ModelLoadError, WorkloadError) as e:
        return _err(str(e))
    path = out or default_run_path(recipe.name)
    if os.path.exists(path) and not os.path.isdir(path):
        return _err(f"--out {path}: exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path):
        return _err(f"--out {path}: directory exists and is not empty")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return _err(f"--out {path}: cannot create it ({e.strerror})")

    if simulate:
        return _simulate(recipe, workloads, path)
    cores, warnings = place_main_process(recipe)
    rd = RunDir(path)
    rd.write_recipe(recipe)
    env = collect_env()
    env.update(main_process_cores=cores, warnings=warnings)
    rd.write_env(env)
    partial, reason, code = False, None, 0
    # SIGTERM ends the run like Ctrl-C does: cleanly, with what was measured.
    old_term = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    view = LiveView(title=f"pdlab run {recipe.name}", slo=None if recipe.slo.relative else recipe.slo)
    for w in warnings:
        view.note(f"warning: {w}")
    harness = Harness(recipe, rd, view, workloads)
    try:
        with view:
            harness.run()
    except KeyboardInterrupt:
        partial, reason, code = True, "interrupted (Ctrl-C)", 130
    except (RunAborted, ClusterError) as e:
        partial, reason, code = True, str(e), 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if partial:
            rd.mark_partial(reason)
        if harness.slo.relative or harness.recipe.relative_rates:  # stopped before the calibration resolved them:
            rd.close()                                                 # nothing was measured
            rd.write_summary({"partial": True, "reason": reason, "slo": None, "variants": {}})
        else:
            grid = {v: harness.recipe.rates for v in recipe.variant_names}  # relative rates resolved
            finalize(rd, harness.slo, grid=grid, partial=partial, reason=reason, **harness.facts(warnings))
    _print_table(path)
    _print_profile_check(path)
    if partial:
        print(f"run stopped early: {reason}", file=sys.stderr)
    print(path)
    return code


def _print_profile_check(path: str) -> None:
    """The run's last lines: its steps against the profile its recipe names (summary.json's profile_check)."""

    try:
        with open(os.path.join(path, "summary.json")) as f:
            lines = (json.load(f).get("profile_check") or {}).get("lines") or []
    except (OSError, ValueError):
        return
    for line in lines:
        print(f"profile check: {line}")


def _print_table(path: str) -> None:
    # deferred: numpy
    from pdlab.report.compare import compare, render

    try:
        render(compare([load_run(path)]))
    except Exception as e:  # noqa: BLE001 - the run directory is written; the table is a convenience
        print(f"note: could not render the summary table: {e}", file=sys.stderr)


def _simulate(recipe: object, workloads: dict, path: str) -> int:
    """The recipe in virtual time: the same run directory, every figure labelled simulated."""
    # deferred: numpy, torch
    from pdlab.measure.finish import finalize
    from pdlab.sim.band import forecast_band, lines as band_lines
    from pdlab.sim.experiment import simulate_recipe

    rd = RunDir(path)
    rd.write_recipe(recipe)
    env = collect_env()
    env.update(simulated=True)
    rd.write_env(env)
    result = simulate_recipe(recipe, workloads, progress=lambda v: print(f"{v}: simulated", flush=True))
    for kind in ("requests", "steps", "transfers"):
        rd.append(kind, getattr(result, kind))
    try:  # from the profiles' drift, where they have one; a convenience beside the forecast, never its loss
        band = forecast_band(result.recipe, result.slo, workloads)
    except Exception as e:  # noqa: BLE001 - the forecast's records are written; its summary must be too
        print(f"note: no forecast band: {e.__class__.__name__}: {e}", file=sys.stderr)
        band = None
    finalize(rd, result.slo, grid={v: result.recipe.rates for v in recipe.variant_names}, forecast_band=band,
             **result.facts)
    _print_table(path)
    for line in band_lines(band, result.recipe):
        print(line)
    print(path)
    return 0
