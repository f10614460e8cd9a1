"""The box's pace: one fixed computation, timed where steps run, so that a profile and a later run can say how
fast the box was for each.

Why: on a shared VM the same step takes longer minutes later. On the developers' 2-core box, decode steps of
one shape drifted from 13 to 21 ms within one benchmark, and a run's steps took x1.2-1.3 their profile's
prediction while the profile fitted its own held-out steps with R² 0.98 (BENCHMARKS.md, issue 25). A profile
measured before a run cannot predict that drift. What this gives is a figure to read beside the miss: the
profile records its pace, every CPU worker times the same computation when it starts (its Ready message;
env.json's `worker_pace_ms`), and `pdlab profile --check` shows the ratio of the two with the steps'
measured / predicted. It is a snapshot at the workers' start, tens of milliseconds long, and the box drifts
within a run: on the developers' box it matched the steps' ratio in some runs and not in others
(BENCHMARKS.md), so it is shown, not used to correct anything.

The computation: a decode-sized GEMM (32 x 1024 -> 1024, float32) and a read of 32 MiB (more than a CPU's
cache, as a step's weights and KV), on the process's own threads; the median of PACE_REPS after a warm-up,
a few tens of milliseconds. It is a CPU figure: a GPU worker's steps do not follow it, and only CPU paces are
taken.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

PACE_REPS = 9
GEMM = (32, 1024, 1024)  # rows, in, out
READ_FLOATS = 8 << 20  # 32 MiB of float32


def pace_ms() -> float:
    """The median time of the fixed computation in this process, in ms."""
    import torch  # deferred: torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    rows, k, n = GEMM
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    big = torch.ones(READ_FLOATS)

    def once() -> None:
        F.linear(x, w)
        big.sum()

    with torch.inference_mode():
        once()
        times = []
        for _ in range(PACE_REPS):
            t = time.perf_counter()
            once()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def ratio(run_ms: Optional[list[float]], profile_ms: Optional[float]) -> Optional[float]:
    """The run's pace over the profile's (the median over the run's workers): 1.25 = the box took 25% longer
    for the same computation during the run. None where either is missing."""
    ms = [x for x in (run_ms or []) if x and x > 0]
    if not ms or not profile_ms or profile_ms <= 0:
        return None
    return statistics.median(ms) / profile_ms
