"""ClientCluster: what the clusters of external backends share, the part the harness talks to.

The harness drives a `Cluster` (start, stop, submit, poll, reset_prefix_cache, workers) and reads its events
(TokenEvent, RequestDone, WorkerFailed). Here every request is a coroutine on one event loop (ClientLoop, one
background thread per cluster): `submit` hands it over, the coroutine puts events on a queue.Queue, `poll`
takes them. Subclasses say how one request is served (`serve`) and how the servers are watched.

A streamed chunk may carry several tokens. Each token gets the chunk's time, and the request's record keeps
the chunk sizes (`chunks`), so that its ITL is per chunk and its TPOT per token, as `vllm bench serve`
computes them (pdlab.measure.metrics.timings). The server's own token counts (`usage`) are kept beside.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pdlab.external.loop import ClientLoop
from pdlab.external.stream import StreamError
from pdlab.serve.events import RequestDone, TokenEvent
from pdlab.serve.topology import ClusterError


@dataclass
class ClientRequest:
    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    phases: dict = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens per streamed chunk, in order
    usage: Optional[dict] = None  # the server's prompt_tokens / completion_tokens
    prefill_worker: Optional[str] = None
    decode_worker: Optional[str] = None  # set only when prefill and decode ran on different servers
    client: dict = field(default_factory=dict)  # more for the record (pdlab.external.endpoint: prompt_as)
    body: Optional[dict] = None  # what prepare() built, when the subclass builds it off the loop


class ClientCluster:
    def __init__(self, name: str, read_timeout_s: float):
        self.events: "queue.Queue[Any]" = queue.Queue()
        self.client = ClientLoop(name, read_timeout_s)
        self.multi_token_chunks = 0  # chunks that carried more than one token (docs/external.md)
        self._started = self._stopped = False

    # ---- what subclasses provide ----
    def prepare(self, req: ClientRequest) -> None:
        """Work for one request before it goes to the loop, in the submitting thread (CPU work on the loop
        would delay the stamps of every other stream)."""

    async def serve(self, req: ClientRequest) -> None:
        """Serve one request: stream its tokens through `self.chunk`, set its workers; StreamError on failure."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Put a WorkerFailed on the queue for a server found dead (called by every poll)."""

    def scrub(self, error: str) -> str:
        """An error message as it may be recorded (an endpoint takes its API key out)."""
        return error

    # ---- the Cluster surface ----
    def start(self) -> None:
        if self._started:
            raise ClusterError("cluster already started")
        self._started = True
        self.client.start()

    def stop(self) -> None:
        """Cancel what is in flight and stop the loop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.client.close()

    def __enter__(self) -> "ClientCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        self._running()
        req = ClientRequest(req_id, list(prompt_ids), int(params.get("max_tokens", 16)), {"queued": time.monotonic()})
        self.prepare(req)
        self.client.submit(self._run(req))

    def poll(self, timeout: float) -> list[Any]:
        """Events in arrival order; returns as soon as there are any, or after `timeout` seconds."""
        self._running()
        self.check_health()
        out = []
        try:
            out.append(self.events.get(timeout=max(0.0, timeout)))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    # ---- on the loop ----
    async def _run(self, req: ClientRequest) -> None:
        error: Optional[str] = None
        try:
            await self.serve(req)
        except StreamError as e:
            error = str(e)
        except asyncio.CancelledError:
            raise  # the cluster stops; the harness records what was in flight
        except Exception as e:  # noqa: BLE001 - one request's bug must not end the loop silently
            error = f"client error: {e.__class__.__name__}: {e}"
        self.events.put(RequestDone(
            req.req_id, error is None, self.scrub(error or ""), list(req.output_ids), 0, req.prefill_worker, req.decode_worker,
            dict(req.phases), "remote" if req.decode_worker else "unified",
            client={"chunks": list(req.chunks), "usage": req.usage, **req.client}))

    def chunk(self, req: ClientRequest, worker: str, ids: Union[list[int], tuple[int, ...]], t: float) -> None:
        """One streamed chunk of `req`, read at `t`: a TokenEvent per token, all at `t`."""
        if not ids:
            return
        if len(ids) > 1:
            self.multi_token_chunks += 1  # on the loop thread only
        req.chunks.append(len(ids))
        for tok in ids:
            index = len(req.output_ids)
            req.output_ids.append(int(tok))
            self.events.put(TokenEvent(req.req_id, int(tok), t, index, index + 1 >= req.max_tokens, worker, t))

    def _running(self) -> None:
        if not self._started or self._stopped:
            raise ClusterError("cluster is not running (call start(); stop() ends it)")
