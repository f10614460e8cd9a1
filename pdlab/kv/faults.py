"""Fault injection into KV hand-overs. TESTING ONLY: off unless the environment variable is set.

    PDLAB_KV_FAULT=drop|delay|corrupt[:n]     every hand-over, or every n-th, that a decode worker receives

It sits where every transport's hand-over ends: the decode worker's notice that a request's KV has landed
in the blocks it reserved (`Landing`: a pull copy that ended, or a push's `Admit`). Whatever moved the bytes
(shm, cuda-ipc, host, nixl), the worker admits a request only through that notice, so one injection point
covers them all:

- `drop`: the notice is lost, as if the transfer never completed: the reservation's lease must run out.
- `delay`: the notice arrives twice `transfer_timeout_s` late, after the lease ran out: it must be ignored.
- `corrupt`: the notice names blocks other than those reserved: it must be refused, never admitted.

Workers inherit the variable from the main process (spawn copies the environment), so a test sets it
around `Cluster.start()` or a `pdlab run` subprocess.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Optional

from pdlab.constants import KV_FAULT_ENV, KV_FAULT_KINDS


@dataclass(frozen=True)
class Landing:
    """A transfer's completion notice on the decode side: the KV of `req_id` is in `blocks`."""

    req_id: str
    blocks: tuple[int, ...]  # the decode blocks written (the reservation's, less its cached prefix)
    first_token: Optional[int]
    record: Optional[dict] = None  # the transfers.jsonl line (pull: made here; push: the prefill's)


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    every: int = 1

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        kind, _, n = text.strip().partition(":")
        if kind not in KV_FAULT_KINDS or (n and (not n.isdigit() or int(n) < 1)):
            raise ValueError(f"{KV_FAULT_ENV}={text!r}: expected {'|'.join(KV_FAULT_KINDS)}[:n] with n >= 1")
        return cls(kind, int(n) if n else 1)


class FaultInjector:
    """Passes landings through, except the ones the fault spec picks. `delay_s`: how late a delayed one is."""

    def __init__(self, spec: Optional[FaultSpec], delay_s: float):
        self.spec, self.delay_s = spec, delay_s
        self.count = 0
        self.held: list[tuple[float, Landing]] = []  # delayed landings and when they are due

    @classmethod
    def from_env(cls, transfer_timeout_s: float) -> "FaultInjector":
        text = os.environ.get(KV_FAULT_ENV, "")
        return cls(FaultSpec.parse(text) if text else None, 2 * transfer_timeout_s)

    def filter(self, landing: Landing) -> Optional[Landing]:
        """The landing to act on now (possibly corrupted), or None (dropped, or held back)."""
        if self.spec is None:
            return landing
        self.count += 1
        if self.count % self.spec.every:
            return landing
        if self.spec.kind == "drop":
            return None
        if self.spec.kind == "delay":
            self.held.append((time.monotonic() + self.delay_s, landing))
            return None
        return replace(landing, blocks=tuple(b + 1 for b in landing.blocks) or (-1,))  # corrupt

    def due(self) -> list[Landing]:
        """Delayed landings whose time has come."""
        if not self.held:
            return []
        now = time.monotonic()
        out = [x for t, x in self.held if t <= now]
        self.held = [(t, x) for t, x in self.held if t > now]
        return out
