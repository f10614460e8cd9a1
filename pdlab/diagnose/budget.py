"""The gate every request of a diagnosis passes before it is sent: the plan's caps, enforced.

`take` waits for a free slot under the concurrency cap and for the rate cap's spacing, then counts the
request and its tokens (prompt + max_tokens, what the server may be asked to do) against the plan's totals.
It refuses (Exhausted) what would go past a total, anything after the deadline, and anything once the
diagnosis is stopping (Ctrl-C, the duration cap): then nothing more is sent. All on the client's event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from pdlab.diagnose.plan import Plan


class Exhausted(Exception):
    """A send the plan does not allow; the reason in words."""


class Budget:
    def __init__(self, plan: Plan, clock: Callable[[], float] = time.monotonic):
        self.plan, self.caps, self.clock = plan, plan.caps, clock
        self.requests = self.tokens = self.in_flight = self.max_in_flight = 0
        self.by_kind: dict[str, int] = {}
        self.background = 0
        self.started: Optional[float] = None
        self.stopped: Optional[str] = None  # why nothing more is sent
        self._next_send = 0.0  # the next turn reserved
        self._last_send = -1e18  # when the last request actually went
        self._cond = asyncio.Condition()

    @property
    def deadline(self) -> float:
        return (self.started if self.started is not None else self.clock()) + self.caps.duration_s

    def stop(self, why: str) -> None:
        self.stopped = self.stopped or why

    async def take(self, kind: str, tokens: int) -> float:
        """Wait until `kind`'s request of `tokens` (prompt + max_tokens) may go; Exhausted when it may not. Returns
        the send time: at least 1/rate after the previous one's, whatever the sleeps overshot. The request is
        counted, and its turn reserved, under the lock: two senders never share a slot."""
        async with self._cond:
            while True:
                self._refuse(kind, tokens)
                if self.in_flight < self.plan.completion_slots:
                    break
                try:
                    await asyncio.wait_for(self._cond.wait(), max(0.0, self.deadline - self.clock()))
                except asyncio.TimeoutError:
                    pass  # the deadline: refused on the next pass
            at = max(self.clock(), self._next_send)
            self._next_send = at + 1.0 / self.caps.rate
            self.in_flight += 1  # the slot is held from here, through the wait for the spacing
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._count(kind, tokens, +1)
        try:
            while (wait := max(at, self._last_send + 1.0 / self.caps.rate) - self.clock()) > 0:
                await asyncio.sleep(wait)
            self._closed()
        except BaseException:
            self._count(kind, tokens, -1)
            await self.release()
            raise
        now = self._last_send = self.clock()  # no await between the check above and this: one sender at a time
        if self.started is None:
            self.started = now
        return now

    def _count(self, kind: str, tokens: int, sign: int) -> None:
        self.requests += sign
        self.tokens += sign * tokens
        self.by_kind[kind] = self.by_kind.get(kind, 0) + sign
        self.background += sign * (kind == "background")

    def _closed(self) -> None:
        if self.started is not None and self.clock() >= self.deadline:
            self.stop(f"the duration cap ({self.caps.duration_s:g} s) was reached")
        if self.stopped:
            raise Exhausted(self.stopped)

    def _refuse(self, kind: str, tokens: int) -> None:
        self._closed()
        if self.tokens + tokens > self.caps.tokens:
            raise Exhausted(f"the token cap ({self.caps.tokens}) would be passed")
        if kind == "background" and self.background >= self.plan.background_max:
            raise Exhausted(f"the plan's {self.plan.background_max} background requests were sent")

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    async def wake(self) -> None:
        """Let waiting senders see a stop."""
        async with self._cond:
            self._cond.notify_all()

    def to_dict(self) -> dict:
        return {"requests": self.requests, "tokens": self.tokens, "max_in_flight": self.max_in_flight,
                "by_kind": dict(self.by_kind), "stopped": self.stopped}
