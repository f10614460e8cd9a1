"""pdlab's CPU kernels, called through ctypes: decode attention (csrc/decode_attention.c), causal prefill
attention of a chunk over itself (csrc/prefill_attention.c), rotary embedding (csrc/rotary.c), the SwiGLU
activation (csrc/swiglu.c) and RMSNorm (csrc/rms_norm.c); csrc/vec_math.h holds what they share (vectors, exp,
softmax rows). pdlab.engine.kernel_build compiles them; pdlab.engine.kernel_check decides, per machine and
model shape, which of them beat the torch path they replace.

Why a kernel: a decode step attends each request's one query token to its whole context. In torch that is a
few small ops per request and layer (two matmuls, a softmax), each costing more in dispatch and in MKL's
small-matrix path than in arithmetic: with 32 requests of ~600 tokens it was half the decode step and most
of the gap to vLLM's CPU engine, which runs its own C++ kernel there. This one does every decode request of
a layer in one call, reading K/V in place from the paged pool. The prefill kernel beat torch's flash SDPA
at head_dim 32 on an AVX-512 box (which runs it at ~61 GFLOP/s there), and lost to it by up to 3x on an
AVX2-only one: hence the timing check. The rotary kernel replaces transformers' five ops (two products, a
negation, a concatenation, a sum: a pass and a temporary each) with one pass giving the same bits; the
SwiGLU one does silu(gate) * up in one pass after the fused gate/up GEMM (pdlab.engine.fused_linear), and
the RMSNorm one a row in one pass where torch's op makes five (pdlab.engine.fused_norm). Decode attention
splits a call by requests, and prefill attention by blocks of positions, over torch's threads where a process
has more than one (pdlab.engine.cpu_threads); the others run on one thread (a CPU rank has one core by default).

Each kernel loads on its own: one that fails to build leaves the others in use. $PDLAB_CPU_KERNEL (`auto`,
the default; `on`; `off`), no compiler, a failed build, a dtype other than float32, head sizes beyond the
kernels' limits, or a kernel slower here than torch: the engine uses its torch paths (pdlab.engine.attention,
transformers' own ops), with the same tokens, to float rounding. `status()` says which were built and why
not (pdlab doctor prints it); a runner's choices, with the timings, go into its worker's Ready message and
from there into env.json, the summary and compare's header. $PDLAB_KERNEL_MARCH builds them for another target
than this CPU's own (`x86-64-v3`: the AVX2 paths on an AVX-512 box).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import torch

from pdlab.constants import CPU_KERNEL_ENV, CPU_KERNEL_MODES, CPU_KERNELS, KERNEL_MARCH_ENV, cdiv
from pdlab.engine import cpu_threads
from pdlab.engine.blocks import padded_tables
from pdlab.engine.kernel_build import BuildError, open_kernel, process_march

MAX_GROUP, MAX_DIM = 32, 256  # the decode kernel's limits (query heads per K/V head, head_dim), as in the source
PREFILL_ROWS = 8  # csrc/prefill_attention.c's ROWS: query heads per K/V head at most this many

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# each kernel (csrc/<name>.c): its C function's argument and result types
SIGNATURES = {
    "decode_attention": ([_P, _L, _L, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _F, _P, _L, _L, _P, _L, _I],
                         ctypes.c_int),
    "prefill_attention": ([_P, _L, _L, _P, _L, _L, _P, _L, _L, _I, _I, _I, _I, _F, _P, _L, _L, _P, _I], ctypes.c_int),
    "rotary": ([_P, _L, _L, _I, _I, _I, _P, _P, _P], None),
    "swiglu": ([_P, _L, _L, _L, _P], None),
    "rms_norm": ([_P, _L, _L, _L, _P, _F, _P], None),
}
assert tuple(SIGNATURES) == CPU_KERNELS


def mode() -> str:
    """$PDLAB_CPU_KERNEL as one of CPU_KERNEL_MODES (`1`/`0`, the older spellings, are `auto`/`off`)."""
    raw = os.environ.get(CPU_KERNEL_ENV, "auto").strip().lower()
    raw = {"1": "auto", "0": "off", "": "auto"}.get(raw, raw)
    return raw if raw in CPU_KERNEL_MODES else "auto"


class Kernels:
    """One build of every kernel for a `-march` target: the C functions that built, and why the others did
    not. The engine uses the process's native build (`load()`); the tests also build other targets."""

    def __init__(self, march: str = "native", werror: bool = False):
        self.march = march
        self.fns: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.paths: dict[str, str] = {}
        for name, (args, result) in SIGNATURES.items():
            try:
                lib, self.paths[name] = open_kernel(name, march, werror)
                fn = getattr(lib, f"pdlab_{name}")
            except (BuildError, OSError, AttributeError) as e:
                self.errors[name] = str(e)
                continue
            fn.argtypes, fn.restype = args, result
            self.fns[name] = fn

    def status(self) -> str:
        if not self.errors:
            return "built"
        if not self.fns:
            return f"unavailable ({next(iter(self.errors.values()))}); using torch ops"
        return f"built except {', '.join(f'{n} ({e})' for n, e in self.errors.items())}"

    def _need(self, name: str) -> Any:
        fn = self.fns.get(name)
        assert fn is not None, f"{name} called without the kernel built"
        return fn

    def decode_attention(self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, batch: "DecodeBatch",
                         scale: float, out: torch.Tensor) -> None:
        """out[row] = softmax(q[row] K^T * scale) V for each decode request, K/V read from its blocks.

        q, out: [T, H, D] float32 with unit stride over D; k_blocks, v_blocks: [blocks, block_size, Hkv, D],
        contiguous."""
        fn = self._need("decode_attention")
        if q.stride(2) != 1 or out.stride(2) != 1 or not (k_blocks.is_contiguous() and v_blocks.is_contiguous()):
            raise ValueError("decode_attention: q/out need unit stride over head_dim and K/V contiguous blocks")
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_blocks.shape[2]
        parts = cpu_threads.parts(4.0 * batch.tokens * heads * head_dim, len(batch.rows))  # QK^T and PV
        per_part = heads * (batch.max_len + head_dim + 1)
        scratch = torch.empty(parts * per_part, dtype=torch.float32)
        rc = fn(
            q.data_ptr(), q.stride(0), q.stride(1), batch.rows.data_ptr(), len(batch.rows), heads, kv_heads,
            head_dim, k_blocks.data_ptr(), v_blocks.data_ptr(), k_blocks.shape[1], batch.tables.data_ptr(),
            batch.width, batch.lens.data_ptr(), scale, out.data_ptr(), out.stride(0), out.stride(1),
            scratch.data_ptr(), per_part, parts)
        if rc:
            raise ValueError(f"decode_attention: heads {heads} / kv heads {kv_heads} / head_dim {head_dim} "
                             f"beyond the kernel's limits")

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor) -> None:
        """Causal attention of one request's chunk over itself: out[t] from q[t] and k/v[0..t]; q, out [n, H, D],
        k, v [n, Hkv, D], float32, unit stride over D (any row and head strides)."""
        pre = self._need("prefill_attention")
        for x in (q, k, v, out):
            if x.stride(2) != 1:
                raise ValueError("prefill_attention: tensors need unit stride over head_dim")
        n, heads, head_dim = q.shape
        groups = heads // max(k.shape[1], 1)
        blocks = cdiv(n, max(PREFILL_ROWS // max(groups, 1), 1))
        parts = cpu_threads.parts(2.0 * n * n * heads * head_dim, blocks)  # QK^T and PV, causal: half of n x n
        scratch = torch.empty((head_dim + parts * PREFILL_ROWS) * (cdiv(n, 16) * 16), dtype=torch.float32)
        rc = pre(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
            v.stride(0), v.stride(1), n, heads, k.shape[1], head_dim, scale, out.data_ptr(), out.stride(0),
            out.stride(1), scratch.data_ptr(), parts)
        if rc:
            raise ValueError(f"prefill_attention: heads {heads} / kv heads {k.shape[1]} / head_dim {head_dim} "
                             f"beyond the kernel's limits")

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
        """transformers' `x * cos + rotate_half(x) * sin` for x [1, heads, tokens, head_dim] and cos/sin
        [1, tokens, head_dim], in one pass and the same bits; None where the kernel does not apply (the caller
        then runs transformers' ops). The result is laid out [1, tokens, heads, head_dim] in memory, as
        transformers' would be for the transposed projection it is given."""
        rot = self.fns.get("rotary")
        if (rot is None or x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32
                or x.dim() != 4 or x.shape[0] != 1 or x.stride(3) != 1 or x.shape[3] % 2 or x.device.type != "cpu"):
            return None
        _, heads, tokens, dim = x.shape
        if cos.shape != (1, tokens, dim) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        out = torch.empty((1, tokens, heads, dim), dtype=x.dtype)
        rot(x.data_ptr(), x.stride(2), x.stride(1), tokens, heads, dim, cos.data_ptr(), sin.data_ptr(),
            out.data_ptr())
        return out.transpose(1, 2)

    def swiglu(self, gate_up: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(gate) * up from the fused projection's output [..., 2 * width] (gate first), in one pass; None
        where the kernel does not apply (the caller then runs torch's ops)."""
        act = self.fns.get("swiglu")
        if act is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.stride(-1) != 1:
            return None
        width = gate_up.shape[-1] // 2
        flat = gate_up.reshape(-1, gate_up.shape[-1]) if gate_up.dim() != 2 else gate_up
        if flat.dim() != 2 or flat.stride(1) != 1:
            return None
        out = torch.empty((*gate_up.shape[:-1], width), dtype=torch.float32)
        act(flat.data_ptr(), flat.shape[0], width, flat.stride(0), out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
        """weight * x / sqrt(mean(x^2, -1) + eps) in one pass per row, for float32 x [..., width] with unit
        stride over width and rows that flatten to one stride; None where the kernel does not apply (the caller
        then runs torch's op)."""
        norm = self.fns.get("rms_norm")
        if (norm is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or x.dim() < 1 or x.stride(-1) != 1 or not weight.is_contiguous() or weight.shape != x.shape[-1:]):
            return None
        width = x.shape[-1]
        try:
            flat = x.view(-1, width)  # no copy: rows that a view cannot flatten fall back
        except RuntimeError:
            return None
        out = torch.empty(x.shape, dtype=torch.float32)
        norm(flat.data_ptr(), flat.shape[0], width, flat.stride(0) if flat.shape[0] > 1 else width,
             weight.data_ptr(), eps, out.data_ptr())
        return out


_native: Optional[Kernels] = None
_status = ""
_off: dict[str, str] = {}  # kernel -> why this process runs the torch path instead (pdlab.engine.kernel_check)


def load() -> Optional[Kernels]:
    """The process's build (tried once per process): native, or $PDLAB_KERNEL_MARCH's target
    (kernel_build.process_march); None where no kernel is in use (the reason is in `status()`)."""
    global _native, _status
    if _native is not None or _status:
        return _native
    if mode() == "off":
        _status = f"off ({CPU_KERNEL_ENV}=off)"
        return None
    k = Kernels(process_march())
    _status = k.status() + ("" if k.march == "native" else f" (-march={k.march}, {KERNEL_MARCH_ENV})")
    _native = k if k.fns else None
    return _native


def status() -> str:
    load()
    return _status


def turn_off(name: str, why: Optional[str]) -> None:
    """From now on this process runs `name`'s torch path (kernel_check found it slower here, say); `why`
    None turns it back on (a later runner of another shape chose it)."""
    if why is None:
        _off.pop(name, None)
    else:
        _off[name] = why


def active(name: str) -> bool:
    """Whether kernel `name` is built and not turned off in this process."""
    k = load()
    return k is not None and name in k.fns and name not in _off


def _kernels(name: str) -> Optional[Kernels]:
    return _native if active(name) else None


class DecodeBatch:
    """One step's decode requests as the kernel reads them: rows, block tables and context lengths (int32)."""

    def __init__(self, rows: list[int], tables: list[list[int]], lens: list[int]):
        flat, width = padded_tables(tables)
        self.rows = torch.tensor(rows, dtype=torch.int32)
        self.tables = torch.tensor(flat, dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.width = width
        self.max_len = max(lens)
        self.tokens = sum(lens)  # context tokens of the whole batch


def decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, batch: DecodeBatch,
                     scale: float, out: torch.Tensor) -> None:
    """The native build's decode attention (Kernels.decode_attention); the runner chose it (kernel_check)."""
    k = _kernels("decode_attention")
    assert k is not None, "decode_attention called without the kernel in use"
    k.decode_attention(q, k_blocks, v_blocks, batch, scale, out)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """The native build's prefill attention (Kernels.prefill_attention); the runner chose it (kernel_check)."""
    kern = _kernels("prefill_attention")
    assert kern is not None, "prefill_attention called without the kernel in use"
    kern.prefill_attention(q, k, v, scale, out)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """Kernels.rotary with the native build; None where it is not in use or does not apply."""
    k = _kernels("rotary")
    return None if k is None else k.rotary(x, cos, sin)


def swiglu(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """Kernels.swiglu with the native build; None where it is not in use or does not apply."""
    k = _kernels("swiglu")
    return None if k is None else k.swiglu(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """Kernels.rms_norm with the native build; None where it is not in use or does not apply."""
    k = _kernels("rms_norm")
    return None if k is None else k.rms_norm(x, weight, eps)
