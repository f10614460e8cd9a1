"""RMSNorm as one op: pdlab's CPU kernel, or torch's `F.rms_norm`, in place of transformers' five-op forward.

transformers' Llama and Qwen3 RMSNorm upcast, square, average, scale by the reciprocal root and multiply by
the weight, each a pass over the activations. In float32:
- on CPU, pdlab's kernel (pdlab.engine.cpu_kernel, csrc/rms_norm.c) makes one pass per row. Its sum of
  squares runs in sixteen lanes, so it agrees with transformers to float rounding, like the attention
  kernels: token parity with transformers is what the engine tests check;
- elsewhere, or with the kernel off, torch's `F.rms_norm`, which is transformers' function bit for bit
  (tests/test_fused_norm.py). When the kernel was written it ran on CPU as separate ops (about 2.5 GB/s, a
  tenth of a copy); torch 2.13 runs it fused (`aten::_fused_rms_norm`), and on the
  developers' AVX2 box (2026-12-02) it took 0.19 ms where the kernel took 0.31. Which one runs is the
  machine's race (pdlab.engine.kernel_check), as for every kernel.
Other dtypes keep transformers' forward, whose order of casts neither follows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdlab.engine import cpu_kernel


def _is_rms_norm(module: Any) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1)


def fuse_rms_norms(model: Any) -> int:
    """Give every float32 RMSNorm of `model` the fused forward; returns how many it changed."""
    n = 0
    for module in model.modules():
        if _is_rms_norm(module) and module.weight.dtype == torch.float32:
            module.forward = _fused_forward(module)
            n += 1
    return n


def _fused_forward(module: Any) -> Any:
    original = module.forward
    shape = (module.weight.shape[0],)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.float32 or module.weight.dtype != torch.float32:
            return original(hidden_states)
        if hidden_states.device.type == "cpu":
            out = cpu_kernel.rms_norm(hidden_states, module.weight, module.variance_epsilon)
            if out is not None:
                return out
        return F.rms_norm(hidden_states, shape, module.weight, module.variance_epsilon)

    return forward
