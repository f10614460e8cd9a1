"""How late pdlab's HTTP client stamps a token: client stamp minus the moment the server sent it.

A local aiohttp server in a process of its own streams `--tokens` tokens per request, one chunk each, every
`--period-ms`, on a fixed schedule, and records when it handed each chunk to the kernel (time.monotonic(),
the same clock in every process on Linux). pdlab's client drives `--streams` concurrent streams through the
endpoint backend's cluster (pdlab.external.endpoint: one event loop on one thread, the harness's poll on
the main thread), exactly as a run does, and stamps each chunk when its line is read. The error of a token
is its client stamp minus its send time: kernel delivery, plus the time the client's loop was busy with other
streams' lines.

Two schedules: `spread`, each stream at its own phase within the period (requests that arrived at different
times); `aligned`, every stream's chunk at the same instant (a decode step that emits a token for each of a
batch's requests: the client then reads a burst of lines, and the last of it waits for the others).

    python benchmarks/bench_client.py                      # 256 streams, both schedules
    python benchmarks/bench_client.py --streams 512 --schedule aligned

Run it on a quiet machine: the error is the client's own only when nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.request

import numpy as np

SCHEDULES = ("spread", "aligned")
PHASE = (math.sqrt(5) - 1) / 2  # golden-ratio phases: stream i at frac(i * PHASE) of the period


# ---- the server (its own process) ----
def serve(port: int, period_s: float, tokens: int) -> None:
    from aiohttp import web

    sends: list[list] = []  # [stream, index, t_send]
    t0 = time.monotonic() + 1.0  # the schedule's origin: every stream's chunks fall on it

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or tokens)
        if n <= 2:  # pdlab's probe: answer at once
            stream, period, phase = -1, 0.0, 0.0
        else:  # the prompt is [stream, schedule, 0]
            stream, schedule = int(body["prompt"][0]), SCHEDULES[int(body["prompt"][1])]
            period, phase = period_s, (stream * PHASE % 1.0 if schedule == "spread" else 0.0)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        now = time.monotonic()
        k0 = math.ceil((now - t0) / period - phase) + 1 if period else 0  # the next slot, one period ahead
        for i in range(n):
            if period:
                await asyncio.sleep(max(0.0, t0 + (k0 + i + phase) * period - time.monotonic()))
            data = json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i % 500],
                                            "finish_reason": "length" if i == n - 1 else None}]})
            t = time.monotonic()
            await resp.write(f"data: {data}\n\n".encode())
            if period:
                sends.append([stream, i, t])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "bench"}]})

    async def take_sends(_: web.Request) -> web.Response:
        out = list(sends)
        sends.clear()
        return web.json_response(out)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions),
                    web.get("/sends", take_sends)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


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
    err = [stamps[(s, i)] - t for s, i, t in sends if (s, i) in stamps]
    return np.asarray(err) * 1000.0, failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    p.add_argument("--period-ms", type=float, default=20.0, help="time between two tokens of one stream")
    p.add_argument("--schedule", choices=(*SCHEDULES, "both"), default="both")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process, on this port
    a = p.parse_args()
    if a.serve is not None:
        serve(a.serve, a.period_ms / 1000.0, a.tokens)
        return 0
    import aiohttp

    from pdlab.external.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(port), "--tokens",
                               str(a.tokens), "--period-ms", str(a.period_ms)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=1)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print("the benchmark's server did not start", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        print(f"pdlab client timing error: {a.streams} concurrent streams x {a.tokens} tokens, one every "
              f"{a.period_ms:g} ms; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
              f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}")
        print(f"{'schedule':<9} {'tokens':>7} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for schedule in (SCHEDULES if a.schedule == "both" else (a.schedule,)):
            err, failed = measure(url, a.streams, a.tokens, SCHEDULES.index(schedule))
            print(f"{schedule:<9} {err.size:>7} {failed:>6} {np.percentile(err, 50):>8.3f} "
                  f"{np.percentile(err, 99):>8.3f} {err.max():>8.3f}")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
