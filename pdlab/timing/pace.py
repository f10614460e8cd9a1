"""The box's pace: one fixed computation, timed where steps run, so that a profile and a later run can say how
fast the box was for each.

Why: on a shared VM the same step takes longer minutes later. On the developers' 2-core box, decode steps of
one shape drifted from 13 to 21 ms within one benchmark, and a run's steps took x1.2-1.3 their profile's
prediction while the profile fitted its own held-out steps with R² 0.98 (BENCHMARKS.md, issue 25). A profile
measured before a run cannot predict that drift. What this gives is a figure to read beside the miss: the
profile records its pace, every CPU worker times the same computation when it starts (its Ready message;
env.json's `worker_pace_ms`, `worker_memory_pace_ms` for the memory half and `worker_pace_read_mib` for the
read it timed), and `pdlab profile --check`
shows the ratio of the two with the steps' measured / predicted. It is a snapshot at the workers' start, a tenth
of a second long, and the box drifts within a run: on the developers' box it matched the steps' ratio in some
runs and not in others (BENCHMARKS.md), so it is shown, not used to correct anything.

The computation: a decode-sized GEMM (32 x 1024 -> 1024, float32) and a read of READ_MIB MiB (beyond what a core
gets of the last-level cache, as a step's weights and KV are), on the process's own threads; the median of
PACE_REPS after a warm-up, about a tenth of a second. It is a CPU figure: a GPU worker's steps do not follow it,
and only CPU paces are taken.

The two halves are timed apart as well (`Pace.compute_ms`, `Pace.memory_ms`), since they drift apart: on the
developers' 2-core Xeon a small decode step (mostly fixed and GEMM time) ranged x1.97 over 170 s while one over
32,000 context tokens (mostly KV reads) ranged x1.46, their ratio 2.0-3.7 (BENCHMARKS.md, 2026-12-07).
`pdlab profile --check` shows both ratios, and `pdlab profile` warns when either moved while it measured.

Why READ_MIB is 128 and not 32, as it was until 2026-12-07 (sixth session): the Xeon's 32 MiB read ran from its
L3 (19 GiB/s) and did not follow the steps; 128 MiB and more ran at DRAM speed (11 GiB/s), as the steps' reads
do. Sampled every 1.6 s for 14 minutes in one pinned process beside decode steps of two models (cpu-demo and a
51.6M-parameter Llama shape, short and long contexts), over 16-second windows: the 32 MiB read's correlation
with the steps' time was 0.20-0.35, the 128, 256 and 512 MiB reads' 0.82-0.90, the GEMM's 0.78-0.85; as a
predictor of the next minute's steps the 32 MiB read more than doubled their spread (BENCHMARKS.md). A profile
or run that timed the old read says so (`pace_read_mib` absent) and its pace is not set beside a new one.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

PACE_REPS = 9
GEMM = (32, 1024, 1024)  # rows, in, out
READ_MIB = 128  # the memory half's read (the docstring: why not 32)
OLD_READ_MIB = 32  # what profiles and runs timed before they kept `pace_read_mib`
READ_FLOATS = READ_MIB << 18  # float32


@dataclass(frozen=True)
class Pace:
    """The fixed computation's two halves, each the median of PACE_REPS timings in ms, and the read the memory
    half timed. The read travels with the figures (a worker's Ready message, env.json's worker_pace_read_mib)
    so that a worker started from another checkout is recorded with the read it timed, not the harness's."""

    compute_ms: float  # the GEMM (its operands fit a core's caches)
    memory_ms: float  # the read of read_mib MiB
    read_mib: int = READ_MIB

    def to_raw(self) -> dict:
        """Plain data for a message: {compute_ms, memory_ms, read_mib}."""
        return {"compute_ms": self.compute_ms, "memory_ms": self.memory_ms, "read_mib": self.read_mib}

    @classmethod
    def from_raw(cls, raw: Any) -> Optional["Pace"]:
        """A Pace from `to_raw`'s data; None for anything else (two times > 0 and a read > 0 as an integer): a
        pace is a figure shown beside a run, not a reason to refuse a worker."""
        if not isinstance(raw, dict) or set(raw) != {"compute_ms", "memory_ms", "read_mib"}:
            return None
        times, mib = (raw["compute_ms"], raw["memory_ms"]), raw["read_mib"]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in times):
            return None
        if not isinstance(mib, int) or isinstance(mib, bool) or mib <= 0:
            return None
        return cls(float(times[0]), float(times[1]), mib)

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
    return Pace(statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3, READ_MIB)


def same_read(profile_mib: Optional[int], run_mib: Optional[int]) -> bool:
    """Whether a profile's pace and a run's workers' timed the same read (None: before either kept it, OLD_READ_MIB),
    so that one can be set beside the other."""
    return (profile_mib or OLD_READ_MIB) == (run_mib or OLD_READ_MIB)


def ratio(run_ms: Optional[list[float]], profile_ms: Optional[float]) -> Optional[float]:
    """The run's pace over the profile's (the median over the run's workers): 1.25 = the box took 25% longer
    for the same computation during the run. None where either is missing."""
    ms = [x for x in (run_ms or []) if x and x > 0]
    if not ms or not profile_ms or profile_ms <= 0:
        return None
    return statistics.median(ms) / profile_ms
