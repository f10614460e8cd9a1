"""When a streamed chunk reached the client: the moment the client first saw its socket readable.

A client that stamps a chunk when its line has been read and parsed (as `vllm bench serve` does) adds to
every stamp the time its one event loop spent on other streams first: at 256 streams on a 2-core box that
queue is tens of milliseconds, and it is the client's, not the server's. pdlab's loop runs on an
`ArrivalSelector` instead, which notes when each socket was first seen readable:

- by the loop's own select(), and
- by a peek between two reads: a second epoll on the same sockets, edge-triggered (it reports a socket once
  per arrival of new bytes, however long the loop takes to read them), asked without waiting at every
  select and each time a stream takes what it was sent (`arrival`).

So a chunk's stamp is late by the work between two peeks, not by a whole loop iteration. And where the
kernel keeps receive times (Linux, SO_TIMESTAMPNS), not even by that: when a peek or select first sees a
socket readable, its stamp is the time the kernel received the first byte it holds unread, read with a
one-byte MSG_PEEK recvmsg that leaves the bytes where they are. A client descheduled for milliseconds (a
2-core box, a burst of 256 chunks to read) then still stamps each stream's next chunk when it reached the
machine. For TCP a later segment merged into an unread one moves that time later, never earlier.

What keeps stamps from ever being early: a socket's first-seen time is cleared when its stream takes what was
read (`arrival`, after a last peek), so what is seen after that arrived after that and belongs to a later
read. Where one read brought several chunks (the stream lagged), only the first gets the first-seen time; the
others get the time they are taken: late, never early. A stream's clock starts with a clear
(`clock_for`), so the response's headers are not taken for its first chunk.

The peek calls epoll_wait through ctypes.PyDLL, which keeps the GIL: select.epoll.poll() releases it even
to wait for nothing, and another thread (the harness's) may then hold it for a switch interval (5 ms).
Where epoll is missing (not Linux), or PDLAB_ARRIVAL_STAMPS=0, the loop is a plain one and chunks are
stamped when taken; PDLAB_ARRIVAL_STAMPS=peek keeps the peeks and leaves the kernel's times out.
benchmarks/bench_client.py measures the stamps against a server that notes when it sent each chunk.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import select
import selectors
import socket
import struct
import time
import weakref
from typing import Any, Callable, Optional

from pdlab.constants import ARRIVAL_STAMPS_ENV

# the stamp of what a stream takes now, given when the bytes holding it were handed to the stream
Clock = Callable[[float], float]
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

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # = SCM_TIMESTAMPNS, the control message's type
_PEEK_FLAGS = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0x40)
_CMSG_HEADER = 16  # struct cmsghdr on 64-bit Linux: size_t len, int level, int type
_CONTROL_BYTES = 64  # room for one struct timespec's control message


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(_Iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


def _gil_holding_recvmsg() -> Optional[Callable[..., int]]:
    if _epoll_wait is None:  # Linux, 64-bit: the structures above are its layout
        return None
    try:
        fn = ctypes.PyDLL(None).recvmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    fn.restype = ctypes.c_ssize_t
    return fn


_recvmsg = _gil_holding_recvmsg()


class ReceiveTimes:
    """The kernel's receive time (time.time()'s clock) of the first byte a socket holds unread: one MSG_PEEK
    recvmsg of one byte, non-blocking, through one message header made once. None where the socket holds
    nothing unread; 0.0 where it does but without a time (its bytes came before SO_TIMESTAMPNS was set)."""

    def __init__(self) -> None:
        self._byte = ctypes.create_string_buffer(1)
        self._control = ctypes.create_string_buffer(_CONTROL_BYTES)
        self._iov = _Iovec(ctypes.addressof(self._byte), 1)
        self._msg = _Msghdr(None, 0, ctypes.pointer(self._iov), 1, ctypes.addressof(self._control),
                            _CONTROL_BYTES, 0)
        self._ref = ctypes.byref(self._msg)

    def __call__(self, fd: int) -> Optional[float]:
        if _recvmsg is None:
            return None
        self._msg.controllen = _CONTROL_BYTES
        if _recvmsg(fd, self._ref, _PEEK_FLAGS) <= 0:
            return None
        if self._msg.controllen < _CMSG_HEADER + 16:
            return 0.0
        _, level, kind, sec, nsec = struct.unpack_from("=Qiiqq", self._control.raw)
        if level != socket.SOL_SOCKET or kind != SO_TIMESTAMPNS or sec <= 0:
            return 0.0
        return sec + nsec * 1e-9


def receive_stamps(sock: Any) -> bool:
    """Ask the kernel to note when each of `sock`'s segments arrives (SO_TIMESTAMPNS); False where it cannot."""
    if _recvmsg is None or os.environ.get(ARRIVAL_STAMPS_ENV, "1") in ("0", "peek"):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except (OSError, AttributeError):
        return False
    return True


class ArrivalSelector(selectors.EpollSelector):  # type: ignore[misc,valid-type]  # Linux only (new_loop)
    """Linux's epoll selector, noting when each socket was first seen readable since its stream last took
    its bytes (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._peek = select.epoll()
        self._events = (_EpollEvent * PEEK_EVENTS)()
        self.first: dict[int, float] = {}  # fd -> first seen readable since its stream last took its bytes
        self.kernel: set[int] = set()  # fds whose sockets note receive times (receive_stamps)
        self._received = ReceiveTimes()

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
        self.kernel.discard(key.fd)  # a new socket on a reused number notes receive times only once asked
        if events & selectors.EVENT_READ:
            self._watch(key.fd)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self.first.pop(key.fd, None)
        self.kernel.discard(key.fd)
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
                self._seen(key.fd, t)
        return events

    def peek(self) -> float:
        """Note the sockets that received bytes since the last peek; returns this peek's time."""
        n = _epoll_wait(self._peek.fileno(), self._events, PEEK_EVENTS, 0) if _epoll_wait else 0
        t = time.monotonic()
        first, got = self.first, self._events
        for i in range(n):
            fd = got[i].fd
            if fd not in first:
                self._seen(fd, t)
        return t

    def _seen(self, fd: int, t: float) -> None:
        """fd seen readable at t: its first-seen time is t, or when the kernel received its first unread byte
        where it notes that (no later than t). Nothing unread (the bytes were read already): nothing to stamp."""
        if fd not in self.kernel:
            self.first[fd] = t
            return
        received = self._received(fd)
        if received is not None:
            self.first[fd] = min(t, received - (time.time() - time.monotonic())) if received else t

    def stamp_in_kernel(self, sock: Any) -> None:
        """Stamp `sock`'s bytes with the kernel's receive times from now on, where it can (receive_stamps)."""
        if receive_stamps(sock):
            self.kernel.add(sock.fileno())

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
    takes with the time the bytes holding the chunk were handed to the stream: arrival stamps where the loop
    came from `new_loop`, else the time the chunk is taken (as `vllm bench serve` stamps).

    An arrival stamp is the selector's (`ArrivalSelector.arrival`), no later than the hand-over (a chunk whose
    first-seen time went to the chunk before it, in the same bytes, was there by then), and no earlier than
    the stream's stamp before it: a chunk stamped late by the hand-over can be followed by one whose kernel
    receive time is earlier still (it arrived while the first waited), and a stream's stamps never go back."""
    if transport is not None and getattr(transport, "max_size", 0) > READ_SIZE:
        transport.max_size = READ_SIZE
    selector = _SELECTORS.get(asyncio.get_running_loop())
    sock = transport.get_extra_info("socket") if transport is not None else None
    if selector is None or sock is None:
        return lambda handed: time.monotonic()
    fd = sock.fileno()
    selector.stamp_in_kernel(sock)
    selector.arrival(fd)  # a clear start: what was seen so far (the headers) is not the stream's
    last = [-math.inf]

    def clock(handed: float) -> float:
        t = max(min(selector.arrival(fd), handed), last[0])
        last[0] = t
        return t

    return clock
