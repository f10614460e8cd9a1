"""pdlab's own GEMM for the CPU linears (csrc/gemm.c), called through ctypes: the weight packed once into
panels of 16 output columns, every call y = x W^T + bias. With more than one torch thread a product big enough
is split by panels over that many of torch's OpenMP threads (pdlab.engine.cpu_threads); each panel is computed
the same way whichever thread runs it, so the bits do not depend on the thread count.

It is one of the packings pdlab.engine.packed_linear races per weight shape; it serves a weight only where it
won the race here and its bits fit (a row's result independent of the rows beside it, by construction, and
within a stated tolerance of F.linear's). Built like the other kernels (pdlab.engine.kernel_build: the system
compiler, $PDLAB_KERNEL_MARCH's target, cached); a failed build leaves the other packings.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pdlab.constants import GEMM_PANEL
from pdlab.engine import cpu_threads
from pdlab.engine.kernel_build import BuildError, open_kernel, process_march

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_fn: Optional[ctypes._CFuncPtr] = None
_path = ""
_error = ""


def function(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    """pdlab_gemm from a loaded build of csrc/gemm.c, typed."""
    fn = lib.pdlab_gemm
    fn.argtypes, fn.restype = [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I], ctypes.c_int
    return fn


def load() -> Optional[ctypes._CFuncPtr]:
    """The process's build of csrc/gemm.c (tried once per process); None where it did not build (`error()`)."""
    global _fn, _path, _error
    if _fn is None and not _error:
        try:
            lib, _path = open_kernel("gemm", process_march())
            _fn = function(lib)
        except (BuildError, OSError, AttributeError) as e:
            _error = str(e) or type(e).__name__
    return _fn


def error() -> str:
    return _error


def build_name() -> str:
    """The shared object's file name (its hash names the source, flags, compiler and CPU); '' if not built."""
    return _path.rsplit("/", 1)[-1]


class Panels:
    """A weight [n, k] (and bias [n]) packed for csrc/gemm.c: panels [ceil(n / 16), k, 16], the last one
    zero-padded, and the bias padded to match."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        n, k = weight.shape
        width = -(-n // GEMM_PANEL) * GEMM_PANEL
        w = torch.zeros(width, k, dtype=torch.float32)
        w[:n] = weight.detach()
        self.panels = w.view(width // GEMM_PANEL, GEMM_PANEL, k).transpose(1, 2).contiguous()
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(width, dtype=torch.float32)
            self.bias[:n] = bias.detach()
        self.n, self.k = n, k

    def __call__(self, x: torch.Tensor, fn: Optional[ctypes._CFuncPtr] = None) -> torch.Tensor:
        """x [rows, k] float32 (unit stride over k, any row stride) @ W^T + bias -> [rows, n], contiguous.
        fn: another build of the kernel (`function`), else the process's."""
        fn = fn or load()
        assert fn is not None, "gemm_kernel.Panels called without the kernel built"
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or (x.stride(1) != 1 and self.k > 1):
            raise ValueError(f"gemm: x {tuple(x.shape)} {x.dtype} does not fit a [rows, {self.k}] float32 weight")
        rows, panels = x.shape[0], self.panels.shape[0]
        y = torch.empty(rows, self.n, dtype=torch.float32)
        if not rows:
            return y
        if fn(x.data_ptr(), rows, x.stride(0) if rows > 1 else self.k, self.panels.data_ptr(), self.k, self.n,
              self.bias.data_ptr() if self.bias is not None else None, y.data_ptr(), self.n,
              cpu_threads.parts(2.0 * rows * self.k * self.n, panels)):
            raise MemoryError(f"gemm: no scratch for {rows} x {self.k} floats")
        return y
