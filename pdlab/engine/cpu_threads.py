"""How many threads one call of pdlab's C kernels runs on, in a process with more than one torch thread (a CPU
worker given two cores, the benchmark matrix's two-thread cells).

The threaded kernels (pdlab.engine.kernel_build.THREADED) split a call into parts inside C, on an OpenMP team
of torch's own runtime: the parts run on torch's intra-op threads, which are awake between torch's ops anyway,
with no Python in between. Each part computes what it would compute alone (a GEMM's panels, one request's
attention), so the bits do not depend on the number of parts.

Why the check on runtimes: where torch came with another OpenMP runtime than the one the kernels link (Intel's
or LLVM's, say), the process would hold two, and each one's threads would spin against the other's; there a
call runs in one part.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

SPLIT_FLOPS = 5e5  # a call of this much arithmetic or more is split: at 0.5 MFLOP (20-30 us) two parts still paid
RUNTIMES = ("libgomp", "libomp", "libiomp")  # file names of OpenMP runtimes, as they begin
_one_runtime: Optional[tuple[int, bool]] = None  # (pid, answer): a forked child asks again


def openmp_runtimes(maps: str = "/proc/self/maps") -> set[str]:
    """The OpenMP runtime libraries mapped into this process (their real paths); raises OSError where the
    process's maps cannot be read."""
    found = set()
    with open(maps) as f:
        for line in f:
            path = line.split(maxsplit=5)[-1].strip()  # the file's path where a line has one
            if path.startswith("/") and os.path.basename(path).startswith(RUNTIMES):
                found.add(os.path.realpath(path))
    return found


def one_runtime() -> bool:
    """Whether this process holds at most one OpenMP runtime (asked once per process; no where it cannot tell)."""
    global _one_runtime
    if _one_runtime is None or _one_runtime[0] != os.getpid():
        try:
            answer = len(openmp_runtimes()) <= 1
        except OSError:
            answer = False
        _one_runtime = (os.getpid(), answer)
    return _one_runtime[1]


def parts(flops: float, most: int) -> int:
    """How many parts a call of `flops` arithmetic goes in: one per torch thread, at most `most`, none smaller
    than SPLIT_FLOPS; one where the process holds more than one OpenMP runtime."""
    n = max(1, min(torch.get_num_threads(), most, int(flops // SPLIT_FLOPS)))
    return n if n == 1 or one_runtime() else 1
