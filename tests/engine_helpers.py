"""Shared helpers for engine tests: reference generation with transformers and a drive loop."""

from __future__ import annotations

import functools

import torch

from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model
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
