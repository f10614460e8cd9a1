"""A sum all-reduce between the tensor-parallel ranks of one CPU host, through shared memory.

Why: gloo moves each all-reduce over TCP on loopback, ~0.7 ms for a 32 KB decode-step tensor on the 2-core
box, which took a third of a TP-2 decode step (BENCHMARKS.md). Here each rank copies its tensor into its own
slot of a /dev/shm segment, publishes a call counter, waits (spinning: every rank has a core of its own) until
every rank published the same call, and sums the slots in rank order, so every rank computes bit-identical
results (vLLM's CPU backend does the same kind of thing in C++).

Two sets of slots alternate by call parity: a rank can run at most one call ahead of the slowest (it waits
for everyone's counter each call), so it never overwrites a slot another rank is still reading.
Ordering: data is written before the counter and read after it; x86-64 keeps stores in order and loads in
order (TSO), which this relies on, so other architectures keep gloo (`available()`). A tensor larger than the
slots, or a dead peer (`alive()` false) or a wait past `timeout_s`, is the caller's to handle: the call
returns False for the first, raises RuntimeError for the others.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, Optional

import torch

from pdlab.kv import shm

SLOT_ALIGN = 64
COUNTER_STRIDE = 8  # int64s per rank's counter: one cache line each, no false sharing


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    def __init__(self, name: str, rank: int, world: int, capacity_bytes: int, create: bool,
                 alive: Optional[Callable[[], bool]] = None, timeout_s: float = 300.0):
        self.rank, self.world, self.alive, self.timeout_s = rank, world, alive, timeout_s
        self.capacity = -(-capacity_bytes // SLOT_ALIGN) * SLOT_ALIGN
        header = world * COUNTER_STRIDE * 8
        total = header + 2 * world * self.capacity
        self.segment = (shm.create((total,), torch.uint8, name=name) if create else
                        shm.attach(name, (total,), torch.uint8))
        buf = self.segment.tensor
        if create:
            buf[:header].zero_()
        self.counters = buf[:header].view(torch.int64)
        self.data = buf[header:]
        self.calls = 0

    def _slot(self, parity: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        off = (parity * self.world + rank) * self.capacity
        return self.data[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

    def __call__(self, t: torch.Tensor) -> bool:
        """Sum `t` over the ranks, in place; False (nothing done) when it does not fit the slots."""
        if t.numel() * t.element_size() > self.capacity or not t.is_contiguous() or t.device.type != "cpu":
            return False
        self.calls += 1
        n, parity = self.calls, self.calls % 2
        self._slot(parity, self.rank, t).copy_(t)
        self.counters[self.rank * COUNTER_STRIDE] = n  # published after the data
        deadline = None
        for r in range(self.world):
            spins = 0
            while int(self.counters[r * COUNTER_STRIDE]) < n:
                spins += 1
                if spins % 64 == 0:
                    os.sched_yield()  # a rank sharing its core with another process lets it run
                if spins % 20000 == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(f"all-reduce: rank {r} did not arrive within {self.timeout_s:g}s")
                    if self.alive is not None and not self.alive():
                        raise RuntimeError(f"all-reduce: a rank of the group died (waiting for rank {r})")
        t.copy_(self._slot(parity, 0, t))
        for r in range(1, self.world):
            t.add_(self._slot(parity, r, t))
        return True

    def close(self) -> None:
        if self.segment.owner:
            self.segment.unlink()
