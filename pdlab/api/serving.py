"""The life of a pdlab serve process: bind, start the deployment, serve, and shut down cleanly.

The port is bound first (a port in use is a one-line error before any worker starts), then the cluster
starts in the main thread (Ctrl-C or SIGTERM there stops it like any start that fails), then the bridge
thread takes the cluster over and aiohttp serves on the bound socket; connections made while the workers
load wait in its backlog.

SIGTERM or Ctrl-C stops admission (new requests get 503, /health too), then either lets the requests in
flight finish (`drain`, up to `shutdown_timeout_s`, then cancels the rest) or cancels them at once; a
second signal cancels at once. Cancelled requests are answered 503 (or an error event, mid-stream). Then
the HTTP server closes (the port is free again), the bridge stops the cluster (its workers, sockets and
/dev/shm segments) and trace.json is written. A failed worker ends the server the same way, cancelling.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web

from pdlab.api.bridge import Bridge
from pdlab.api.server import ServeState, build_app

HTTP_SHUTDOWN_S = 5.0  # aiohttp's own wait for handlers once ours have ended (they have: keep-alive only)


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    api_key: Optional[str]  # never printed, never written
    drain: bool
    shutdown_timeout_s: float


class BindError(OSError):
    """The address cannot be bound; one line naming --host / --port."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_warning(host: str, api_key: Optional[str], key_env: str) -> Optional[str]:
    """What to say when the server listens beyond loopback."""
    if is_loopback(host):
        return None
    return (f"--host {host} is not loopback: anyone who can reach this machine can use the server"
            + ("" if api_key else f" (no API key: give --api-key or ${key_env})"))


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise BindError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise BindError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(cluster: Any, ledger: Any, metrics: Any, served: Any, paths: Any, sock: socket.socket,
          opts: ServeOptions, banner: str) -> int:
    """Serve the started `cluster` on `sock` until a signal or a failure, then stop it; returns the exit code
    (0 after a signal, 1 after a failure). `banner` is printed once the server answers."""
    return asyncio.run(_serve(cluster, ledger, metrics, served, paths, sock, opts, banner))


async def _serve(cluster: Any, ledger: Any, metrics: Any, served: Any, paths: Any, sock: socket.socket,
                 opts: ServeOptions, banner: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"n": 0, "failure": None}

    def on_signal(name: str) -> None:
        signals["n"] += 1
        if signals["n"] == 1:
            state.closing = f"shutting down ({name})"
            print(f"pdlab serve: {name}: not admitting requests; {len(state.jobs)} in flight "
                  + (f"may finish (up to {opts.shutdown_timeout_s:g} s; {name} again cancels them)" if opts.drain
                     else "are cancelled"), file=sys.stderr, flush=True)
            stop.set()
        else:
            _cancel(state, f"cancelled: the server is shutting down ({name} twice)")

    def on_failure(reason: str) -> None:  # on the bridge's thread
        def fail() -> None:
            signals["failure"] = reason
            state.closing = f"failed: {reason}"
            print(f"pdlab serve: {reason}; shutting down", file=sys.stderr, flush=True)
            _cancel(state, f"cancelled: {reason}")
            stop.set()
        loop.call_soon_threadsafe(fail)

    state = ServeState(served, Bridge(cluster, ledger, metrics, on_failure, paths), metrics, opts.api_key)
    for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
        loop.add_signal_handler(sig, on_signal, name)
    state.bridge.start()
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None,
                           shutdown_timeout=HTTP_SHUTDOWN_S)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        print(banner, flush=True)
        await stop.wait()
        if opts.drain and signals["failure"] is None:
            await _drain(state, opts.shutdown_timeout_s)
        _cancel(state, "cancelled: the server is shutting down")
        deadline = loop.time() + HTTP_SHUTDOWN_S
        while state.jobs and loop.time() < deadline:  # each answers its client and releases its engine requests
            await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
        sock.close()
        await loop.run_in_executor(None, state.bridge.stop)  # a signal meanwhile changes nothing
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 1 if signals["failure"] else 0


async def _drain(state: ServeState, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while state.jobs and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.jobs:
        print(f"pdlab serve: {len(state.jobs)} requests still in flight after {timeout_s:g} s: cancelling them",
              file=sys.stderr, flush=True)


def _cancel(state: ServeState, reason: str) -> None:
    for job in list(state.jobs):
        job.cancel(reason)
