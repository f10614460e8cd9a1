"""Seeded workloads: the same seed gives every variant the same requests at the same arrival times.

Randomness is split into independent streams keyed by (seed, purpose), so:
- the variant never enters: unified and disaggregated runs see identical requests;
- arrival gaps are drawn at unit rate and scaled by 1/rate, so the arrival pattern at rate 4 is the one
  at rate 2 compressed twice; by default the gaps are then rescaled so that the realised mean rate
  (n - 1 gaps over the span from first to last arrival) equals the nominal rate exactly, as `vllm bench
  serve` does: otherwise a short run's realised rate can be 10-20% off the rate it is reported at;
- prompts come from a named stream: on a rate grid one stream per rate (each rate starts with a cold
  prefix cache anyway); in a rate search one stream for every trial, so the search compares rates on
  the same prompts; warm-up requests have their own stream. Shared-prefix groups are the same everywhere.
- repeats use seed + i: distinct requests per repeat, the same ones for every variant.
A rate of inf puts every arrival at 0: the saturation point.

A trace workload (workload.trace) takes its requests from the trace (pdlab.traces.replay): its arrival pattern
scaled to each rate, its lengths, and for Mooncake its hash-id blocks as tokens, the same at every rate (each
rate starts with a cold cache); warm-up and calibration requests take trace lengths with tokens of their own.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pdlab.engine.model import load_tokenizer, model_config
from pdlab.recipe.workload import ArrivalSpec, LengthSpec, WorkloadSpec
from pdlab.traces import TraceError
from pdlab.traces.replay import Replay, replay_for


class WorkloadError(ValueError):
    """A workload that cannot be built (bad dataset line, token range outside the vocabulary)."""


@dataclass
class WorkloadRequest:
    id: str
    prompt_ids: list[int]
    output_len: int
    arrival: float  # seconds from the start of the rate's measurement
    prefix_group: Optional[int] = None  # shared-prefix group, None when the prompt carries no shared prefix


def rate_tag(rate: float) -> str:
    """Compact, stable text of a rate for ids and file names: 2.0 -> '2', 0.5 -> '0.5', inf -> 'inf'."""
    if math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def _rng(seed: int, *purpose: Any) -> np.random.Generator:
    key = zlib.crc32("/".join(str(p) for p in purpose).encode())
    return np.random.default_rng([seed, key])


def arrival_times(arrival: ArrivalSpec, rate: float, n: int, seed: int) -> list[float]:
    """Offsets in seconds of `n` arrivals; the first is at 0. Mean gap 1/rate for every kind."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    kind = arrival.kind
    rng = _rng(seed, "arrivals", kind)
    if kind == "poisson":
        gaps = rng.exponential(1.0, n - 1)
    elif kind == "gamma":
        b = arrival.burstiness  # shape b, scale 1/b: mean 1, CV 1/sqrt(b) (vLLM's form)
        gaps = rng.gamma(b, 1.0 / b, n - 1)
    elif kind == "constant":
        gaps = np.ones(n - 1)
    elif kind == "burst":
        size = arrival.size  # `size` requests together, every size/rate seconds
        return [float((i // size) * size / rate) for i in range(n)]
    else:
        raise WorkloadError(f"unknown arrival kind {kind!r}")
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    if arrival.rescale and n > 1 and times[-1] > 0:
        times *= (n - 1) / times[-1]  # mean gap exactly 1 (at unit rate)
    return [float(t) for t in times / rate]


def _length(spec: LengthSpec, rng: np.random.Generator, line: Optional[dict], what: str) -> int:
    if spec.kind == "fixed":
        return int(spec.value)
    if spec.kind == "uniform":
        return int(rng.integers(spec.min, spec.max + 1))
    if spec.kind == "mixture":
        weights = np.array([w for w, _ in spec.parts], dtype=float)
        part = spec.parts[int(rng.choice(len(spec.parts), p=weights / weights.sum()))][1]
        return _length(part, rng, line, what)
    if line is None or line.get(what) is None:
        raise WorkloadError(f"workload.{what}: kind dataset but the dataset line has no {what}")
    return int(line[what])


def load_dataset(path: str, tokenizer: Any = None, vocab_size: Optional[int] = None) -> list[dict]:
    """JSONL lines with `prompt_ids` (token ids) or `prompt` (text, needs `tokenizer`), optional `output_len`.

    `tokenizer` is a callable text -> ids, or an object with `.encode(text)`. Returns [{prompt_ids, output_len}].
    """
    encode: Optional[Callable[[str], list[int]]] = None
    if tokenizer is not None:
        encode = tokenizer.encode if hasattr(tokenizer, "encode") else tokenizer
    out: list[dict] = []
    with open(path) as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{n}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(line, dict):
                raise WorkloadError(f"{where}: expected an object with prompt_ids or prompt")
            if "prompt_ids" in line:
                ids = line["prompt_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise WorkloadError(f"{where}: prompt_ids must be a non-empty list of token ids")
            elif "prompt" in line:
                if encode is None:
                    raise WorkloadError(f"{where}: a text prompt needs the model's tokenizer")
                ids = [int(i) for i in encode(str(line["prompt"]))]
            else:
                raise WorkloadError(f"{where}: expected prompt_ids or prompt")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise WorkloadError(f"{where}: token id {max(ids)} is outside the vocabulary ({vocab_size})")
            ol = line.get("output_len")
            if ol is not None and (not isinstance(ol, int) or ol < 1):
                raise WorkloadError(f"{where}: output_len must be an integer >= 1, got {ol!r}")
            out.append({"prompt_ids": ids, "output_len": ol})
    if not out:
        raise WorkloadError(f"{path}: the dataset has no prompts")
    return out


def build_requests(workload: WorkloadSpec, rate: float, seed: int, vocab_size: int, tokenizer: Any = None,
                   dataset: Optional[list[dict]] = None, n: Optional[int] = None,
                   stream: Optional[str] = None) -> list[WorkloadRequest]:
    """The requests of one rate: `workload` is the recipe's `workload` section.

    `n` defaults to workload.requests; `stream` (default: the rate's tag) keys the prompts, e.g. "warmup"
    for warm-up requests or "search" for every trial of a rate search. Arrivals follow the rate. Ids are
    "<stream>-<i>", with the rate added when the stream is not the rate's own. `dataset` may be passed
    pre-loaded (see load_dataset); for a trace workload it is the prepared trace (pdlab.traces.replay.Replay).
    """
    key = rate_tag(rate) if stream is None else stream
    prefix = key if stream is None or stream == "warmup" else f"{key}@{rate_tag(rate)}"
    low = workload.token_low
    high = workload.token_high or vocab_size
    if high > vocab_size or low >= high:
        raise WorkloadError(f"workload token ids [{low}, {high}) do not fit the vocabulary of {vocab_size}")
    if workload.trace is not None:  # the measured streams replay the trace; warm-up and calibration get their own
        replay = dataset if isinstance(dataset, Replay) else replay_for(workload.trace, seed)
        try:
            reqs = replay.requests(rate, seed, low, high, n, None if stream in (None, "search") else stream)
        except TraceError as e:
            raise WorkloadError(str(e)) from None
        return [WorkloadRequest(f"{prefix}-{i:04d}", p, o, a) for i, (p, o, a) in enumerate(reqs)]
    n = workload.requests if n is None else n
    if workload.dataset and dataset is None:
        dataset = load_dataset(workload.dataset, tokenizer, vocab_size)

    sp = workload.shared_prefix
    prefixes: list[list[int]] = []
    if sp:
        prng = _rng(seed, "prefixes")
        prefixes = [prng.integers(low, high, sp.len).tolist() for _ in range(sp.groups)]

    rng = _rng(seed, "prompts", key)
    order = rng.permutation(len(dataset)).tolist() if dataset else []
    arrivals = arrival_times(workload.arrival, rate, n, seed)
    out = []
    for i in range(n):
        line = dataset[order[i % len(order)]] if dataset else None
        group = None
        if sp and key == "warmup":
            group = i % sp.groups  # warm-up visits every prefix group in turn
        elif sp and rng.random() < sp.share:
            group = int(rng.integers(0, sp.groups))
        if line is not None:
            body = list(line["prompt_ids"])
            prompt = (prefixes[group] + body) if group is not None else body
        else:
            total = _length(workload.input_len, rng, None, "input_len")
            head = prefixes[group] if group is not None else []
            prompt = head + rng.integers(low, high, total - len(head)).tolist()
        olen = _length(workload.output_len, rng, line, "output_len")
        out.append(WorkloadRequest(id=f"{prefix}-{i:04d}", prompt_ids=[int(t) for t in prompt], output_len=olen,
                                   arrival=arrivals[i], prefix_group=group))
    return out


def build_warmup(workload: WorkloadSpec, seed: int, vocab_size: int, n: int, tokenizer: Any = None,
                 dataset: Optional[list[dict]] = None) -> list[WorkloadRequest]:
    """Warm-up requests: drawn like the measured ones from their own stream, all arriving at 0; with shared
    prefixes, request i carries prefix group i % groups, so `warmup >= groups` warms every prefix."""
    return build_requests(workload, math.inf, seed, vocab_size, tokenizer, dataset, n=n, stream="warmup")


class Workload:
    """Every request one variant sends, for each repeat (seed) and rate: built on demand (seeded, cheap) and
    cached, so a searched rate gets its requests when the search asks for it."""

    def __init__(self, spec: WorkloadSpec, warmup: int, search: bool, vocab: int, tokenizer: Any = None,
                 dataset: Optional[list[dict]] = None):
        self.spec, self.n_warmup, self.search = spec, warmup, search
        self.vocab, self.tokenizer, self.dataset = vocab, tokenizer, dataset
        self._cache: dict[tuple, tuple[WorkloadRequest, ...]] = {}

    def warmup(self, seed: int) -> tuple[WorkloadRequest, ...]:
        key = ("warmup", seed)
        if key not in self._cache:
            self._cache[key] = tuple(build_warmup(self.spec, seed, self.vocab, self.n_warmup, self.tokenizer,
                                                  self.dataset))
        return self._cache[key]

    def facts(self) -> Optional[dict]:
        """A trace workload's facts for the summary (pdlab.traces.replay.Replay.facts); None otherwise."""
        return self.dataset.facts() if isinstance(self.dataset, Replay) else None

    def at(self, rate: float, seed: int) -> tuple[WorkloadRequest, ...]:
        key = (rate, seed)
        if key not in self._cache:
            self._cache[key] = tuple(build_requests(self.spec, rate, seed, self.vocab, self.tokenizer, self.dataset,
                                                    stream="search" if self.search else None))
        return self._cache[key]


def build_workload(variant: Any) -> Workload:
    """The requests a variant (pdlab.recipe.Variant) sends. Its grid (or, for a search, the saturation point)
    is built now, for every repeat, before anything starts, so that a workload the model cannot serve is a
    recipe error now rather than failed requests later; searched rates draw prompts from the same stream,
    so their prompts are the ones checked."""

    config = model_config(variant.model)
    vocab = config.vocab_size
    context = getattr(config, "max_position_embeddings", None)
    tokenizer = load_tokenizer(variant.model)
    wl = variant.workload
    if wl.trace is not None:  # lengths over what the engine takes are clipped (and counted), not refused
        limit = min((x for x in (variant.engine.max_model_len, context) if x), default=None)
        try:
            dataset = replay_for(wl.trace, variant.seed, limit)
        except TraceError as e:
            raise WorkloadError(str(e)) from None
    else:
        dataset = load_dataset(wl.dataset, tokenizer, vocab) if wl.dataset else None
    w = Workload(wl, variant.warmup, variant.auto, vocab, tokenizer, dataset)
    # relative rates (0.5x) are resolved after the calibration; prompts and lengths do not depend on the rate
    rates = [math.inf] if variant.auto else [r if isinstance(r, float) else 1.0 for r in variant.rates]
    built = [w.warmup(s) for s in variant.seeds()] + [w.at(r, s) for s in variant.seeds() for r in rates]
    longest = max((len(r.prompt_ids) for reqs in built for r in reqs), default=0)
    if context and longest >= context:
        raise WorkloadError(f"workload: prompts of up to {longest} tokens do not fit {variant.name}'s model "
                            f"context of {context} tokens (input_len, shared_prefix.len or the dataset)")
    return w


def trace_facts(workloads: dict[str, Workload]) -> Optional[dict[str, dict]]:
    """variant -> its trace workload's facts, for summarize_run's `trace`; None when no variant replays one."""
    out = {name: f for name, w in workloads.items() if (f := w.facts()) is not None}
    return out or None
