"""pdlab's CPU kernels, built once per machine and called through ctypes: decode attention
(csrc/decode_attention.c), causal prefill attention of a chunk over itself (csrc/prefill_attention.c),
rotary embedding (csrc/rotary.c), the SwiGLU activation (csrc/swiglu.c) and RMSNorm (csrc/rms_norm.c);
csrc/vec_math.h holds what they share (vectors, exp, softmax rows).

Why a kernel: a decode step attends each request's one query token to its whole context. In torch that is a
few small ops per request and layer (two matmuls, a softmax), each costing more in dispatch and in MKL's
small-matrix path than in arithmetic: with 32 requests of ~600 tokens it was half the decode step and most
of the gap to vLLM's CPU engine, which runs its own C++ kernel there. This one does every decode request of
a layer in one call, reading K/V in place from the paged pool. The prefill kernel beats torch's flash SDPA
at head_dim 32 (which runs it at ~61 GFLOP/s here). The rotary kernel replaces transformers' five ops (two
products, a negation, a concatenation, a sum: a pass and a temporary each) with one pass giving the same
bits; the SwiGLU one does silu(gate) * up in one pass after the fused gate/up GEMM (pdlab.engine.fused_linear),
and the RMSNorm one a row in one pass where torch's op makes five (pdlab.engine.fused_norm).
All are single-threaded: every CPU rank pdlab starts has one core.

Why ctypes and plain C: no torch headers, so the build takes about a second with the system's C compiler
(`cc`, or $CC) and needs neither ninja nor a matching torch build. The shared object is cached under
$PDLAB_KERNEL_CACHE (default ~/.cache/pdlab/kernels), keyed by the source, the flags, the compiler and the
CPU's feature flags (built with -march=native), and written atomically, so workers starting together build
it at most once each and never load a half-written file.

No compiler, a failed build, `PDLAB_CPU_KERNEL=0`, a dtype other than float32 or head sizes beyond the
kernels' limits: the engine uses its torch paths (pdlab.engine.attention, transformers' own ops), with the
same tokens, to float rounding. `status()` says which and why (pdlab doctor prints it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Any, Optional

import torch

from pdlab.constants import cdiv

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
BASE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared"]  # vectorised for this CPU
# Associative float math (not -ffast-math: with GCC < 13 that links crtfastmath into a shared object, which turns
# on flush-to-zero for the whole process) lets the attention's dot products over head_dim vectorise. The rotary
# kernel must round as torch does: no reassociation, no fused multiply-add.
FLAGS = {"decode_attention": BASE_FLAGS + ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
                                           "-fno-trapping-math"],
         "rotary": BASE_FLAGS + ["-ffp-contract=off"]}
FLAGS["prefill_attention"] = FLAGS["swiglu"] = FLAGS["rms_norm"] = FLAGS["decode_attention"]
MAX_GROUP, MAX_DIM = 32, 256  # the kernel's limits (query heads per K/V head, head_dim), as in the source

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# each kernel (csrc/<name>.c): its C function's argument and result types
SIGNATURES = {
    "decode_attention": ([_P, _L, _L, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _F, _P, _L, _L, _P], ctypes.c_int),
    "rotary": ([_P, _L, _L, _I, _I, _I, _P, _P, _P], None),
    "prefill_attention": ([_P, _L, _L, _P, _L, _L, _P, _L, _L, _I, _I, _I, _I, _F, _P, _L, _L, _P], ctypes.c_int),
    "swiglu": ([_P, _L, _L, _L, _P], None),
    "rms_norm": ([_P, _L, _L, _L, _P, _F, _P], None),
}
_fns: dict[str, Any] = {}  # kernel name -> its C function (pdlab_<name>), once loaded
_status = ""


def cache_dir() -> str:
    root = os.environ.get("PDLAB_KERNEL_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdlab", "kernels")
    return root


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine()


def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(name: str = "decode_attention") -> str:
    """The path of kernel `name`'s shared object (building it if it is not cached); raises with the reason."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc} not found)")
    source = os.path.join(CSRC, f"{name}.c")
    flags = FLAGS[name]
    src = open(source, "rb").read()
    for header in sorted(f for f in os.listdir(CSRC) if f.endswith(".h")):  # included sources change the build too
        src += open(os.path.join(CSRC, header), "rb").read()
    key = hashlib.sha256(src + " ".join(flags).encode() + _compiler_id(cc).encode() + _cpu_flags().encode())
    out_dir = cache_dir()
    path = os.path.join(out_dir, f"{name}-{key.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        p = subprocess.run([cc, *flags, source, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if p.returncode:
            lines = p.stderr.strip().splitlines()
            raise RuntimeError(f"{cc} failed: {next((x for x in lines if 'error' in x), lines[-1] if lines else '?')}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load() -> Optional[dict[str, Any]]:
    """Every kernel's C function by name (all or none), or None (the reason is in `status()`); tried once per
    process."""
    global _status
    if _fns or _status:
        return _fns or None
    if os.environ.get("PDLAB_CPU_KERNEL", "1") == "0":
        _status = "off (PDLAB_CPU_KERNEL=0)"
        return None
    try:
        fns = {name: getattr(ctypes.CDLL(build(name)), f"pdlab_{name}") for name in SIGNATURES}
    except Exception as e:  # noqa: BLE001 - any failure means the torch path, with the reason kept
        _status = f"unavailable ({e}); using torch ops"
        return None
    for name, (args, result) in SIGNATURES.items():
        fns[name].argtypes, fns[name].restype = args, result
    _fns.update(fns)
    _status = "built"
    return _fns


def _fn(name: str) -> Any:
    """Kernel `name`'s C function, loading the kernels at the first call; None where they are not built."""
    if not _status:
        load()
    return _fns.get(name)


def status() -> str:
    load()
    return _status


def usable(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a CPU runner with this pool can use the kernel (else the torch path)."""
    return (dtype == torch.float32 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_DIM and load() is not None)


class DecodeBatch:
    """One step's decode requests as the kernel reads them: rows, block tables and context lengths (int32)."""

    def __init__(self, rows: list[int], tables: list[list[int]], lens: list[int]):
        from pdlab.engine.blocks import padded_tables

        flat, width = padded_tables(tables)
        self.rows = torch.tensor(rows, dtype=torch.int32)
        self.tables = torch.tensor(flat, dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.width = width
        self.max_len = max(lens)


def decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, batch: DecodeBatch,
                     scale: float, out: torch.Tensor) -> None:
    """out[row] = softmax(q[row] K^T * scale) V for each decode request, K/V read from its blocks.

    q, out: [T, H, D] float32 with unit stride over D; k_blocks, v_blocks: [blocks, block_size, Hkv, D],
    contiguous."""
    fn = _fns.get("decode_attention")
    assert fn is not None, "decode_attention called without the kernel loaded"
    if q.stride(2) != 1 or out.stride(2) != 1 or not (k_blocks.is_contiguous() and v_blocks.is_contiguous()):
        raise ValueError("decode_attention: q/out need unit stride over head_dim and K/V contiguous blocks")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[2]
    scratch = torch.empty(heads * batch.max_len, dtype=torch.float32)
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), batch.rows.data_ptr(), len(batch.rows), heads, kv_heads, head_dim,
        k_blocks.data_ptr(), v_blocks.data_ptr(), k_blocks.shape[1], batch.tables.data_ptr(), batch.width,
        batch.lens.data_ptr(), scale, out.data_ptr(), out.stride(0), out.stride(1), scratch.data_ptr())
    if rc:
        raise ValueError(f"decode_attention: heads {heads} / kv heads {kv_heads} / head_dim {head_dim} "
                         f"beyond the kernel's limits")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """transformers' `x * cos + rotate_half(x) * sin` for x [1, heads, tokens, head_dim] and cos/sin
    [1, tokens, head_dim], in one pass and the same bits; None where the kernel does not apply (the caller
    then runs transformers' ops). The result is laid out [1, tokens, heads, head_dim] in memory, as
    transformers' would be for the transposed projection it is given."""
    rot = _fn("rotary")
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


PREFILL_ROWS = 8  # csrc/prefill_attention.c's ROWS: query heads per K/V head at most this many


def prefill_usable(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a CPU runner with this pool can use the prefill kernel (else SDPA)."""
    return (dtype == torch.float32 and heads % kv_heads == 0 and heads // kv_heads <= PREFILL_ROWS
            and head_dim % 16 == 0 and head_dim <= MAX_DIM and load() is not None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of one request's chunk over itself: out[t] from q[t] and k/v[0..t]; q, out [n, H, D],
    k, v [n, Hkv, D], float32, unit stride over D (any row and head strides)."""
    pre = _fns.get("prefill_attention")
    assert pre is not None, "prefill_attention called without the kernel loaded"
    for x in (q, k, v, out):
        if x.stride(2) != 1:
            raise ValueError("prefill_attention: tensors need unit stride over head_dim")
    n, heads, head_dim = q.shape
    scratch = torch.empty((head_dim + PREFILL_ROWS) * (cdiv(n, 16) * 16), dtype=torch.float32)  # rows padded to 16
    rc = pre(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), n, heads, k.shape[1], head_dim, scale, out.data_ptr(), out.stride(0), out.stride(1),
        scratch.data_ptr())
    if rc:
        raise ValueError(f"prefill_attention: heads {heads} / kv heads {k.shape[1]} / head_dim {head_dim} "
                         f"beyond the kernel's limits")


def swiglu(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """silu(gate) * up from the fused projection's output [..., 2 * width] (gate first), in one pass; None
    where the kernel does not apply (the caller then runs torch's ops)."""
    act = _fn("swiglu")
    if act is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.stride(-1) != 1:
        return None
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, gate_up.shape[-1]) if gate_up.dim() != 2 else gate_up
    if flat.dim() != 2 or flat.stride(1) != 1:
        return None
    out = torch.empty((*gate_up.shape[:-1], width), dtype=torch.float32)
    act(flat.data_ptr(), flat.shape[0], width, flat.stride(0), out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """weight * x / sqrt(mean(x^2, -1) + eps) in one pass per row, for float32 x [..., width] with unit stride
    over width and rows that flatten to one stride; None where the kernel does not apply (the caller then runs
    torch's op)."""
    norm = _fn("rms_norm")
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
