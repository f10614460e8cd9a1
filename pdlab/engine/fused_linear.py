"""Fused projections on CPU: q/k/v as one matrix multiply, gate/up as one (as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do), under transformers' unchanged attention and MLP code.

Why: one GEMM over the concatenated weights is faster than two or three over their parts (fewer calls, wider
outputs for MKL), and each output column is the same dot product, so the results are the same bits here
(tests/test_fused_linear.py). On bench_vllm's work (cpu-demo, one core) the linear layers' total went
0.994 -> 0.955 s (two runs each, cProfile), 2,204 -> 1,292 calls.

How: the weights are concatenated once and each projection's weight becomes a view of its rows (no second
copy). The first projection's forward runs the one GEMM and returns its part; the others return theirs when
called with the same input tensor, which transformers' layers do (q, k, v of one hidden state; gate and up of
one). Called with anything else, or after their weights were replaced (tensor-parallel sharding slices them),
each projection computes its own GEMM as before; `fuse_projections` run again re-fuses the new weights.

A SiLU-gated MLP (Llama, Qwen3) goes further: its forward becomes down(swiglu(x @ [gate; up])), the
activation and product in one pass by pdlab.engine.cpu_kernel (transformers' SiLU and product are two
passes over strided halves); equal to float rounding, not bit for bit (its exp is not torch's).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from pdlab.engine import cpu_kernel

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The projections of one group, their concatenated weight (and bias) and the pending parts."""

    def __init__(self, mods: Sequence[torch.nn.Linear]):
        self.mods = list(mods)
        self.sizes = [m.weight.shape[0] for m in mods]
        self.weight = torch.cat([m.weight.detach() for m in mods])
        has_bias = [m.bias is not None for m in mods]
        self.bias: Optional[torch.Tensor] = torch.cat([m.bias.detach() for m in mods]) if all(has_bias) else None
        at = 0
        for m, n in zip(mods, self.sizes):
            m.weight = torch.nn.Parameter(self.weight[at:at + n], requires_grad=False)
            if self.bias is not None:
                m.bias = torch.nn.Parameter(self.bias[at:at + n], requires_grad=False)
            at += n
        self.pending: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None
        self.packed: Any = None  # pdlab.engine.packed_linear.Packed of the concatenated weight, where it pays
        for i, m in enumerate(mods):
            m.forward = self._first if i == 0 else self._part(i)
            m.pdlab_fused = self

    def intact(self) -> bool:
        """Each projection's weight is still its view of the concatenated one."""
        at = 0
        row = self.weight.stride(0) * self.weight.element_size()
        for m, n in zip(self.mods, self.sizes):
            w = m.weight
            if w.shape[0] != n or w.data_ptr() != self.weight.data_ptr() + at * row:
                return False
            if self.bias is not None and (m.bias is None or m.bias.data_ptr() != self.bias.data_ptr() +
                                          at * self.bias.element_size()):
                return False
            at += n
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x times the concatenated weight (plus bias): packed where pdlab.engine.packed_linear packed it."""
        if self.packed is not None:
            return self.packed(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _own(self, i: int, x: torch.Tensor) -> torch.Tensor:
        m = self.mods[i]
        return F.linear(x, m.weight, m.bias)

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        self.pending = None
        if not self.intact():
            return self._own(0, x)
        parts = list(self.matmul(x).split(self.sizes, dim=-1))
        self.pending = (x, parts)
        return parts[0]

    def _part(self, i: int) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            p = self.pending
            if p is None or p[0] is not x:
                return self._own(i, x)
            if i == len(self.mods) - 1:
                self.pending = None  # nothing kept alive between layers
            return p[1][i]

        return forward


def fuse_projections(model: Any) -> int:
    """Fuse every q/k/v and gate/up group of `model`'s CPU layers (again where sharding replaced the weights);
    returns how many groups were fused now."""
    n = 0
    for module in model.modules():
        for names in GROUPS:
            mods = [getattr(module, name, None) for name in names]
            if not all(isinstance(m, torch.nn.Linear) for m in mods):
                continue
            old = getattr(mods[0], "pdlab_fused", None)
            if old is not None and old.intact() and all(getattr(m, "pdlab_fused", None) is old for m in mods):
                continue
            w = [m.weight for m in mods]
            if any(t.device.type != "cpu" or t.dtype != w[0].dtype or t.shape[1] != w[0].shape[1] for t in w):
                continue
            if len({m.bias is None for m in mods}) > 1:
                continue
            group = FusedGroup(mods)
            if names == ("gate_proj", "up_proj") and _is_swiglu(module):
                module.forward = _swiglu_forward(module, group)
            n += 1
    return n


def _is_swiglu(mlp: Any) -> bool:
    act = getattr(mlp, "act_fn", None)
    return isinstance(getattr(mlp, "down_proj", None), torch.nn.Linear) and (
        isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"))


def _swiglu_forward(mlp: Any, group: FusedGroup) -> Any:
    """The MLP as down(silu(gate) * up) with the fused gate/up GEMM and pdlab.engine.cpu_kernel's one-pass
    activation; transformers' own forward where either does not apply (weights replaced, no kernel)."""

    original = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if group.intact() and getattr(mlp, "pdlab_fused_gate", None) is group:
            h = cpu_kernel.swiglu(group.matmul(x))
            if h is not None:
                return mlp.down_proj(h)
        return original(mlp, x)

    mlp.pdlab_fused_gate = group
    return forward
