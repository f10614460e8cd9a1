"""When a streamed chunk reached the client: the moment the client first saw its socket readable.

A client that stamps a chunk when its line has been read and parsed (as `vllm bench serve` does) adds to
every stamp the time its one event loop spent on other streams first: at 256 streams on a 2-core box that
queue is tens of milliseconds, and it is the client's, not the server's. pdlab's loop runs on an
`ArrivalSelector` instead, which notes when each socket was first seen readable:

- by the loop's own select(), and
- by a peek between two reads: a second epoll on the same sockets, edge-triggered (it reports a socket once
  per arrival of new bytes, however long the loop takes to read them), asked without waiting at every
  select and each time a stream takes what it was sent (`arrival`).

So a chunk's stamp is late by the work between two peeks, not by a whole loop iteration.

What keeps stamps from ever being early: a socket's first-seen time is cleared when its stream takes what was
read (`arrival`, after a last peek), so what is seen after that arrived after that and belongs to a later
read. Where one read brought several chunks (the stream lagged), only the first gets the first-seen time; the
others get the time they are taken: late, never early. A stream's clock starts with a clear
(`clock_for`), so the response's headers are not taken for its first chunk.

The peek calls epoll_wait through ctypes.PyDLL, which keeps the GIL: select.epoll.poll() releases it even
to wait for nothing, and another thread (the harness's) may then hold it for a switch interval (5 ms).
Where epoll is missing (not Linux), or PDLAB_ARRIVAL_STAMPS=0, the loop is a plain one and chunks are
stamped when taken.
benchmarks/bench_client.py measures the stamps against a server that notes when it sent each chunk.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import select
import selectors
import time
import weakref
from typing import Any, Callable, Optional

from pdlab.constants import ARRIVAL_STAMPS_ENV

Clock = Callable[[], float]  # the stamp of what a stream takes now
PEEK_EVENTS = 1024  # sockets reported by one peek; more wait for the next
# asyncio's socket transport reads with recv(max_size), 256 KiB by default: a fresh 256 KiB buffer per read,
# which glibc takes from the top of the heap and gives back (trims) when the buffer shrinks to the bytes read.
# On the developers' VM that cost 32 us a read against 4 us with 64 KiB (a chunk is a few hundred bytes).
READ_SIZE = 64 * 1024


class _EpollEvent(ctypes.Structure):  # struct epoll_event, packed on x86-64 (12 bytes)
    _pack_ = 1
    _fields_ = [("events", ctypes.c_uint32), ("fd", ctypes.c_int32), ("pad", ctypes.c_uint32)]


def _gil_holding_epoll_wait() -> Optional[Callable[..., int]]:
    if not hasattr(select, "epoll") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = ctypes.PyDLL(None).epoll_wait
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_epoll_wait = _gil_holding_epoll_wait()


class ArrivalSelector(selectors.EpollSelector):  # type: ignore[misc,valid-type]  # Linux only (new_loop)
    """Linux's epoll selector, noting when each socket was first seen readable since its stream last took
    its bytes (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._peek = select.epoll()
        self._events = (_EpollEvent * PEEK_EVENTS)()
        self.first: dict[int, float] = {}  # fd -> first seen readable since its stream last took its bytes

    def _watch(self, fd: int) -> None:
        flags = select.EPOLLIN | select.EPOLLET
        try:
            self._peek.register(fd, flags)
        except FileExistsError:
            self._peek.modify(fd, flags)

    def _unwatch(self, fd: int) -> None:
        try:
            self._peek.unregister(fd)
        except (OSError, ValueError):
            pass  # closed already: epoll dropped it

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = super().register(fileobj, events, data)
        self.first.pop(key.fd, None)
        if events & selectors.EVENT_READ:
            self._watch(key.fd)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self.first.pop(key.fd, None)
        self._unwatch(key.fd)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        was = self.get_key(fileobj).events & selectors.EVENT_READ
        key = super().modify(fileobj, events, data)
        if events & selectors.EVENT_READ and not was:
            self._watch(key.fd)
        elif was and not events & selectors.EVENT_READ:
            self._unwatch(key.fd)
        return key

    def select(self, timeout: Any = None) -> list:
        events = super().select(timeout)
        t = self.peek()
        first = self.first
        for key, mask in events:
            if mask & selectors.EVENT_READ and key.fd not in first:
                first[key.fd] = t
        return events

    def peek(self) -> float:
        """Note the sockets that received bytes since the last peek; returns this peek's time."""
        n = _epoll_wait(self._peek.fileno(), self._events, PEEK_EVENTS, 0) if _epoll_wait else 0
        t = time.monotonic()
        first, got = self.first, self._events
        for i in range(n):
            fd = got[i].fd
            if fd not in first:
                first[fd] = t
        return t

    def arrival(self, fd: int) -> float:
        """The stamp of what fd's stream takes now: its first-seen time, which this clears (so a second chunk
        of the same read, taken next, gets the time it is taken)."""
        t = self.peek()
        return self.first.pop(fd, t)

    def close(self) -> None:
        self._peek.close()
        super().close()


_SELECTORS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ArrivalSelector]" = weakref.WeakKeyDictionary()


def new_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose reads are stamped on arrival (`clock_for`); a plain one where epoll is missing or
    PDLAB_ARRIVAL_STAMPS=0 asks for stamps when taken."""
    if _epoll_wait is None or os.environ.get(ARRIVAL_STAMPS_ENV, "1") == "0":
        return asyncio.new_event_loop()
    selector = ArrivalSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _SELECTORS[loop] = selector
    return loop


def clock_for(transport: Any) -> Clock:
    """The clock of one stream read from `transport` on the running loop, called once for each chunk it
    takes: arrival stamps where the loop came from `new_loop`, else the time the chunk is taken."""
    if transport is not None and getattr(transport, "max_size", 0) > READ_SIZE:
        transport.max_size = READ_SIZE
    selector = _SELECTORS.get(asyncio.get_running_loop())
    sock = transport.get_extra_info("socket") if transport is not None else None
    if selector is None or sock is None:
        return time.monotonic
    fd = sock.fileno()
    selector.arrival(fd)  # a clear start: what was seen so far (the headers) is not the stream's
    return lambda: selector.arrival(fd)
