"""Streams that went silent: one watchdog per event loop breaks off a stream that received no byte for its
limit, instead of aiohttp's `sock_read` timeout.

Why not aiohttp's: it re-arms a timer on every read (cancel the old TimerHandle, push a new one on the loop's
heap): with this watchdog instead, the client's CPU per chunk fell 10-15% on the developers' box (79-87
against 72-73 us, 256 spread streams at 5,120 chunks/s, alternated; BENCHMARKS.md, issue 19). Here a read
costs one clock read and a store; the watchdog looks at every watched stream a few times per limit (so a
silent stream is broken off between its limit and 1.25 times it) and only while some stream is watched.

A stream it breaks off is cancelled; the stream's own code turns that into its timeout error (`expired`).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Optional

TICKS_PER_LIMIT = 4  # looks per limit: a silent stream ends within limit * (1 + 1/TICKS_PER_LIMIT)
MIN_TICK_S = 0.01


class Watchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.watched: dict[asyncio.Task, tuple[float, list[float]]] = {}  # task -> (limit, [last byte's time])
        self.broken: set[asyncio.Task] = set()
        self._timer: Optional[asyncio.TimerHandle] = None

    def watch(self, task: asyncio.Task, limit_s: float) -> list[float]:
        """Watch `task`; the caller stores time.monotonic() in the returned list's one slot at every read."""
        beat = [time.monotonic()]
        self.watched[task] = (limit_s, beat)
        self.broken.discard(task)
        if self._timer is None:
            self._arm()
        return beat

    def forget(self, task: asyncio.Task) -> None:
        self.watched.pop(task, None)
        self.broken.discard(task)

    def expired(self, task: asyncio.Task) -> bool:
        """Whether the watchdog cancelled `task` (then its cancellation is a timeout, not the caller's)."""
        return task in self.broken

    def _arm(self) -> None:
        tick = max(MIN_TICK_S, min(limit for limit, _ in self.watched.values()) / TICKS_PER_LIMIT)
        self._timer = self.loop.call_later(tick, self._tick)

    def _tick(self) -> None:
        self._timer = None
        now = time.monotonic()
        for task, (limit, beat) in list(self.watched.items()):
            if task.done():
                self.forget(task)
            elif now - beat[0] > limit and task not in self.broken:
                self.broken.add(task)
                task.cancel()
        if self.watched:
            self._arm()


_dogs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Watchdog]" = weakref.WeakKeyDictionary()


def watchdog() -> Watchdog:
    """The running loop's watchdog (made on first use)."""
    loop = asyncio.get_running_loop()
    dog = _dogs.get(loop)
    if dog is None:
        dog = _dogs[loop] = Watchdog(loop)
    return dog
