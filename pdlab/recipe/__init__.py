"""Recipes as typed, frozen dataclasses: parsed and checked in one place (see recipe.py for the format).

    recipe = load_recipe("recipes/long-input.yaml", sets=["engine.long_prefill_token_threshold=256"])
    v = recipe.resolved("disagg-push")      # Variant: model, engine, workload, rates, slo, deployment
    v.deployment.workers                     # (PlannedWorker(name, role, devices), ...)
"""

from pdlab.fields import RecipeError
from pdlab.recipe.deployment import Deployment, PlannedWorker, WorkerGroup
from pdlab.recipe.model import ModelSpec
from pdlab.recipe.recipe import (Recipe, Variant, apply_set, deep_merge, dump_recipe, is_saturation, load_recipe,
                                 parse_recipe)
from pdlab.recipe.slo import SLO
from pdlab.recipe.timing import StepTiming, TimingProfile, TransferTiming, load_profile
from pdlab.recipe.workload import ArrivalSpec, LengthSpec, SharedPrefix, WorkloadSpec

__all__ = ["Recipe", "RecipeError", "Variant", "ModelSpec", "StepTiming", "TimingProfile", "TransferTiming", "load_profile", "WorkloadSpec", "ArrivalSpec",
           "LengthSpec", "SharedPrefix", "SLO", "Deployment", "WorkerGroup", "PlannedWorker", "load_recipe",
           "parse_recipe", "apply_set", "deep_merge", "dump_recipe", "is_saturation"]
