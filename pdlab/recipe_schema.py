"""The recipe schema: keys, defaults and types, with one-line errors (deployments: pdlab/deployment.py).

Each leaf is a Field (default, expected form, converter). A converter returns the normalized value or
raises ValueError; check_section turns that into a RecipeError naming the full key and expected form.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable


REQUIRED = object()
VARIANT_KEYS = ["deployment", "engine", "model", "description"]
TRANSPORTS = ["shm", "cuda-ipc", "host", "nixl"]
DTYPES = ["float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto"]


class RecipeError(ValueError):
    """A user mistake in a recipe or an override: one line, naming the key and the expected form."""


@dataclass
class Field:
    default: Any
    expected: str
    conv: Callable[[Any], Any]


def _key(where: str, k: str) -> str:
    return f"{where}.{k}" if where else str(k)


def _int(lo: int = 0) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError
        return v
    return conv


def _float(lo: float = 0.0, hi: float = math.inf, lo_open: bool = True) -> Callable[[Any], float]:
    def conv(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise ValueError
        return float(v)
    return conv


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError
    return v


def _choice(*opts: str) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        if v not in opts:
            raise ValueError
        return v
    return conv


def _opt(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else conv(v)


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError
    return v


def _kv_blocks(v: Any) -> Any:
    return v if v == "auto" else _int(1)(v)


def _any(v: Any) -> Any:
    return v


def check_section(name: str, value: Any, schema: Any, where: str) -> Any:
    """Validate `value` against `schema` (a dict of Fields/sub-schemas, or a function) and fill defaults."""
    if callable(schema):
        return schema(value, where)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping with keys {', '.join(schema)}, got {value!r}")
    for k in value:
        if k not in schema:
            hint = difflib.get_close_matches(str(k), list(schema), n=1)
            raise RecipeError(f"{_key(where, k)}: unknown key"
                              + (f" (did you mean {hint[0]!r}?)" if hint else f"; expected one of {', '.join(schema)}"))
    out: dict[str, Any] = {}
    for k, spec in schema.items():
        key = _key(where, k)
        if isinstance(spec, Field):
            if k not in value:
                if spec.default is REQUIRED:
                    raise RecipeError(f"{key}: missing; expected {spec.expected}")
                out[k] = spec.default
                continue
            try:
                out[k] = spec.conv(value[k])
            except (ValueError, TypeError):
                raise RecipeError(f"{key}: expected {spec.expected}, got {value[k]!r}") from None
        else:
            out[k] = check_section(k, value.get(k), spec, key)
    return out


def _length(default: dict) -> Callable[[Any, str], dict]:
    forms = "{kind: fixed, value: N}, {kind: uniform, min: A, max: B} or {kind: dataset}"

    def check(v: Any, where: str) -> dict:
        v = dict(default) if v is None else v
        if not isinstance(v, dict) or v.get("kind") not in ("fixed", "uniform", "dataset"):
            raise RecipeError(f"{where}: expected {forms}, got {v!r}")
        need = {"fixed": ["value"], "uniform": ["min", "max"], "dataset": []}[v["kind"]]
        for k in v:
            if k != "kind" and k not in need:
                raise RecipeError(f"{where}.{k}: not used by kind {v['kind']}; expected {forms}")
        out = {"kind": v["kind"]}
        for k in need:
            if k not in v:
                raise RecipeError(f"{where}.{k}: missing for kind {v['kind']}; expected {forms}")
            try:
                out[k] = _int(1)(v[k])
            except ValueError:
                raise RecipeError(f"{where}.{k}: expected an integer >= 1 (tokens), got {v[k]!r}") from None
        if v["kind"] == "uniform" and out["min"] > out["max"]:
            raise RecipeError(f"{where}: min ({out['min']}) must be <= max ({out['max']})")
        return out
    return check


def _arrival(v: Any, where: str) -> dict:
    v = {"kind": "poisson"} if v is None else v
    kinds = ("poisson", "gamma", "constant", "burst")
    if not isinstance(v, dict) or v.get("kind") not in kinds:
        raise RecipeError(f"{where}: expected {{kind: poisson|gamma|constant|burst}}, got {v!r}")
    extra = {"gamma": {"burstiness": (1.0, _float(0.0), "a number > 0 (1 = poisson, < 1 burstier)")},
             "burst": {"size": (8, _int(1), "an integer >= 1 (requests per burst)")}}.get(v["kind"], {})
    out = {"kind": v["kind"]}
    for k in v:
        if k != "kind" and k not in extra:
            raise RecipeError(f"{where}.{k}: not used by arrival kind {v['kind']}")
    for k, (default, conv, expected) in extra.items():
        try:
            out[k] = conv(v.get(k, default))
        except ValueError:
            raise RecipeError(f"{where}.{k}: expected {expected}, got {v[k]!r}") from None
    return out


def _rates(v: Any, where: str) -> list[float]:
    form = "a list of request rates > 0 (req/s), inf for all-at-once, e.g. [1, 2, 4, .inf]"
    if not isinstance(v, list) or not v:
        raise RecipeError(f"{where}: expected {form}, got {v!r}")
    out: list[float] = []
    for i, r in enumerate(v):
        if isinstance(r, str) and r.strip().lower() in ("inf", "+inf", ".inf", "infinity"):
            r = math.inf
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or r <= 0:
            raise RecipeError(f"{where}[{i}]: expected a rate > 0 (req/s) or inf, got {v[i]!r}")
        if float(r) in out:
            raise RecipeError(f"{where}[{i}]: rate {r} is listed twice")
        out.append(float(r))
    return out


def _model(v: Any, where: str) -> dict:
    try:  # the engine package owns the preset list; its import pulls in torch, so only here
        from pdlab.engine.model import PRESETS
    except ImportError:  # engine not importable (partial checkout): leave the name to the loader
        PRESETS = None
    form = "{preset: NAME} or {path: DIR, dtype: bfloat16}"
    v = {"preset": "cpu-demo"} if v is None else v
    out = check_section("model", v, MODEL_SCHEMA, where)
    if (out["preset"] is None) == (out["path"] is None):
        raise RecipeError(f"{where}: give exactly one of preset or path; expected {form}")
    if out["preset"] is not None and PRESETS is not None and out["preset"] not in PRESETS:
        hint = difflib.get_close_matches(out["preset"], list(PRESETS), n=1)
        raise RecipeError(f"{where}.preset: unknown preset {out['preset']!r}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else f"; known: {', '.join(sorted(PRESETS))}"))
    if out["path"] is not None and out["path"].startswith(("/", ".", "~")) \
            and not os.path.isdir(os.path.expanduser(out["path"])):
        raise RecipeError(f"{where}.path: {out['path']} is not a directory")
    if out["dtype"] is not None and str(out["dtype"]).lower() not in DTYPES:
        raise RecipeError(f"{where}.dtype: expected one of float32, bfloat16, float16, auto, got {out['dtype']!r}")
    return out


def _workload(v: Any, where: str) -> dict:
    out = check_section("workload", v, WORKLOAD_SCHEMA, where)
    ds, inl, outl, sp = out["dataset"], out["input_len"], out["output_len"], out["shared_prefix"]
    if ds is not None and not os.path.isfile(ds):
        raise RecipeError(f"{where}.dataset: file not found: {ds} (expected a JSONL file)")
    if (inl["kind"] == "dataset") != (ds is not None):
        raise RecipeError(f"{where}.input_len: kind dataset and workload.dataset go together "
                          "(prompts come from the dataset file)")
    if outl["kind"] == "dataset" and ds is None:
        raise RecipeError(f"{where}.output_len: kind dataset needs workload.dataset (a JSONL path)")
    if sp is not None and inl["kind"] != "dataset":
        shortest = inl["value"] if inl["kind"] == "fixed" else inl["min"]
        if sp["len"] >= shortest:
            raise RecipeError(f"{where}.shared_prefix.len ({sp['len']}) must be < the shortest input_len "
                              f"({shortest}): the prefix is part of the prompt")
    if out["token_high"] is not None and out["token_high"] <= out["token_low"]:
        raise RecipeError(f"{where}.token_high ({out['token_high']}) must be > token_low ({out['token_low']})")
    return out


MODEL_SCHEMA = {
    "preset": Field(None, "a preset name such as cpu-demo", _opt(_str)),
    "path": Field(None, "a local model directory or an id in the local HF cache", _opt(_str)),
    "dtype": Field(None, "float32, bfloat16, float16 or auto (default: float32 on cpu, bfloat16 on cuda)", _opt(_str)),
    "device": Field(None, "a device string; workers use their deployment devices", _opt(_str)),
    "seed": Field(0, "an integer >= 0 (weights seed of a preset)", _int(0)),
}

WORKLOAD_SCHEMA = {
    "requests": Field(60, "an integer >= 1 (requests per rate)", _int(1)),
    "arrival": _arrival,
    "input_len": _length({"kind": "uniform", "min": 1500, "max": 2000}),
    "output_len": _length({"kind": "fixed", "value": 200}),
    "shared_prefix": Field(None, "null or {groups: N, len: TOKENS, share: 0..1}", _any),
    "dataset": Field(None, "null or a JSONL path (lines with prompt_ids or prompt, optional output_len)", _opt(_str)),
    "token_low": Field(10, "an integer >= 0 (lowest random token id; skips special ids)", _int(0)),
    "token_high": Field(None, "null (the model's vocab size) or an integer", _opt(_int(1))),
}

SHARED_PREFIX_SCHEMA = {
    "groups": Field(REQUIRED, "an integer >= 1 (distinct prefixes)", _int(1)),
    "len": Field(REQUIRED, "an integer >= 1 (prefix tokens)", _int(1)),
    "share": Field(1.0, "a fraction in [0, 1] of requests that carry a prefix", _float(0.0, 1.0, lo_open=False)),
}

SCHEMA: dict[str, Any] = {
    "name": Field(None, "a string", _opt(_str)),
    "description": Field("", "a string", _text),
    "seed": Field(0, "an integer >= 0", _int(0)),
    "warmup": Field(2, "an integer >= 0 (requests per rate sent before measuring)", _int(0)),
    "model": _model,
    "engine": {
        "block_size": Field(16, "an integer >= 1 (tokens per KV block)", _int(1)),
        "kv_blocks": Field("auto", "auto or an integer >= 1", _kv_blocks),
        "token_budget": Field(2048, "an integer >= 1 (tokens per step)", _int(1)),
        "chunked_prefill": Field(False, "true or false", _bool),
        "chunk_size": Field(512, "an integer >= 1 (tokens per prefill chunk)", _int(1)),
        "prefix_caching": Field(True, "true or false", _bool),
        "max_running": Field(64, "an integer >= 1 (sequences per step)", _int(1)),
        "max_model_len": Field(None, "null or an integer >= 1", _opt(_int(1))),
        "kv_memory_fraction": Field(0.5, "a fraction in (0, 1]", _float(0.0, 1.0)),
    },
    "workload": _workload,
    "rates": _rates,
    "slo": {
        "ttft_ms": Field(1000.0, "a number > 0 (milliseconds)", _float(0.0)),
        "itl_ms": Field(50.0, "a number > 0 (milliseconds)", _float(0.0)),
        "itl_stat": Field("p99", "one of mean, p50, p90, p99, max", _choice("mean", "p50", "p90", "p99", "max")),
        "attainment": Field(0.9, "a fraction in (0, 1]", _float(0.0, 1.0)),
    },
    "deployment": Field(None, "a deployment mapping", _any),
}


def _check_shared_prefix(v: Any, where: str) -> Any:
    return None if v is None else check_section("shared_prefix", v, SHARED_PREFIX_SCHEMA, where)


WORKLOAD_SCHEMA["shared_prefix"] = _check_shared_prefix
