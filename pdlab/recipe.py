"""Recipes: YAML in, one validated, fully resolved config per variant out.

A recipe has a base (model, engine, workload, rates, slo, warmup, seed, optionally a deployment) and
named variants that deep-merge over the base. Variants may override `engine`, `model` and `deployment`
only: the workload, rate grid and SLO are shared, so every variant sees the same requests and is judged
by the same targets. `--set a.b=c` overrides edit the raw recipe (value parsed as YAML) before
validation, so `--set variants.disagg.deployment.mode=push` works as well as `--set engine.chunk_size=256`.

Every problem is reported as one RecipeError naming the key and the expected form.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from pdlab.deployment import resolve_deployment
from pdlab.recipe_schema import SCHEMA, VARIANT_KEYS, RecipeError, check_section

__all__ = ["Recipe", "RecipeError", "load_recipe", "parse_recipe", "apply_set", "deep_merge"]


def deep_merge(base: dict, over: dict) -> dict:
    """A new dict: `over` merged into `base`, recursively for dicts; other values are replaced."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_deployment(base: Optional[dict], over: Optional[dict]) -> Optional[dict]:
    """Deep merge, but a variant that names a shape (unified, or prefill/decode) replaces the other shape."""
    if not over:
        return copy.deepcopy(base)
    if not base:
        return copy.deepcopy(over)
    base = copy.deepcopy(base)
    if "unified" in over:
        for k in ("prefill", "decode", "transport", "mode", "first_token", "transfer_timeout_s"):
            base.pop(k, None)
    if "prefill" in over or "decode" in over:
        base.pop("unified", None)
    return deep_merge(base, over)


def apply_set(raw: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (`true`, `[cpu:0]`, `.inf`)."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected KEY=VALUE, e.g. engine.chunked_prefill=true")
    key, _, text = assignment.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise RecipeError(f"--set {assignment!r}: expected a dotted key like engine.chunk_size")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {key}: value {text!r} is not valid YAML ({e.__class__.__name__})") from None
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping, cannot set a key in it")
        node = nxt
    node[parts[-1]] = value


@dataclass
class Recipe:
    """A validated recipe. `base` has defaults filled; `variants` maps name -> raw override dict."""

    name: str
    base: dict
    variants: dict[str, dict] = field(default_factory=dict)

    @property
    def variant_names(self) -> list[str]:
        return list(self.variants)

    @property
    def seed(self) -> int:
        return self.base["seed"]

    @property
    def rates(self) -> list[float]:
        return list(self.base["rates"])

    def resolved(self, variant: str) -> dict:
        """The fully resolved config of one variant as a plain dict.

        Keys: name, variant, seed, warmup, model, engine, workload, rates, slo, deployment; deployment has
        `kind` ("unified" | "disagg") and `workers`: [{name, role, devices: ["cpu:0", ...]}, ...].
        """
        if variant not in self.variants:
            raise RecipeError(f"unknown variant {variant!r}; the recipe has: {', '.join(self.variants)}")
        return _resolve(self.base, self.variants[variant], variant)

    def to_dict(self) -> dict:
        """The recipe as resolved, for `recipe.yaml`: base with defaults, each variant's engine/model/deployment
        filled in. Loading it back gives the same resolved configs."""
        out = {k: copy.deepcopy(v) for k, v in self.base.items() if k != "deployment"}
        out["variants"] = {}
        for name in self.variants:
            r = self.resolved(name)
            dep = {k: v for k, v in r["deployment"].items() if k not in ("kind", "workers")}
            out["variants"][name] = {"engine": r["engine"], "model": r["model"], "deployment": dep}
        return out


def _resolve(base: dict, over: dict, variant: str) -> dict:
    where = f"variants.{variant}"
    engine = deep_merge(base["engine"], over.get("engine") or {})
    model = deep_merge(base["model"], over.get("model") or {})
    if over.get("model") and ("preset" in over["model"] or "path" in over["model"]):
        # naming another model replaces the base's source, it does not add a second one
        model = {k: v for k, v in model.items() if k not in ("preset", "path") or k in over["model"]}
    dep = _merge_deployment(base.get("deployment"), over.get("deployment"))
    if not dep:
        raise RecipeError(f"{where}.deployment: missing; expected e.g. {{unified: {{devices: [cpu:0]}}}} "
                          "or {prefill: {devices: [cpu:0]}, decode: {devices: [cpu:1]}}")
    engine = check_section("engine", engine, SCHEMA["engine"], where=f"{where}.engine")
    model = check_section("model", model, SCHEMA["model"], where=f"{where}.model")
    if engine["chunked_prefill"] and engine["chunk_size"] > engine["token_budget"]:
        raise RecipeError(f"{where}.engine.chunk_size ({engine['chunk_size']}) must be <= engine.token_budget "
                          f"({engine['token_budget']}) when chunked_prefill is true")
    deployment = resolve_deployment(dep, f"{where}.deployment")
    if model.get("dtype") is None:
        model["dtype"] = "bfloat16" if deployment["workers"][0]["devices"][0].startswith("cuda") else "float32"
    out = {k: copy.deepcopy(v) for k, v in base.items() if k != "deployment"}
    out.update(variant=variant, engine=engine, model=model, deployment=deployment)
    return out


def parse_recipe(raw: Any, name: str = "recipe", sets: Optional[list[str]] = None,
                 variants: Optional[str | list[str]] = None) -> Recipe:
    """Validate a recipe dict (after applying `--set` overrides) and select variants (comma string or list)."""
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe: expected a YAML mapping at the top level, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    for s in sets or []:
        apply_set(raw, s)
    raw_variants = raw.pop("variants", None)
    base = check_section("", raw, SCHEMA, where="")
    base["name"] = base.get("name") or name
    if raw_variants is None:
        raw_variants = {"default": {}}
    if not isinstance(raw_variants, dict) or not raw_variants:
        raise RecipeError("variants: expected a mapping of name -> overrides, e.g. {unified: {deployment: ...}}")
    vs: dict[str, dict] = {}
    for vname, over in raw_variants.items():
        over = over or {}
        if not isinstance(over, dict):
            raise RecipeError(f"variants.{vname}: expected a mapping of overrides, got {over!r}")
        for k in over:
            if k not in VARIANT_KEYS:
                hint = difflib.get_close_matches(str(k), VARIANT_KEYS, n=1)
                raise RecipeError(
                    f"variants.{vname}.{k}: a variant may override only {', '.join(VARIANT_KEYS)}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else
                       "; the workload, rates and SLO are shared so variants stay comparable"))
        vs[str(vname)] = over
    if variants:
        wanted = [v.strip() for v in variants.split(",")] if isinstance(variants, str) else list(variants)
        wanted = [v for v in wanted if v]
        for v in wanted:
            if v not in vs:
                raise RecipeError(f"--variants: unknown variant {v!r}; the recipe has: {', '.join(vs)}")
        vs = {v: vs[v] for v in wanted}
    recipe = Recipe(name=str(base["name"]), base=base, variants=vs)
    for v in recipe.variants:  # validate every selected variant now: nothing starts on a bad recipe
        recipe.resolved(v)
    return recipe


def load_recipe(path: str, sets: Optional[list[str]] = None, variants: Optional[str | list[str]] = None) -> Recipe:
    """Read, override, validate. Raises RecipeError (one line) for every user mistake."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return parse_recipe(raw if raw is not None else {}, name=stem, sets=sets, variants=variants)


def dump_recipe(recipe: Recipe) -> str:
    """YAML text of `recipe.to_dict()` (inf rates come out as `.inf`)."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=None, width=110)


def is_saturation(rate: float) -> bool:
    return math.isinf(rate)
