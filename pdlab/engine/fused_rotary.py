"""Rotary embedding in one pass inside pdlab's engine: pdlab.engine.cpu_kernel's rotary kernel in place of
transformers' five ops (`q * cos + rotate_half(q) * sin`, for queries and keys of every layer).

transformers' attention classes call the module-level `apply_rotary_pos_emb` of their modeling file, so that
name is wrapped there. The wrapper takes the kernel only during a pdlab engine step (pdlab.engine.attention's
context is set), on float32 CPU tensors, with the kernel built; anything else, including any other model in
the same process, goes to transformers' own function. The kernel gives the same bits as transformers' ops
(tests/test_cpu_kernel.py), so parity is untouched. For cpu-demo's q and k at 2,048 tokens: 2.92 ms ->
0.34 ms a layer (one core; BENCHMARKS.md).
"""

from __future__ import annotations

import sys
from typing import Any

_WRAPPED = "_pdlab_rotary"


def fuse_rotary(model: Any) -> int:
    """Wrap `apply_rotary_pos_emb` in the modeling modules of `model`'s attention layers; returns how many
    modules were wrapped now (0 when already wrapped or not applicable)."""
    # deferred: torch
    from pdlab.engine import cpu_kernel

    if cpu_kernel.load() is None:
        return 0
    n = 0
    for module in model.modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, _WRAPPED, False):
            continue
        setattr(mod, "apply_rotary_pos_emb", _wrap(fn))
        n += 1
    return n


def _wrap(original: Any) -> Any:
    # deferred: torch
    from pdlab.engine import attention, cpu_kernel

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1, *args: Any,
                             **kwargs: Any) -> Any:
        if attention._CTX is not None and unsqueeze_dim == 1 and not args and not kwargs:
            qe = cpu_kernel.rotary(q, cos, sin)
            ke = cpu_kernel.rotary(k, cos, sin) if qe is not None else None
            if ke is not None:
                return qe, ke
        return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)

    setattr(apply_rotary_pos_emb, _WRAPPED, True)
    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb
