"""Greedy, temperature and top-p sampling; seeded per request."""

from __future__ import annotations

from typing import Optional

import torch

from pdlab.engine.config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> Optional[torch.Generator]:
    if params.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()  # a non-deterministic seed for this generator only (torch.seed() would reseed the global RNG)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of `logits` [n, vocab]. Greedy rows are argmaxed together in one call."""
    if logits.device.type == "cpu":
        out = logits.numpy().argmax(axis=1).tolist()  # numpy's argmax is ~10x torch's on one CPU core
    else:
        out = logits.argmax(dim=-1).tolist()
    if all(p.temperature == 0 for p in params):
        return out
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
