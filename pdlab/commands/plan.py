"""`pdlab plan RECIPE --devices N`: rank deployments for a device budget by simulated goodput, then run the
best for real and print predicted against measured. DIR/plan.json keeps the whole ranking (and the validation),
DIR/planned.yaml the recipe of the validated candidates, DIR/run their run."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

import yaml

from pdlab.commands.run import main as run_main
from pdlab.engine.model import ModelLoadError
from pdlab.measure.confidence import Estimate, format_estimate
from pdlab.measure.records import atomic_write, dumps, load_run


def _err(msg: str) -> int:
    print(f"pdlab plan: error: {msg}", file=sys.stderr)
    return 2


def main(recipe_path: str, sets: list[str], devices: int, modes: str, validate: int, out: Optional[str],
         json_: bool) -> int:
    # deferred: numpy, torch
    from pdlab.recipe import RecipeError, dump_recipe, load_recipe, parse_recipe
    from pdlab.sim.plan import plan, relative_error
    from pdlab.workload import WorkloadError, build_workload

    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    if devices < 2:
        return _err(f"--devices {devices}: a budget needs at least 2 devices (1 prefill + 1 decode)")
    if not mode_list or any(m not in ("pull", "push") for m in mode_list):
        return _err(f"--modes {modes!r}: expected pull, push or pull,push")
    try:
        recipe = load_recipe(recipe_path, sets)
        ranked, slo = plan(recipe, devices, lambda r: {n: build_workload(v) for n, v in r.variants.items()}, mode_list,
                           progress=None if json_ else lambda v: print(f"  simulated {v}", flush=True))
    except (RecipeError, ModelLoadError, WorkloadError, ValueError) as e:
        return _err(str(e))
    base = recipe.resolved(recipe.variant_names[0])
    result = {"recipe": recipe.name, "devices": devices, "modelled": f"simulated; {base.model.timing.describe()}",
              "slo": slo.to_raw(), "ranking": [{"candidate": r.candidate.name, "devices": r.candidate.devices,
                                                "goodput": r.goodput, "goodput_per_device": r.per_device,
                                                "closed_form": r.closed_form} for r in ranked], "validation": []}
    path = out or os.path.join("runs", f"{recipe.name}-plan-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return _err(f"--out {path}: cannot create it ({e.strerror})")
    # the whole ranking, beside the validation run (DIR/run): a later pdlab compare of it says what was ranked
    atomic_write(os.path.join(path, "plan.json"), dumps(result, indent=2))
    print(f"wrote {os.path.join(path, 'plan.json')}", file=sys.stderr if json_ else sys.stdout)
    if validate > 0:
        top = ranked[:validate]
        raw = yaml.safe_load(dump_recipe(recipe))
        first = next(iter(raw["variants"].values()))
        raw["variants"] = {r.candidate.name: {"engine": first["engine"], "model": first["model"],
                                              "deployment": r.candidate.deployment} for r in top}
        raw["name"] = f"{recipe.name}-plan"
        planned = os.path.join(path, "planned.yaml")
        with open(planned, "w") as f:
            f.write(dump_recipe(parse_recipe(raw)))

        with contextlib.redirect_stdout(sys.stderr if json_ else sys.stdout):  # --json: stdout is the JSON
            code = run_main(planned, [], os.path.join(path, "run"), None)
        if code != 0:
            return code
        summary = load_run(os.path.join(path, "run"), records=False).summary
        measured = summary["variants"]
        for r in top:
            m = measured[r.candidate.name]["goodput"]
            result["validation"].append({"candidate": r.candidate.name, "predicted": r.goodput["mean"],
                                         "measured": m["mean"], "measured_interval": [m["lo"], m["hi"]],
                                         "relative_error": relative_error(r.goodput["mean"], m["mean"]),
                                         "profile_check": profile_check(summary, r.candidate.name, base)})
        atomic_write(os.path.join(path, "plan.json"), dumps(result, indent=2))  # with what validation measured
    if json_:
        print(dumps(result, indent=2))
    else:
        render(result)
    return 0


def profile_check(summary: dict, name: str, variant: object) -> dict:
    """Beside a validation row, how far the profile's step model is from steps: `steps_mape_pct`, the worst
    kind's MAPE of the validation run's own steps against it (pdlab.timing.check: timed workers keeping the
    model), and `fit_mape_pct`, the profile's held-out MAPE against the hardware it was measured on (a
    measured profile's `fit`)."""
    # deferred: torch
    from pdlab.timing.check import worst_mape

    c = ((summary.get("profile_check") or {}).get("variants") or {}).get(name)
    fit = variant.model.timing.fit or {}
    return {"steps_mape_pct": worst_mape(c) if c else None,
            "kinds": {k: e["mape_pct"] for k, e in c["kinds"].items() if e.get("steps")} if c else {},
            "fit_mape_pct": (fit.get("held_out") or {}).get("mape_pct")}


def _check_cell(c: Optional[dict]) -> str:
    if not c:
        return "—"
    parts = []
    if c.get("steps_mape_pct") is not None:
        parts.append(f"steps {c['steps_mape_pct']:.0f}%")
    if c.get("fit_mape_pct") is not None:
        parts.append(f"fit {c['fit_mape_pct']:.0f}%")
    return ", ".join(parts) or "—"


def render(result: dict) -> None:
    # deferred: rich
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 100)
    console.print(f"[bold]MODELLED[/bold] {result['modelled']}: goodput predicted in virtual time, "
                  "not measured on this machine")
    t = Table(title=f"deployments for {result['devices']} devices, ranked by simulated goodput (req/s)",
              title_justify="left")
    for c in ("#", "deployment", "goodput", "per device", "closed form", "closed vs sim."):
        t.add_column(c, justify="left" if c == "deployment" else "right")
    for i, r in enumerate(result["ranking"], 1):
        g = r["goodput"]
        est = Estimate(g["mean"], g["lo"], g["hi"], g["n"], tuple(g["values"]))
        cell = ("≥ " if g.get("open_above") else "") + format_estimate(est) + (" sat" if g.get("capped") else "")
        cf = r["closed_form"]
        err = None if cf is None or not g["mean"] else (cf - g["mean"]) / g["mean"]
        t.add_row(str(i), r["candidate"], cell, "—" if r["goodput_per_device"] is None else
                  f"{r['goodput_per_device']:.2f}", "—" if cf is None else f"{cf:.2f}",
                  "—" if err is None else f"{err * 100:+.0f}%")
    console.print(t)
    if result["validation"]:
        v = Table(title="predicted (simulated) against measured (worker processes, the same timing profile)",
                  title_justify="left")
        for c in ("deployment", "predicted", "measured", "error", "profile error (MAPE)"):
            v.add_column(c, justify="left" if c == "deployment" else "right")
        for r in result["validation"]:
            lo, hi = r["measured_interval"]
            meas = "—" if r["measured"] is None else (f"{r['measured']:.2f}" + (
                f" ± {(hi - lo) / 2:.2f}" if lo is not None else ""))
            v.add_row(r["candidate"], "—" if r["predicted"] is None else f"{r['predicted']:.2f}", meas,
                      "—" if r["relative_error"] is None else f"{r['relative_error'] * 100:+.0f}%",
                      _check_cell(r.get("profile_check")))
        console.print(v)
        console.print("profile error: the validation run's steps against the profile (steps: the worst kind's "
                      "MAPE; pdlab profile --check) and the profile's own held-out fit on the machine it measured "
                      "(fit)")
