"""One asyncio event loop on one background thread, with one aiohttp session: where every HTTP request of an
external cluster runs (pdlab.external.client).

Why a loop and not a thread per request: a stream is mostly waiting, and hundreds of them wait fine in one
loop, on one core, without hundreds of threads competing for the GIL when their lines arrive. aiohttp is the
client because the same library serves `pdlab serve`, and `vllm bench serve` drives its streams with it too.

The harness stays synchronous: it hands coroutines over with `submit` (run_coroutine_threadsafe) and reads
what they produce from a queue.Queue. The connector has no connection limit (TCPConnector(limit=0)): with
aiohttp's default of 100, the 101st concurrent stream would wait for a free connection and its TTFT would
include that wait, a client artefact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import resource
import threading
from typing import Any, Coroutine, Optional

import aiohttp

from pdlab.constants import CLIENT_CONNECT_TIMEOUT_S
from pdlab.external.arrival import new_loop

CLOSE_GRACE_S = 5.0
OPEN_FILES = 65536  # a socket per stream: the soft limit (often 1024) is raised towards this, up to the hard one


class ClientLoop:
    def __init__(self, name: str, read_timeout_s: float):
        """`read_timeout_s`: the longest a response may stay silent (no byte) before it counts as broken."""
        self.name = name
        self.read_timeout_s = read_timeout_s
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.session: Optional[aiohttp.ClientSession] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self) -> None:
        if self._thread is not None:
            return
        raise_open_files()
        self._thread = threading.Thread(target=self._main, name=f"pdlab-client-{self.name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        loop = None
        try:
            loop = new_loop()
            asyncio.set_event_loop(loop)
            self.session = loop.run_until_complete(self._open())
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller, which waits for _ready
            self._error = e
            self._ready.set()
            if loop is not None:
                loop.close()
            return
        self.loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _open(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CLIENT_CONNECT_TIMEOUT_S,
                                        sock_read=self.read_timeout_s)
        # no proxy from the environment: the server is the one the recipe names, reached directly
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                                     timeout=timeout, trust_env=False)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Run `coro` on the loop; thread-safe. Its result (or exception) arrives in the returned future."""
        if self.loop is None or not self.loop.is_running():
            coro.close()
            raise RuntimeError("client loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: Optional[float] = None) -> Any:
        """Run `coro` on the loop and wait for its result (from another thread only)."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what runs, close the session and its connections, stop the loop, join the thread. Idempotent."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CLOSE_GRACE_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(CLOSE_GRACE_S)
        self.loop = None

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()


def raise_open_files(want: int = OPEN_FILES) -> None:
    """Let this process hold a socket for each of many concurrent streams (and its other files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the limit stays: streams beyond it fail with a clear "Too many open files"
