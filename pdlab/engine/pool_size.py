"""How many bytes of KV pool `kv_blocks: auto` may take on a GPU.

A worker alone on its GPU takes `kv_memory_fraction` of the memory free once its weights are loaded (as
before). Workers sharing a GPU cannot do that: they start together, each sees the same free memory before
the others allocate, and together they ask for more than there is. The launcher therefore gives each a
share of the device (pdlab.serve.sharing.memory_shares) and such a worker takes, from the device's *total*
memory, `kv_memory_fraction * share` less its own weights: a budget that does not depend on when the
others start. The rest of the device (1 - fraction) stays for CUDA contexts and activations, as alone.
"""

from __future__ import annotations


def gpu_kv_budget(free: int, total: int, fraction: float, share: float, weight_bytes: int) -> int:
    """Bytes the pool may take. `free`/`total`: the device's memory now (after this worker's weights) and in
    all; `share`: this worker's share of the device (1 when alone); `weight_bytes`: this worker's weights."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"memory share must be in (0, 1], got {share}")
    if share >= 1.0:
        return max(0, int(free * fraction))
    return max(0, int(total * fraction * share) - weight_bytes)


def weight_bytes(model: object) -> int:
    """Bytes of a model's parameters and buffers (what a worker loaded before sizing its pool)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # type: ignore[attr-defined]
    return params + buffers
