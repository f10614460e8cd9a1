"""pdlab.external.arrival: a streamed chunk is stamped with when its bytes reached the client, never before the
server sent it, and never after its stream took it; a chunk that waited while the loop served other streams
keeps its arrival time, where a stamp taken when read (PDLAB_ARRIVAL_STAMPS=0, as `vllm bench serve`) does not.

The server here is a thread with plain sockets that writes each stream's chunks when the test says, and notes
when it sent each (time.monotonic(), the clock of the stamps)."""

import asyncio
import concurrent.futures
import fcntl
import json
import socket
import struct
import termios
import threading
import time

import pytest

from pdlab.constants import ARRIVAL_STAMPS_ENV
from pdlab.external import arrival as arrival_mod
from pdlab.external.loop import ClientLoop
from pdlab.external.stream import stream_completion

HANDLER_S = 0.02  # how long each stream's chunk handler keeps the loop busy in the queueing test


class ChunkServer:
    """Accepts `streams` completions, answers each with event-stream headers, then sends chunks on command."""

    def __init__(self, streams: int):
        self.streams = streams
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/completions"
        self.conns: list[socket.socket] = []
        self.sent: dict[tuple[int, int], float] = {}  # (stream, index) -> send time
        self.ready = threading.Event()

    def accept(self) -> None:
        """In a thread: take every stream's request and answer its headers."""
        for _ in range(self.streams):
            conn, _ = self.listener.accept()
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            while len(body) < length:
                body += conn.recv(65536)
            stream = json.loads(body)["prompt"][0]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            self.conns.append((stream, conn))
        self.conns.sort()
        self.ready.set()

    def send(self, stream: int, index: int) -> None:
        data = json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [index]}]})
        self.sent[(stream, index)] = time.monotonic()
        self.conns[stream][1].sendall(f"data: {data}\n\n".encode())

    def delivered(self, timeout: float = 10.0) -> None:
        """Wait until every byte sent has reached the client's socket (acknowledged: nothing left in the send
        queue). A fixed sleep is not enough on a busy box, where loopback delivery can lag by tens of ms."""
        deadline = time.monotonic() + timeout
        for _, conn in self.conns:
            while _unsent(conn):
                assert time.monotonic() < deadline, "the client did not receive what was sent"
                time.sleep(0.001)

    def finish(self) -> None:
        for _, conn in self.conns:
            conn.sendall(b"data: [DONE]\n\n")
            conn.close()
        self.listener.close()


def warm_up(server: ChunkServer, handled) -> None:
    """Chunk 0 to every stream, and wait until all are handled: the client has read the response headers (a
    chunk that came in one read with them is stamped when taken: its stream's clock starts after them)."""
    for s in range(server.streams):
        server.send(s, 0)
    deadline = time.monotonic() + 30
    while handled() < server.streams:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _unsent(conn: socket.socket) -> int:
    """Bytes the kernel has not yet had acknowledged on `conn` (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def run_streams(server: ChunkServer, loop: ClientLoop, on_chunk) -> concurrent.futures.Future:
    async def all_streams():
        body = {"prompt": [0], "max_tokens": 1, "stream": True}
        return await asyncio.gather(*[
            stream_completion(loop.session, server.url, {**body, "prompt": [s]},
                              lambda ev, t, s=s: on_chunk(s, ev["choices"][0]["token_ids"][0], t))
            for s in range(server.streams)])

    return loop.submit(all_streams())


class Hold:
    """Keeps the client's loop busy (a blocking callback) from `start` until `release`."""

    def __init__(self, loop: ClientLoop):
        self.holding, self.released = threading.Event(), threading.Event()
        loop.loop.call_soon_threadsafe(self._hold)

    def _hold(self) -> None:
        self.holding.set()
        self.released.wait(10)

    def wait(self) -> "Hold":
        assert self.holding.wait(10)
        return self

    def release(self) -> None:
        self.released.set()


def start_streams(server: ChunkServer, loop: ClientLoop, on_chunk, handled) -> concurrent.futures.Future:
    """Every stream opened (the server accepts them in a thread) and its chunk 0 handled; `handled(i)` counts
    the streams that handled chunk i."""
    threading.Thread(target=server.accept, daemon=True).start()
    fut = run_streams(server, loop, on_chunk)
    assert server.ready.wait(30)
    warm_up(server, lambda: handled(0))
    return fut


def burst_while_held(server: ChunkServer, loop: ClientLoop, i: int, handled, held_s: float = 0.0) -> float:
    """Chunk i to every stream while the client's loop is held, delivered to its sockets before the loop can
    look, the loop released `held_s` later; returns when, after waiting until every stream handled chunk i."""
    hold = Hold(loop).wait()
    for s in range(server.streams):
        server.send(s, i)
    server.delivered()
    time.sleep(held_s)
    released = time.monotonic()
    hold.release()
    while handled(i) < server.streams:
        time.sleep(0.005)
    return released


def test_a_stamp_is_never_before_the_send_nor_after_the_stream_took_it():
    """Rounds in which each stream's chunk A lands, the loop's select sees it, and before the loop reads it a
    chunk B lands too: one read brings both, and B must not get A's arrival time. Between the rounds, chunks
    come 1-3 ms apart while the loop is free."""
    server, loop = ChunkServer(3), ClientLoop("arrival-test", 30.0)
    taken: dict[tuple[int, int], tuple[float, float]] = {}
    loop.start()
    try:
        fut = start_streams(server, loop, lambda s, i, t: taken.__setitem__((s, i), (t, time.monotonic())),
                            lambda i: sum(1 for k in taken if k[1] == i))
        i = 1
        for _ in range(4):
            first = Hold(loop).wait()
            for s in range(server.streams):
                server.send(s, i)  # A
            server.delivered()  # while the loop is held
            second = Hold(loop)  # runs after the loop's next select (which sees A), before its reads
            first.release()
            second.wait()
            for s in range(server.streams):
                server.send(s, i + 1)  # B, into the same read as A
            server.delivered()
            second.release()
            for i in range(i + 2, i + 10):
                for s in range(server.streams):
                    server.send(s, i)
                time.sleep(0.001 + 0.002 * (i % 2))
            i += 1
        server.finish()
        fut.result(30)
    finally:
        loop.close()
    assert sorted(taken) == sorted(server.sent)
    for key, sent in server.sent.items():
        stamp, took = taken[key]
        assert sent <= stamp <= took, (key, sent, stamp, took)
    for s in range(server.streams):
        stamps = [taken[key][0] for key in sorted(key for key in taken if key[0] == s)]
        assert stamps == sorted(stamps)


@pytest.mark.skipif(arrival_mod._recvmsg is None, reason="the kernel's receive times need Linux (SO_TIMESTAMPNS)")
def test_the_kernels_receive_time_of_the_first_unread_byte_leaves_the_bytes_unread():
    """ReceiveTimes: None with nothing unread, 0.0 for bytes that came before receive times were asked for,
    else the receive time of the first unread byte (or of a later segment TCP merged into it: never earlier),
    and the bytes stay to be read."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    received = arrival_mod.ReceiveTimes()
    try:
        assert received(client.fileno()) is None
        server.sendall(b"early")
        _wait_readable(client)
        assert received(client.fileno()) == 0.0
        assert client.recv(100) == b"early"
        assert arrival_mod.receive_stamps(client)
        before = time.time()
        server.sendall(b"first")
        _wait_readable(client)
        time.sleep(0.01)
        server.sendall(b"second")
        time.sleep(0.01)
        stamp = received(client.fileno())
        assert before <= stamp <= time.time() - 0.01  # a receive time (the second's if merged), not now
        assert received(client.fileno()) == stamp
        got = b""
        while len(got) < len(b"firstsecond"):
            got += client.recv(100)
        assert got == b"firstsecond"
    finally:
        for sock in (client, server, listener):
            sock.close()


def _wait_readable(sock: socket.socket) -> None:
    import select

    assert select.select([sock], [], [], 10)[0]


@pytest.mark.skipif(arrival_mod._recvmsg is None, reason="the kernel's receive times need Linux (SO_TIMESTAMPNS)")
def test_a_chunk_that_landed_while_the_client_stalled_keeps_the_kernels_receive_time():
    """The client's loop is blocked (as when the process is descheduled) while each stream's chunk lands, and
    released later: the stamp is when the kernel received the chunk, before the release, where a stamp from
    the loop's first look (its next select) would be after it."""
    server, loop = ChunkServer(3), ClientLoop("arrival-test", 30.0)
    taken: dict[tuple[int, int], float] = {}
    releases: dict[int, float] = {}

    def handled(i: int) -> int:
        return sum(1 for k in taken if k[1] == i)

    loop.start()
    try:
        fut = start_streams(server, loop, lambda s, i, t: taken.__setitem__((s, i), t), handled)
        for i in range(1, 4):
            releases[i] = burst_while_held(server, loop, i, handled, held_s=HANDLER_S)
        server.finish()
        fut.result(30)
    finally:
        loop.close()
    for i, released in releases.items():
        for s in range(server.streams):
            assert server.sent[(s, i)] <= taken[(s, i)] < released, (s, i)


@pytest.mark.parametrize("arrival", [True, False], ids=["arrival", "taken"])
def test_a_chunk_that_waited_for_other_streams_keeps_its_arrival_time(monkeypatch, arrival):
    """Three streams' chunks land while the loop is blocked; each handler then keeps the loop 20 ms. With
    arrival stamps the last one handled is stamped before the first handler began; stamped when taken, it
    is stamped after the handlers before it ended."""
    monkeypatch.setenv(ARRIVAL_STAMPS_ENV, "1" if arrival else "0")
    server, loop = ChunkServer(3), ClientLoop("arrival-test", 30.0)
    calls: list[tuple[int, int, float, float, float]] = []  # stream, index, stamp, entered, left

    def on_chunk(s: int, i: int, t: float) -> None:
        entered = time.monotonic()
        time.sleep(HANDLER_S)
        calls.append((s, i, t, entered, time.monotonic()))

    def handled(i: int) -> int:
        return sum(1 for c in calls if c[1] == i)

    loop.start()
    try:
        fut = start_streams(server, loop, on_chunk, handled)
        for i in range(1, 4):
            burst_while_held(server, loop, i, handled)
        server.finish()
        fut.result(30)
    finally:
        loop.close()
    for i in range(1, 4):
        burst = sorted((c for c in calls if c[1] == i), key=lambda c: c[3])
        assert len(burst) == 3
        for s, _, stamp, entered, _ in burst:
            assert server.sent[(s, i)] <= stamp <= entered
        first, last = burst[0], burst[-1]
        if arrival:
            assert last[2] <= first[3]  # stamped before the first handler began,
            assert last[3] >= burst[1][4]  # and taken after the second ended: it waited behind both
        else:
            assert last[2] >= burst[1][4]  # stamped after the handler before it ended
