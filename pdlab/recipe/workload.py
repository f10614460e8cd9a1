"""The recipe's `workload` section: how many requests, when they arrive, how long they are; or a production
trace that says all three (`trace`, pdlab.traces)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import ARRIVAL_KINDS, LENGTH_KINDS, TRACE_FORMATS, TRACE_RATE
from pdlab.fields import (RecipeError, Section, as_mapping, choices, key_of, one_of, optional, section, spec,
                          to_bool, to_float, to_int, to_str)
from pdlab.traces import TraceError
from pdlab.traces.replay import replay_for

LENGTH_FORMS = ("{kind: fixed, value: N}, {kind: uniform, min: A, max: B}, {kind: dataset} or {kind: mixture, "
                "parts: [{weight: W, kind: uniform, min: A, max: B}, ...]}")
_LENGTH_KEYS = {"fixed": ("value",), "uniform": ("min", "max"), "dataset": (), "mixture": ("parts",)}
_PART_KINDS = ("fixed", "uniform")


def _parts(v: Any, where: str) -> tuple:
    """A mixture's parts: [(weight, LengthSpec)], each a fixed or uniform length with a weight > 0."""
    if not isinstance(v, list) or not v:
        raise RecipeError(f"{where}: expected a list of {{weight: W, kind: fixed|uniform, ...}}, got {v!r}")
    out = []
    for i, part in enumerate(v):
        key = f"{where}[{i}]"
        if not isinstance(part, dict) or part.get("kind") not in _PART_KINDS:
            raise RecipeError(f"{key}: expected {{weight: W, kind: fixed|uniform, ...}}, got {part!r}")
        rest = {k: x for k, x in part.items() if k != "weight"}
        try:
            weight = to_float(0.0)(part.get("weight", 1.0))
        except (ValueError, TypeError):
            raise RecipeError(f"{key}.weight: expected a number > 0, got {part.get('weight')!r}") from None
        out.append((weight, LengthSpec.from_raw(rest, key)))
    return tuple(out)
# arrival kind -> its own keys: (field, expected)
_ARRIVAL_KEYS = {"gamma": {"burstiness": "a number > 0 (1 = poisson, < 1 burstier)"},
                 "burst": {"size": "an integer >= 1 (requests per burst)"}}


@dataclass(frozen=True)
class LengthSpec(Section):
    """A token count per request: fixed, uniform in [min, max], or taken from the dataset."""

    kind: str = spec("fixed", LENGTH_FORMS)
    value: Optional[int] = spec(None, "an integer >= 1 (tokens)", to_int(1))
    min: Optional[int] = spec(None, "an integer >= 1 (tokens)", to_int(1))
    max: Optional[int] = spec(None, "an integer >= 1 (tokens)", to_int(1))
    parts: tuple = spec((), parse=_parts)  # mixture: ((weight, LengthSpec), ...), drawn by weight

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "LengthSpec":
        if not isinstance(raw, dict) or raw.get("kind") not in LENGTH_KINDS:
            raise RecipeError(f"{where}: expected {LENGTH_FORMS}, got {raw!r}")
        need = _LENGTH_KEYS[raw["kind"]]
        for k in raw:
            if k != "kind" and k not in need:
                raise RecipeError(f"{where}.{k}: not used by kind {raw['kind']}; expected {LENGTH_FORMS}")
        for k in need:
            if k not in raw:
                raise RecipeError(f"{where}.{k}: missing for kind {raw['kind']}; expected {LENGTH_FORMS}")
        return super().from_raw(raw, where)

    def check(self, where: str) -> None:
        if self.kind == "uniform" and self.min > self.max:
            raise RecipeError(f"{where}: min ({self.min}) must be <= max ({self.max})")

    def to_raw(self) -> dict:
        if self.kind == "mixture":
            return {"kind": self.kind, "parts": [{"weight": w, **p.to_raw()} for w, p in self.parts]}
        return {"kind": self.kind, **{k: getattr(self, k) for k in _LENGTH_KEYS[self.kind]}}

    @property
    def shortest(self) -> Optional[int]:
        if self.kind == "mixture":
            return min(p.shortest for _, p in self.parts)
        return {"fixed": self.value, "uniform": self.min}.get(self.kind)

    @property
    def mean(self) -> Optional[float]:
        """The expected length (None for dataset lengths)."""
        if self.kind == "mixture":
            total = sum(w for w, _ in self.parts)
            return sum(w * p.mean for w, p in self.parts) / total
        if self.kind == "uniform":
            return (self.min + self.max) / 2
        return self.value if self.kind == "fixed" else None


@dataclass(frozen=True)
class ArrivalSpec(Section):
    """When requests arrive: the mean gap is 1/rate for every kind."""

    kind: str = spec("poisson", f"{{kind: {'|'.join(ARRIVAL_KINDS)}}}")
    burstiness: float = spec(1.0, _ARRIVAL_KEYS["gamma"]["burstiness"], to_float(0.0))  # gamma shape
    size: int = spec(8, _ARRIVAL_KEYS["burst"]["size"], to_int(1))  # burst: requests per burst
    # scale the drawn gaps so the realised mean rate equals the nominal one, as `vllm bench serve` does
    rescale: bool = spec(True, "true or false (scale gaps so the realised mean rate is the nominal rate)", to_bool)

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "ArrivalSpec":
        raw = {"kind": "poisson"} if raw is None else raw
        if not isinstance(raw, dict) or raw.get("kind") not in ARRIVAL_KINDS:
            raise RecipeError(f"{where}: expected {{kind: {'|'.join(ARRIVAL_KINDS)}}}, got {raw!r}")
        own = _ARRIVAL_KEYS.get(raw["kind"], {})
        for k in raw:
            if k not in ("kind", "rescale") and k not in own:
                raise RecipeError(f"{where}.{k}: not used by arrival kind {raw['kind']}")
        return super().from_raw(raw, where)

    def to_raw(self) -> dict:
        return {"kind": self.kind, **{k: getattr(self, k) for k in _ARRIVAL_KEYS.get(self.kind, {})},
                "rescale": self.rescale}


@dataclass(frozen=True)
class SharedPrefix(Section):
    groups: int = spec(expected="an integer >= 1 (distinct prefixes)", conv=to_int(1))
    len: int = spec(expected="an integer >= 1 (prefix tokens)", conv=to_int(1))
    share: float = spec(1.0, "a fraction in [0, 1] of requests that carry a prefix", to_float(0.0, 1.0, lo_open=False))


@dataclass(frozen=True)
class TraceSpec(Section):
    """A production trace as the workload (pdlab.traces.replay has the order the keys apply in)."""

    format: str = spec(expected=choices(TRACE_FORMATS), conv=one_of(TRACE_FORMATS))
    path: str = spec(expected="the trace file's path", conv=to_str)
    time_scale: float = spec(1.0, "a number > 0 (multiplies the gaps between arrivals; 0.5: twice as fast)",
                             to_float(0.0))
    start_s: float = spec(0.0, "a number >= 0 (seconds into the trace, on its own clock)",
                          to_float(0.0, lo_open=False))
    duration_s: Optional[float] = spec(None, "null or a number > 0 (seconds of the trace from start_s)",
                                       optional(to_float(0.0)))
    sample: float = spec(1.0, "a fraction in (0, 1] (of the window's requests, chosen by the recipe's seed)",
                         to_float(0.0, 1.0))
    limit: Optional[int] = spec(None, "null or an integer >= 1 (the first N requests of the window)",
                                optional(to_int(1)))
    length_scale: float = spec(1.0, "a number in (0, 1] (shrinks input and output lengths and the trace's block "
                                    "size: 0.125 fits 512-token blocks into 64)", to_float(0.0, 1.0))

    def check(self, where: str) -> None:
        if not os.path.isfile(self.path):
            raise RecipeError(f"{where}.path: file not found: {self.path} (a {self.format} trace)")


# workload keys a trace replaces: its timestamps are the arrivals, its rows the requests and their lengths
TRACE_REPLACES = ("requests", "arrival", "input_len", "output_len", "shared_prefix", "dataset")


@dataclass(frozen=True)
class WorkloadSpec(Section):
    requests: int = spec(60, "an integer >= 1 (requests per rate)", to_int(1))
    arrival: ArrivalSpec = spec(ArrivalSpec(), parse=section(ArrivalSpec))
    input_len: LengthSpec = spec(LengthSpec("uniform", min=1500, max=2000), parse=section(LengthSpec))
    output_len: LengthSpec = spec(LengthSpec("fixed", value=200), parse=section(LengthSpec))
    shared_prefix: Optional[SharedPrefix] = spec(None, parse=section(SharedPrefix, nullable=True))
    dataset: Optional[str] = spec(None, "null or a JSONL path (lines with prompt_ids or prompt, optional output_len)",
                                  optional(to_str))
    token_low: int = spec(10, "an integer >= 0 (lowest random token id; skips special ids)", to_int(0))
    token_high: Optional[int] = spec(None, "null (the model's vocab size) or an integer", optional(to_int(1)))
    trace: Optional[TraceSpec] = spec(None, parse=section(TraceSpec, nullable=True))

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "WorkloadSpec":
        raw = dict(as_mapping(raw, where, cls.keys()))
        for k in ("input_len", "output_len", "arrival"):  # null: the default
            if k in raw and raw[k] is None:
                del raw[k]
        if raw.get("trace") is not None:
            for k in TRACE_REPLACES:
                if raw.get(k) is not None:
                    raise RecipeError(f"{key_of(where, k)}: not used with {key_of(where, 'trace')}, whose rows give "
                                      "the requests, their arrivals and lengths (cut it with trace.limit, "
                                      "duration_s or sample)")
        return super().from_raw(raw, where)

    def to_raw(self) -> dict:
        raw = super().to_raw()
        return {k: v for k, v in raw.items() if k not in TRACE_REPLACES} if self.trace is not None else raw

    def check(self, where: str) -> None:
        ds, inl, outl, sp = self.dataset, self.input_len, self.output_len, self.shared_prefix
        if ds is not None and not os.path.isfile(ds):
            raise RecipeError(f"{where}.dataset: file not found: {ds} (expected a JSONL file)")
        if (inl.kind == "dataset") != (ds is not None):
            raise RecipeError(f"{where}.input_len: kind dataset and workload.dataset go together "
                              "(prompts come from the dataset file)")
        if outl.kind == "dataset" and ds is None:
            raise RecipeError(f"{where}.output_len: kind dataset needs workload.dataset (a JSONL path)")
        if sp is not None and inl.shortest is not None and sp.len >= inl.shortest:
            raise RecipeError(f"{key_of(where, 'shared_prefix')}.len ({sp.len}) must be < the shortest input_len "
                              f"({inl.shortest}): the prefix is part of the prompt")
        if self.token_high is not None and self.token_high <= self.token_low:
            raise RecipeError(f"{where}.token_high ({self.token_high}) must be > token_low ({self.token_low})")


def trace_rates(workload: WorkloadSpec, rates: Any, seed: int, where: str = "rates") -> Any:
    """`rates` with each `trace` entry replaced by the trace's nominal rate (its own pace, time_scale applied;
    the window and sample are the recipe seed's). Reads the trace: a malformed one is a RecipeError now."""
    if not isinstance(rates, tuple) or TRACE_RATE not in rates:
        return rates
    i = rates.index(TRACE_RATE)
    if workload.trace is None:
        raise RecipeError(f"{where}[{i}]: {TRACE_RATE} replays workload.trace at its own pace; the workload has no "
                          "trace")
    try:
        nominal = replay_for(workload.trace, seed).nominal_rate
    except TraceError as e:
        raise RecipeError(str(e)) from None
    if nominal is None or nominal == float("inf"):
        raise RecipeError(f"{where}[{i}]: the trace's replayed requests have no pace (one request, or all at the "
                          "same time); use rates: [inf]")
    out = tuple(nominal if r == TRACE_RATE else r for r in rates)
    if len(set(out)) < len(out):
        raise RecipeError(f"{where}: the trace's own rate ({nominal:g} req/s) is also listed as a number")
    return out
