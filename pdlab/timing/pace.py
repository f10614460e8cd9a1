"""The box's pace: one fixed computation, timed where steps run, so that a profile and a later run can say how
fast the box was for each.

Why: on a shared VM the same step takes longer minutes later. On the developers' 2-core box, decode steps of
one shape drifted from 13 to 21 ms within one benchmark, and a run's steps took x1.2-1.3 their profile's
prediction while the profile fitted its own held-out steps with R² 0.98 (BENCHMARKS.md, issue 25). A profile
measured before a run cannot predict that drift. What this gives is a figure to read beside the miss: the
profile records its pace, every CPU worker times the same computation when it starts (its Ready message;
env.json's `worker_pace_ms`, and `worker_memory_pace_ms` for the memory half), and `pdlab profile --check`
shows the ratio of the two with the steps' measured / predicted. It is a snapshot at the workers' start, tens of
milliseconds long, and the box drifts within a run: on the developers' box it matched the steps' ratio in some
runs and not in others (BENCHMARKS.md), so it is shown, not used to correct anything.

The computation: a decode-sized GEMM (32 x 1024 -> 1024, float32) and a read of 32 MiB (more than a core's
own caches, as a step's weights and KV), on the process's own threads; the median of PACE_REPS after a
warm-up, a few tens of milliseconds. It is a CPU figure: a GPU worker's steps do not follow it, and only CPU
paces are taken.

The two halves are timed apart as well (`Pace.compute_ms`, `Pace.memory_ms`), since they drift apart: on the
developers' 2-core Xeon a small decode step (mostly fixed and GEMM time) ranged x1.97 over 170 s while one over
32,000 context tokens (mostly KV reads) ranged x1.46, their ratio 2.0-3.7, and a profile's context_token_ms read
0.219 us a token where one 30 minutes later read 0.270 while the combined pace held within 4% (BENCHMARKS.md,
2026-12-07). The memory half is what the KV reads of a long-context step follow; `pdlab profile --check` shows
both ratios, and `pdlab profile` warns when either moved while it measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

PACE_REPS = 9
GEMM = (32, 1024, 1024)  # rows, in, out
READ_FLOATS = 8 << 20  # 32 MiB of float32


@dataclass(frozen=True)
class Pace:
    """The fixed computation's two halves, each the median of PACE_REPS timings in ms."""

    compute_ms: float  # the GEMM (its operands fit a core's caches)
    memory_ms: float  # the 32 MiB read

    @property
    def total_ms(self) -> float:
        """The whole computation: a profile's and a worker's `pace_ms`. The sum of the halves' medians (before
        2026-12-07 the median of the whole, timed at once: the same figure within the box's noise)."""
        return self.compute_ms + self.memory_ms


def measure() -> Pace:
    """The fixed computation timed in this process, half by half, alternated (one of each per repetition), so
    that both halves see the same moments of the box."""
    import torch  # deferred: torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    rows, k, n = GEMM
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    big = torch.ones(READ_FLOATS)
    halves = (lambda: F.linear(x, w), big.sum)
    times: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        for f in halves:  # warm-up
            f()
        for _ in range(PACE_REPS):
            for f, ts in zip(halves, times):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
    return Pace(statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3)


def ratio(run_ms: Optional[list[float]], profile_ms: Optional[float]) -> Optional[float]:
    """The run's pace over the profile's (the median over the run's workers): 1.25 = the box took 25% longer
    for the same computation during the run. None where either is missing."""
    ms = [x for x in (run_ms or []) if x and x > 0]
    if not ms or not profile_ms or profile_ms <= 0:
        return None
    return statistics.median(ms) / profile_ms
