"""How late pdlab's HTTP client stamps a token: client stamp minus the moment the server sent it.

A local server in a process of its own (plain asyncio, one ticker writing every chunk that is due, so that it
takes as little as it can of the cores the client is measured on) streams `--tokens` tokens per request, one
chunk each, every `--period-ms`, on a fixed schedule, and records when it handed each chunk to the kernel
(time.monotonic(), the same clock in every process on Linux). pdlab's client drives `--streams` concurrent
streams through the endpoint backend's cluster (pdlab.external.endpoint: one event loop on one thread, the
harness's poll on the main thread), exactly as a run does. The error of a token is its client stamp minus
its send time.

Stamps, alternated in one run: `arrival` (pdlab's, pdlab.external.arrival: when the kernel received the
chunk's first byte, where it notes receive times, else when the socket was first seen readable), `peek` (the
latter alone, PDLAB_ARRIVAL_STAMPS=peek) and `taken` (PDLAB_ARRIVAL_STAMPS=0: when the stream took the chunk,
as `vllm bench serve` stamps; it includes the time the loop spent on other streams first). Two schedules:
`spread`, each stream at its own phase within the period (requests that arrived at different times); `aligned`, every
stream's chunk at the same instant (a decode step that emits a token for each of a batch's requests: the
client then reads a burst, and the last of it waits for the others).

    python benchmarks/bench_client.py                      # 256 streams, 20 and 50 ms, both stamps and schedules
    python benchmarks/bench_client.py --streams 512 --period-ms 100 --schedule aligned --stamps arrival
    python benchmarks/bench_client.py --stamps arrival --read-timer aiohttp,watchdog   # silence: whose timer

The error is taken against the server's stamp before its write (p50, p99, max) and after it (`p99 end`): on a
2-core box the server can be preempted inside its write, and then the first overstates the client's error
and the second bounds it from below. `cpu us` is the client process's CPU time (both threads) per chunk.

Run it on a quiet machine: the error is the client's own only when nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.request
from typing import Optional

import numpy as np

from pdlab.constants import ARRIVAL_STAMPS_ENV

SCHEDULES = ("spread", "aligned")
STAMPS = {"arrival": "1", "peek": "peek", "taken": "0"}  # -> PDLAB_ARRIVAL_STAMPS
PHASE = (math.sqrt(5) - 1) / 2  # golden-ratio phases: stream i at frac(i * PHASE) of the period


# ---- the server (its own process) ----
class _Conn(asyncio.Protocol):
    """One connection to the fixture: plain asyncio, one request each (Connection: close), so the server
    costs little of the box whose client is measured. Streams are written by the Server's one ticker."""

    def __init__(self, server: "Server"):
        self.server, self.buf, self.transport = server, b"", None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                       if line.lower().startswith(b"content-length:")), 0)
        if len(rest) < length:
            return
        method, path = head.split(b" ", 2)[:2]
        self.server.handle(self, method.decode(), path.decode(), json.loads(rest[:length]) if length else None)

    def reply(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class Server:
    """Streams `tokens` chunks per completion, each at its slot on a fixed schedule; notes when each was
    handed to the kernel (time.monotonic(), the same clock in every process on Linux)."""

    def __init__(self, period_s: float, tokens: int):
        self.period_s, self.tokens = period_s, tokens
        self.t0 = time.monotonic() + 1.0  # the schedule's origin: every stream's chunks fall on it
        self.sends: list[list] = []  # [stream, index, t before the write, t after it]
        self.due: list[tuple[float, int, int, int, _Conn]] = []  # heap: (time, stream, index, n, conn)
        self.wake: Optional[asyncio.Event] = None

    def handle(self, conn: _Conn, method: str, path: str, body: Optional[dict]) -> None:
        if path.endswith("/models"):
            return conn.reply({"data": [{"id": "bench"}]})
        if path == "/sends":
            out, self.sends = self.sends, []
            return conn.reply(out)
        if path != "/v1/completions" or not isinstance(body, dict):
            conn.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return conn.transport.close()
        conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        n = int(body.get("max_tokens") or self.tokens)
        if n <= 2:  # pdlab's probe: answer at once
            for i in range(n):
                conn.transport.write(self.chunk(i, i == n - 1))
            conn.transport.write(b"data: [DONE]\n\n")
            return conn.transport.close()
        stream, schedule = int(body["prompt"][0]), SCHEDULES[int(body["prompt"][1])]
        phase = stream * PHASE % 1.0 if schedule == "spread" else 0.0
        k0 = math.ceil((time.monotonic() - self.t0) / self.period_s - phase) + 1  # the next slot, a period ahead
        heapq.heappush(self.due, (self.t0 + (k0 + phase) * self.period_s, stream, 0, n, conn))
        self.wake.set()

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def chunk(i: int, last: bool) -> bytes:
        data = json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i % 500],
                                        "finish_reason": "length" if last else None}]})
        return f"data: {data}\n\n".encode()

    async def ticker(self) -> None:
        """Sleep until the next chunk is due, write every chunk due by then, repeat."""
        self.wake = asyncio.Event()
        while True:
            if not self.due:
                self.wake.clear()
                await self.wake.wait()
                continue
            delay = self.due[0][0] - time.monotonic()
            if delay > 0:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            while self.due and self.due[0][0] <= time.monotonic():
                at, stream, i, n, conn = heapq.heappop(self.due)
                data = self.chunk(i, i == n - 1)
                t = time.monotonic()
                conn.transport.write(data)
                self.sends.append([stream, i, t, time.monotonic()])
                if i + 1 < n:
                    heapq.heappush(self.due, (at + self.period_s, stream, i + 1, n, conn))
                else:
                    conn.transport.write(b"data: [DONE]\n\n")
                    conn.transport.close()


def serve(port: int, period_s: float, tokens: int) -> None:
    async def main() -> None:
        server = Server(period_s, tokens)
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(lambda: _Conn(server), "127.0.0.1", port, backlog=4096)
        async with listener:
            await server.ticker()

    asyncio.run(main())


# ---- the client: pdlab's endpoint cluster, polled as the harness polls it ----
def measure(url: str, streams: int, tokens: int, schedule: int) -> tuple[np.ndarray, int]:
    from pdlab.external.endpoint import EndpointCluster
    from pdlab.recipe import parse_recipe
    from pdlab.serve.events import RequestDone, TokenEvent

    v = parse_recipe({"rates": [1], "model": {"preset": "tiny-llama"},
                      "engine": {"backend": "endpoint", "url": f"{url}/v1", "model": "bench"},
                      "deployment": {"endpoint": {"devices": 1, "kind": "unified"}}}).resolved("default")
    stamps: dict[tuple[int, int], float] = {}
    failed = done = 0
    with EndpointCluster(v, v.deployment, label="bench") as c:
        c.start()
        for s in range(streams):
            c.submit(str(s), [s, schedule, 0], {"max_tokens": tokens})
        while done < streams:
            for e in c.poll(0.5):
                if isinstance(e, TokenEvent):
                    stamps[(int(e.req_id), e.index)] = e.t
                elif isinstance(e, RequestDone):
                    done += 1
                    failed += not e.ok
    sends = json.load(urllib.request.urlopen(f"{url}/sends", timeout=30))
    err = [(stamps[(s, i)] - t, stamps[(s, i)] - t_end) for s, i, t, t_end in sends if (s, i) in stamps]
    return np.asarray(err).reshape(-1, 2) * 1000.0, failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    p.add_argument("--period-ms", default="20,50", help="time between two tokens of one stream; a list runs each")
    p.add_argument("--schedule", choices=(*SCHEDULES, "both"), default="both")
    p.add_argument("--stamps", default="arrival,taken",
                   help="arrival (pdlab's: the kernel's receive time where it notes one), peek (when the client "
                        "first saw the socket readable, PDLAB_ARRIVAL_STAMPS=peek) or taken (PDLAB_ARRIVAL_STAMPS=0, "
                        "as vllm bench serve); a list alternates, `both` is arrival,taken")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of every case")
    p.add_argument("--read-timer", default="watchdog",
                   help="what breaks off a silent stream: watchdog (pdlab's, pdlab.external.silence) or aiohttp "
                        "(its sock_read timer, re-armed every read); a list alternates")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process, on this port
    a = p.parse_args()
    periods = [float(x) for x in str(a.period_ms).split(",")]
    stamp_modes = ["arrival", "taken"] if a.stamps == "both" else a.stamps.split(",")
    if any(m not in STAMPS for m in stamp_modes):
        p.error(f"--stamps: each of {', '.join(STAMPS)}")
    if a.serve is not None:
        serve(a.serve, periods[0] / 1000.0, a.tokens)
        return 0
    import aiohttp

    print(f"pdlab client timing error: {a.streams} concurrent streams x {a.tokens} tokens; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, Python {platform.python_version()}, aiohttp {aiohttp.__version__}")
    from pdlab.external import silence, stream

    print(f"{'period':>6} {'chunks/s':>8} {'stamps':<8} {'timer':<8} {'schedule':<8} {'round':>5} "
          f"{'tokens':>6} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 end':>8} {'cpu us':>7}")
    for period in periods:
        for r in range(a.rounds):
            for stamps in stamp_modes:
                for timer in a.read_timer.split(","):
                    stream.watchdog = silence.watchdog if timer == "watchdog" else (lambda: None)
                    with fixture(a.tokens, period) as url:
                        for schedule in (SCHEDULES if a.schedule == "both" else (a.schedule,)):
                            os.environ[ARRIVAL_STAMPS_ENV] = STAMPS[stamps]
                            cpu = time.process_time()
                            err, failed = measure(url, a.streams, a.tokens, SCHEDULES.index(schedule))
                            n = len(err)
                            cpu_us = (time.process_time() - cpu) / max(n, 1) * 1e6
                            start, end = err[:, 0], err[:, 1]
                            print(f"{period:>6g} {a.streams * 1000 / period:>8.0f} {stamps:<8} "
                                  f"{timer:<8} {schedule:<8} {r + 1:>5} {n:>6} {failed:>6} "
                                  f"{np.percentile(start, 50):>8.3f} {np.percentile(start, 99):>8.3f} "
                                  f"{start.max():>8.3f} {np.percentile(end, 99):>8.3f} {cpu_us:>7.1f}", flush=True)
    return 0


@contextlib.contextmanager
def fixture(tokens: int, period_ms: float):
    """The server in a process of its own, on a free port; yields its URL."""
    from pdlab.external.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(port), "--tokens",
                               str(tokens), "--period-ms", str(period_ms)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=1)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the benchmark's server did not start")
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
