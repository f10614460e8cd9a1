"""Recipes: YAML in, one validated, fully resolved `Variant` per variant out.

A recipe has a base (model, engine, workload, rates, slo, warmup, seed, optionally a deployment) and
named variants that deep-merge over the base. Variants may override `engine`, `model` and `deployment`
only: the workload, rate grid and SLO are shared, so every variant sees the same requests and is judged
by the same targets. `--set a.b=c` overrides edit the raw recipe (value parsed as YAML) before
validation, so `--set variants.disagg.deployment.mode=push` works as well as `--set engine.token_budget=512`.

Every problem is reported as one RecipeError naming the key and the expected form, and every variant is
resolved when the recipe is parsed: nothing starts on a bad recipe.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import yaml

from pdlab.constants import TRACE_RATE
from pdlab.engine.config import EngineConfig
from pdlab.fields import (RecipeError, Section, check_keys, did_you_mean, key_of, plain, section, spec, to_bool,
                          to_float, to_int, to_text)
from pdlab.recipe.backend import EngineBackend, check_external
from pdlab.recipe.deployment import DISAGG_ONLY, Deployment
from pdlab.recipe.expect import Expect
from pdlab.recipe.model import ModelSpec
from pdlab.recipe.slo import DEFAULT_ITL_MS, DEFAULT_TTFT_MS, SLO
from pdlab.recipe.workload import WorkloadSpec, trace_rates

VARIANT_KEYS = ("deployment", "engine", "model", "description")
TOP_KEYS = ("name", "description", "seed", "warmup", "model", "engine", "workload", "rates", "search", "repeats",
            "slo", "simulate", "expect", "deployment", "variants")
RATES_FORM = ("auto (goodput found by search) or a list of request rates > 0 (req/s), inf for all-at-once, "
              f"{TRACE_RATE} for a workload.trace at its own pace, or relative to this machine (0.5x: half the "
              "rate at which one worker serves one request after another, 1 / its TTFT alone), e.g. [1, 2, 4, .inf] "
              "or [0.2x, 0.5x, .inf]")
AUTO = "auto"


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
    """Deep merge, but a variant that names a shape (unified, prefill/decode, or endpoint) replaces the other
    shape, with the keys only that shape has."""
    if not over:
        return copy.deepcopy(base)
    if not isinstance(base, dict) or not isinstance(over, dict):
        return copy.deepcopy(over)
    base = copy.deepcopy(base)
    if "endpoint" in over:  # a running service: none of the base's workers or their keys apply
        base = {k: v for k, v in base.items() if k == "step_timeout_s"}
    elif any(k in over for k in ("unified", "prefill", "decode")):
        base.pop("endpoint", None)
    if "unified" in over:
        for k in (*DISAGG_ONLY, "kind"):
            base.pop(k, None)
    if "prefill" in over or "decode" in over:
        base.pop("unified", None)
        base.pop("kind", None)
    return deep_merge(base, over)


def apply_set(raw: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (`true`, `[cpu:0]`, `.inf`)."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected KEY=VALUE, e.g. engine.chunked_prefill=true")
    key, _, text = assignment.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise RecipeError(f"--set {assignment!r}: expected a dotted key like engine.long_prefill_token_threshold")
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


def relative_rate(r: Any) -> Optional[float]:
    """x of a rate written `<x>x` (a multiple of 1 / the TTFT of one request alone), else None."""
    if not isinstance(r, str) or not r.strip().lower().endswith("x"):
        return None
    try:
        x = float(r.strip()[:-1])
    except ValueError:
        return None
    return x if x > 0 and math.isfinite(x) else None


def resolve_rates(rates: Any, alone_ttft_ms: float) -> Any:
    """`rates` with each relative entry (`0.5x`) made a rate in req/s: x / the TTFT of one request alone."""
    if not isinstance(rates, tuple):
        return rates
    return tuple(relative_rate(r) * 1000.0 / alone_ttft_ms if relative_rate(r) is not None else r for r in rates)


def parse_rates(v: Any, where: str) -> Union[str, tuple[float, ...]]:
    if v == AUTO:
        return AUTO
    if not isinstance(v, list) or not v:
        raise RecipeError(f"{where}: expected {RATES_FORM}, got {v!r}")
    out: list[float] = []
    for i, r in enumerate(v):
        if isinstance(r, str) and r.strip().lower() in ("inf", "+inf", ".inf", "infinity"):
            r = math.inf
        if r == TRACE_RATE and TRACE_RATE not in out:  # resolved to a number by parse_recipe (trace_rates)
            out.append(TRACE_RATE)
            continue
        if isinstance(r, str) and (x := relative_rate(r)) is not None:  # resolved after the calibration
            tag = f"{x:g}x"
            if tag in out:
                raise RecipeError(f"{where}[{i}]: rate {tag} is listed twice")
            out.append(tag)
            continue
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or r <= 0:
            raise RecipeError(f"{where}[{i}]: expected a rate > 0 (req/s) or inf, got {v[i]!r}")
        if float(r) in out:
            raise RecipeError(f"{where}[{i}]: rate {r} is listed twice")
        out.append(float(r))
    return tuple(out)


@dataclass(frozen=True)
class SearchSpec(Section):
    """How `rates: auto` looks for goodput (pdlab.measure.search.RateSearch)."""

    max_trials: int = spec(6, "an integer >= 1 (rates measured per variant and repeat, saturation not counted)",
                           to_int(1))
    rel_tol: float = spec(0.15, "a fraction in (0, 1) (stop when the bracket is this narrow, relative)",
                          to_float(0.0, 0.999))
    start: float = spec(0.5, "a fraction in (0, 1] (first rate, of the saturation request rate)",
                        to_float(0.0, 1.0))


@dataclass(frozen=True, kw_only=True)
class Shared(Section):
    """What every variant of a recipe shares: the workload, the rates, the SLO, the seeds."""

    name: Optional[str] = spec(None, "a string")
    description: str = spec("", "a string", to_text)
    seed: int = spec(0, "an integer >= 0 (repeat i uses seed + i)", to_int(0))
    warmup: int = spec(2, "an integer >= 0 (requests per rate sent before measuring)", to_int(0))
    workload: WorkloadSpec = spec(WorkloadSpec(), parse=section(WorkloadSpec))
    rates: Union[str, tuple[float, ...]] = spec(expected=RATES_FORM, parse=parse_rates)
    search: SearchSpec = spec(SearchSpec(), parse=section(SearchSpec))
    repeats: int = spec(1, "an integer >= 1 (seeded repeats of every measurement, for confidence intervals)",
                        to_int(1))
    slo: SLO = spec(SLO(ttft_ms=DEFAULT_TTFT_MS, itl_ms=DEFAULT_ITL_MS), parse=section(SLO))
    # A recipe at GPU time scales (millisecond steps of many modelled devices) runs in virtual time by default:
    # timed worker processes on a small box cannot keep those deadlines (BENCHMARKS.md). --no-simulate overrides.
    simulate: bool = spec(False, "true or false (run in virtual time; every variant needs model.timing)", to_bool)
    # what the box the recipe was written for does (pdlab.recipe.expect): a run on another box says so
    expect: Expect = spec(Expect(), parse=section(Expect))


@dataclass(frozen=True)
class Variant:
    """One variant, fully resolved: everything a run of it needs."""

    recipe: str  # the recipe's name
    name: str  # the variant's name
    description: str
    seed: int
    warmup: int
    model: ModelSpec
    engine: EngineConfig
    workload: WorkloadSpec
    rates: Union[str, tuple[float, ...]]  # "auto" or the grid
    search: SearchSpec
    repeats: int
    slo: SLO
    deployment: Deployment
    backend: EngineBackend = EngineBackend()  # pdlab's engine, or an external server (pdlab.external)

    @property
    def auto(self) -> bool:
        """Goodput found by search (rates: auto) rather than on a grid."""
        return self.rates == AUTO

    def seeds(self) -> list[int]:
        """One seed per repeat; the same for every variant."""
        return [self.seed + i for i in range(self.repeats)]


@dataclass(frozen=True)
class Recipe:
    """A validated recipe: the shared part and its resolved variants, in recipe order."""

    name: str
    shared: Shared
    variants: dict[str, Variant] = field(default_factory=dict)

    @property
    def variant_names(self) -> list[str]:
        return list(self.variants)

    @property
    def seed(self) -> int:
        return self.shared.seed

    @property
    def rates(self) -> Union[str, list[float]]:
        return AUTO if self.shared.rates == AUTO else list(self.shared.rates)

    @property
    def slo(self) -> SLO:
        return self.shared.slo

    @property
    def relative_rates(self) -> list[str]:
        """The rates written relative to this machine (`0.5x`), resolved once one request alone is measured."""
        return [r for r in self.shared.rates if relative_rate(r) is not None] if isinstance(self.shared.rates,
                                                                                          tuple) else []

    def with_rates_for(self, alone_ttft_ms: float) -> "Recipe":
        """This recipe with its relative rates resolved against one request alone (pdlab.harness.calibrate):
        every variant gets the same absolute rates."""
        if not self.relative_rates:
            return self
        rates = resolve_rates(self.shared.rates, alone_ttft_ms)
        return replace(self, shared=self.shared.replace(rates=rates),
                       variants={n: replace(v, rates=rates) for n, v in self.variants.items()})

    def resolved(self, variant: str) -> Variant:
        if variant not in self.variants:
            raise RecipeError(f"unknown variant {variant!r}; the recipe has: {', '.join(self.variants)}")
        return self.variants[variant]

    def to_dict(self) -> dict:
        """The recipe as resolved, for `recipe.yaml`: the shared part with defaults, each variant's engine,
        model and deployment (with its kind) in full. Loading it back gives the same variants."""
        out = plain(self.shared.replace(name=self.name).to_raw())
        out["variants"] = {}
        for name, v in self.variants.items():
            entry = {"description": v.description} if v.description != self.shared.description else {}
            engine = v.engine.to_raw() | (v.backend.to_raw() if v.backend.external else {})
            entry.update(engine=engine, model=v.model.to_raw(), deployment=v.deployment.to_raw())
            out["variants"][name] = entry
        return out


def _resolve(raw: dict, shared: Shared, over: dict, name: str, recipe: str) -> Variant:
    where = f"variants.{name}"
    engine = deep_merge(raw.get("engine") or {}, over.get("engine") or {})
    base_model = raw.get("model")
    model = deep_merge(base_model if isinstance(base_model, dict) else {}, over.get("model") or {})
    if over.get("model") and ("preset" in over["model"] or "path" in over["model"]):
        # naming another model replaces the base's source, it does not add a second one
        model = {k: v for k, v in model.items() if k not in ("preset", "path") or k in over["model"]}
    if base_model is not None and not isinstance(base_model, dict):
        model = base_model  # not a mapping: let ModelSpec say so
    dep = _merge_deployment(raw.get("deployment"), over.get("deployment"))
    if not dep:
        raise RecipeError(f"{where}.deployment: missing; expected e.g. {{unified: {{devices: [cpu:0]}}}} "
                          "or {prefill: {devices: [cpu:0]}, decode: {devices: [cpu:1]}}")
    backend, engine = EngineBackend.split(engine, f"{where}.engine")
    engine_cfg = EngineConfig.from_raw(engine, f"{where}.engine")
    model_spec = ModelSpec.from_raw(model or None, f"{where}.model")
    deployment = Deployment.from_raw(dep, f"{where}.deployment")
    if model_spec.dtype is None:
        model_spec = model_spec.replace(dtype="bfloat16" if deployment.device_kind == "cuda" else "float32")
    check_external(backend, model_spec, deployment, where)
    return Variant(recipe=recipe, name=name, description=str(over.get("description", shared.description)),
                   seed=shared.seed, warmup=shared.warmup, model=model_spec, engine=engine_cfg,
                   workload=shared.workload, rates=shared.rates, search=shared.search, repeats=shared.repeats,
                   slo=shared.slo, deployment=deployment, backend=backend)


def parse_recipe(raw: Any, name: str = "recipe", sets: Optional[list[str]] = None,
                 variants: Optional[str | list[str]] = None) -> Recipe:
    """Validate a recipe dict (after applying `--set` overrides) and select variants (comma string or list)."""
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe: expected a YAML mapping at the top level, got {type(raw).__name__}")
    if not raw and not sets:
        raise RecipeError("recipe: empty; expected at least rates and a deployment (see recipes/ for examples)")
    raw = copy.deepcopy(raw)
    for s in sets or []:
        apply_set(raw, s)
    check_keys(raw, TOP_KEYS, "")
    shared = Shared.from_raw({k: v for k, v in raw.items() if k in Shared.keys()}, "")
    shared = shared.replace(rates=trace_rates(shared.workload, shared.rates, shared.seed))
    if shared.name is not None and not isinstance(shared.name, str):
        raise RecipeError(f"name: expected a string, got {shared.name!r}")
    recipe_name = str(shared.name or name)
    raw_variants = raw.get("variants")
    if raw_variants is None:
        raw_variants = {"default": {}}
    if not isinstance(raw_variants, dict) or not raw_variants:
        raise RecipeError("variants: expected a mapping of name -> overrides, e.g. {unified: {deployment: ...}}")
    overs: dict[str, dict] = {}
    for vname, over in raw_variants.items():
        over = over or {}
        if not isinstance(over, dict):
            raise RecipeError(f"variants.{vname}: expected a mapping of overrides, got {over!r}")
        for k in over:
            if k not in VARIANT_KEYS:
                raise RecipeError(
                    f"{key_of(f'variants.{vname}', k)}: a variant may override only {', '.join(VARIANT_KEYS)}"
                    + (did_you_mean(k, VARIANT_KEYS) or "; the workload, rates and SLO are shared so variants "
                                                        "stay comparable"))
        overs[str(vname)] = over
    if variants:
        wanted = [v.strip() for v in variants.split(",")] if isinstance(variants, str) else list(variants)
        wanted = [v for v in wanted if v]
        for v in wanted:
            if v not in overs:
                raise RecipeError(f"--variants: unknown variant {v!r}; the recipe has: {', '.join(overs)}")
        overs = {v: overs[v] for v in wanted}
    resolved = {v: _resolve(raw, shared, over, v, recipe_name) for v, over in overs.items()}
    return Recipe(name=recipe_name, shared=shared.replace(name=recipe_name), variants=resolved)


def load_recipe(path: str, sets: Optional[list[str]] = None, variants: Optional[str | list[str]] = None) -> Recipe:
    """Read, override, validate. Raises RecipeError (one line) for every user mistake."""
    if os.path.isdir(path):
        raise RecipeError(f"{path} is a directory; expected a recipe YAML file such as recipes/long-input.yaml")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot be read ({e.__class__.__name__})") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return parse_recipe(raw if raw is not None else {}, name=stem, sets=sets, variants=variants)


def dump_recipe(recipe: Recipe) -> str:
    """YAML text of `recipe.to_dict()` (inf rates come out as `.inf`)."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=None, width=110)


def is_saturation(rate: float) -> bool:
    return math.isinf(rate)
