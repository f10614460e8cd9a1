"""Shared helpers for engine tests: reference generation with transformers and a drive loop."""

from __future__ import annotations

import functools

import torch

from pdlab.engine import Engine, EngineConfig, SamplingParams, cpu_threads, load_model
from pdlab.engine.model import preset_config


@functools.lru_cache(maxsize=None)
def model(preset: str):
    return load_model(preset)


@functools.lru_cache(maxsize=None)
def reference(preset: str):
    """The same weights in a stock transformers model (its own SDPA attention and cache)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(preset_config(preset), attn_implementation="sdpa")
    ref.load_state_dict(model(preset).state_dict())
    return ref.eval()


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(lengths: list[int], vocab: int = 512, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, reqs: list[list[int]], max_tokens: int = 16, **params) -> tuple[dict, list]:
    """Add every request at once, step until idle; returns outputs by id and the step records."""
    for i, p in enumerate(reqs):
        engine.add(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    records = []
    for _ in range(10_000):
        if not engine.has_work():
            break
        step = engine.step()
        if step.record:
            records.append(step.record)
        for t in step.tokens:
            assert t.error is None, t.error
            outs[t.req_id].append(t.token_id)
    assert not engine.has_work(), "engine did not drain"
    return outs, records


def engine(preset: str = "tiny-llama", role: str = "unified", **cfg) -> Engine:
    return Engine(model(preset), EngineConfig(**cfg), role=role)


def assert_split_keeps_bits(monkeypatch, compute, counts: tuple[int, ...]) -> torch.Tensor:
    """compute() (a threaded CPU kernel's call, pdlab.engine.cpu_threads) gives the same bits in one part, in
    each of `counts` parts, and under the engine's own split with three torch threads and any work split;
    returns the one-part result."""
    monkeypatch.setattr(cpu_threads, "parts", lambda flops, most: 1)
    one = compute()
    assert not torch.isnan(one).any()
    for n in counts:
        monkeypatch.setattr(cpu_threads, "parts", lambda flops, most, n=n: n)
        assert torch.equal(compute(), one), n
    monkeypatch.undo()
    monkeypatch.setattr(cpu_threads, "SPLIT_FLOPS", 1.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(compute(), one)
    finally:
        torch.set_num_threads(before)
    return one
