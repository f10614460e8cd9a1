"""Helper threads for pdlab's C kernels in a process with more than one torch thread (a CPU worker given two
cores, the benchmark matrix's two-thread cells): ctypes releases the GIL during a call, so the parts of one
kernel call run on as many cores. Each part computes what it would compute alone (a GEMM's panels), so the
bits do not depend on the thread count.

Why not OpenMP in the C: torch ships its own OpenMP runtime, and a second one in the same process would spin
its threads against torch's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

SPLIT_FLOPS = 4e6  # a kernel call of this much arithmetic or more is split (about 0.1 ms of one core)
_pool: Optional[tuple[int, int, ThreadPoolExecutor]] = None  # (pid, workers, pool): a forked child makes its own


def parts(flops: float, most: int) -> int:
    """How many parts a call of `flops` arithmetic goes in: one per torch thread, at most `most`, none smaller
    than SPLIT_FLOPS."""
    return max(1, min(torch.get_num_threads(), most, int(flops // SPLIT_FLOPS)))


def cuts(items: int, n: int) -> list[int]:
    """n + 1 indices cutting `items` into n contiguous runs whose sizes differ by at most one."""
    return [items * i // n for i in range(n + 1)]


def pool(workers: int) -> ThreadPoolExecutor:
    """This process's helper threads, at least `workers` of them: made on first use, again after a fork or when
    more are wanted, and otherwise kept (a call that wants fewer submits fewer parts)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
        _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="pdlab-kernel"))
    return _pool[2]


def run(calls: list[Callable[[], Optional[int]]]) -> int:
    """calls[0] on this thread and the others on helper threads, all at once; the first non-zero result of
    them (a C kernel's error code), else 0."""
    if len(calls) == 1:
        return calls[0]() or 0
    rest = [pool(len(calls) - 1).submit(c) for c in calls[1:]]
    first = calls[0]()
    results = [first] + [f.result() for f in rest]
    return next((r for r in results if r), 0)
