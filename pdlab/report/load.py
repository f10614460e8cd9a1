"""A run directory as the report layer reads it: records and summary (pdlab.measure.records), the recipe
parsed once with `parse_recipe` into typed variants, and the summary made whole.

The summary is read as summarize_run writes it. What an older or cut-short run lacks is filled here, in one
place: top-level keys from SUMMARY_DEFAULTS, and a summary without results (the run stopped before writing
one) is recomputed from the records and marked partial. A recipe.yaml that does not parse on this machine
(a model directory or the NIXL extra that only the measuring machine has) leaves the rows without their
configuration and says why in the warnings; the numbers stand.

`pdlab plan` writes plan.json beside its validation run (DIR/plan.json, DIR/run): a run inside such a
directory carries the plan, so a later compare can say what was ranked.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from pdlab.fields import RecipeError
from pdlab.measure.records import Run, load_run
from pdlab.measure.summary import run_info, summarize_run
from pdlab.recipe import SLO, Recipe, Variant, parse_recipe

# what a summary written by an older pdlab, or cut short, lacks at the top level
SUMMARY_DEFAULTS = {"schema_version": 1, "run": None, "box": None, "definitions": {}, "slo": None, "relative": None,
                    "alone": None, "alone_by_variant": {}, "repeats": 0, "partial": False, "reason": None,
                    "warnings": [], "modelled": {}, "variants": {}, "kernels": {},
                    "rates_resolved": {}, "trace": None}
NO_SUMMARY = "no summary was written (the run was killed, or is still going): recomputed from the records"


@dataclass(frozen=True)
class RunFacts:
    """What ran: shown in compare's header, the HTML report and --json (`runs`)."""

    name: str
    path: str
    recipe: Optional[str]
    started: Optional[str]
    ended: Optional[str]
    schema_version: int
    cpu_model: Optional[str]
    simulated: bool
    partial: bool
    reason: Optional[str]

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class LoadedRun:
    run: Run
    recipe: Optional[Recipe]
    recipe_error: Optional[str]  # why recipe.yaml did not parse here
    summary: dict
    plan: Optional[dict]  # plan.json of the `pdlab plan` that ran this validation run

    @property
    def name(self) -> str:
        return self.run.name

    def variant(self, name: str) -> Optional[Variant]:
        return self.recipe.variants.get(name) if self.recipe else None

    @property
    def facts(self) -> RunFacts:
        s = self.summary
        info = s["run"] or run_info(self.run)  # older summaries: from env.json and recipe.yaml
        return RunFacts(self.name, self.run.path, info["recipe"], info["started"], info["ended"],
                        int(s["schema_version"]), info["cpu_model"], bool(info["simulated"]),
                        bool(s["partial"]), s["reason"])


def _recipe(run: Run) -> tuple[Optional[Recipe], Optional[str]]:
    if not run.recipe:
        return None, "no recipe.yaml"
    try:
        return parse_recipe(run.recipe, name=run.name), None
    except RecipeError as e:
        return None, f"its recipe.yaml does not load here ({e})"


def _summary(run: Run, recipe: Optional[Recipe]) -> dict:
    s = {**SUMMARY_DEFAULTS, **run.summary}
    if any("goodput" in vs for vs in s["variants"].values()):
        return s
    raw = s["slo"]
    slo = SLO.from_raw({k: v for k, v in raw.items() if k in SLO.keys()}, "slo") if raw else (
        recipe.slo if recipe and not recipe.slo.relative else None)
    if slo is None or not run.requests:
        return {**s, "partial": True, "reason": s["reason"] or NO_SUMMARY}
    names = recipe.variant_names if recipe else None
    again = summarize_run(run.requests, run.steps, run.transfers, slo, partial=True,
                          grid={v: recipe.variants[v].rates for v in names} if names else None,
                          reason=s["reason"] or NO_SUMMARY)
    return {**s, **again, "run": s["run"], "warnings": s["warnings"] + again["warnings"]}


def _plan(path: str) -> Optional[dict]:
    """plan.json of the `pdlab plan` whose validation run this is (DIR/run -> DIR/plan.json)."""
    p = os.path.join(os.path.dirname(os.path.normpath(path)), "plan.json")
    if os.path.basename(os.path.normpath(path)) != "run" or not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def from_run(run: Run) -> LoadedRun:
    recipe, error = _recipe(run)
    return LoadedRun(run, recipe, error, _summary(run, recipe), _plan(run.path))


def load(path: str) -> LoadedRun:
    """Read and complete one run directory (RunDirError when it is not one)."""
    return from_run(load_run(path))
