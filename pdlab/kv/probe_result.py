"""What a transport probe measured (pdlab.kv.probe, pdlab.kv.nixl_probe), and the timing both use."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass
class ProbeResult:
    transport: str
    available: bool
    note: str = ""  # why unavailable, or what path it takes
    bytes: int = 0
    blocks: int = 0
    handover_gbps: float = 0.0
    baseline_gbps: float = 0.0
    baseline: str = ""

    @property
    def ratio(self) -> float:
        return self.handover_gbps / self.baseline_gbps if self.baseline_gbps else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


def best_of(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()  # warm-up: first touch of pages, allocator, lazy init
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best
