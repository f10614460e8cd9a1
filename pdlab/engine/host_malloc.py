"""glibc malloc settings for a CPU engine process: keep large activations on the heap.

A CPU step allocates activations of megabytes ([tokens, hidden] and [tokens, intermediate] tensors) and
frees them a moment later. glibc serves blocks above its mmap threshold with fresh mmaps, so a step pays
page faults on memory it used a step ago, and it trims the heap top back to the system once it is free.
Raising the mmap threshold to its maximum and the trim threshold far above a step's working set keeps
those blocks in the heap, reused without faults. vLLM's CPU guide gets the same effect by preloading
tcmalloc; mallopt needs no extra library and no LD_PRELOAD. Measured on benchmarks/bench_vllm.py's pdlab
side (BENCHMARKS.md): about 4% of the offline time on one core.

The cost is freed memory not returned to the system while the process lives, which an inference worker
uses again at its next step anyway. `PDLAB_MALLOC_TUNE=0` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

from pdlab.constants import MALLOC_TUNE_ENV

# mallopt's parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top
TOP_PAD = 64 << 20  # grow the heap in steps of this much: fewer brk calls

_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings once per process; True when they are in effect (glibc on Linux, not disabled)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux") or os.environ.get(MALLOC_TUNE_ENV, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all(mallopt(k, v) == 1 for k, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                    (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _applied
