"""ClientCluster: what the clusters of external backends share, the part the harness talks to.

The harness drives a `Cluster` (start, stop, submit, poll, reset_prefix_cache, workers) and reads its events
(TokenEvent, RequestDone, WorkerFailed). Here every request is a coroutine on one event loop (ClientLoop, one
background thread per cluster): `submit` hands it over, the coroutine puts events on a queue.Queue, `poll`
takes them. Subclasses say how one request is served (`serve`) and how the servers are watched.

A streamed chunk may carry several tokens. Each token gets the chunk's time, and the request's record keeps
the chunk sizes (`chunks`), so that its ITL is per chunk and its TPOT per token, as `vllm bench serve`
computes them (pdlab.measure.metrics.timings). The server's own token counts (`usage`) are kept beside.

`pdlab serve` drives a cluster as its bridge does (pdlab.api.bridge): `wake()` makes a waiting poll return
(a new request is submitted at once), and `abort(req_id)` gives a request up (a stop string matched, its
client left): its coroutine is cancelled, which closes its HTTP stream, and vLLM aborts a request whose
connection closed, so the server stops generating for nobody.
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

HEALTH_SLICE_S = 0.05  # a long poll checks the servers' health this often
_WAKE = object()  # put on the event queue by wake(); never returned by poll()


def vllm_sampling(params: dict) -> dict:
    """A request's sampling (pdlab.engine.SamplingParams' fields, as `Cluster.submit` takes them) as the
    fields of vLLM's /v1/completions. What is not asked is the harness's run: greedy, EOS ignored (the
    harness asks max_tokens and ignore_eos only; pdlab serve passes every field its client asked)."""
    out = {"temperature": float(params.get("temperature", 0.0)), "top_p": float(params.get("top_p", 1.0)),
           "ignore_eos": bool(params.get("ignore_eos", True))}
    if params.get("seed") is not None:
        out["seed"] = int(params["seed"])
    if params.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in params["stop_token_ids"]]
    return out


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
    sampling: dict = field(default_factory=dict)  # vllm_sampling(params): the body's sampling fields
    aborted: Optional[str] = None  # abort()'s reason (set on the loop)
    task: Optional[asyncio.Task] = None  # its coroutine, once it runs


class ClientCluster:
    def __init__(self, name: str, read_timeout_s: float):
        self.events: "queue.Queue[Any]" = queue.Queue()  # events, and lists of events (`_emit`)
        self._batch: list[Any] = []  # the loop's events not yet on the queue
        self.client = ClientLoop(name, read_timeout_s)
        self.multi_token_chunks = 0  # chunks that carried more than one token (docs/external.md)
        self._started = self._stopped = False
        self._open: dict[str, ClientRequest] = {}  # submitted, not yet done: added by submit, removed on the loop

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
        req = ClientRequest(req_id, list(prompt_ids), int(params.get("max_tokens", 16)), {"queued": time.monotonic()},
                            sampling=vllm_sampling(params))
        self.prepare(req)
        self._open[req_id] = req
        try:
            self.client.submit(self._run(req))
        except BaseException:
            self._open.pop(req_id, None)
            raise

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        """Give up a request: its coroutine is cancelled (its HTTP stream closes) and a RequestDone(ok=False,
        error=reason) follows. Nothing for a request that has already ended. Any thread."""
        loop = self.client.loop
        if loop is not None and not self._stopped:
            try:
                loop.call_soon_threadsafe(self._cancel, req_id, reason)
            except RuntimeError:
                pass  # the loop has just closed: the cluster stops, and so does every request

    def wake(self) -> None:
        """Make a poll() that waits in another thread return now (maybe with nothing). Any thread."""
        self.events.put(_WAKE)

    def poll(self, timeout: float) -> list[Any]:
        """Events in arrival order; returns as soon as there are any, after `timeout` seconds, or when wake()
        was called. The servers' health is checked every HEALTH_SLICE_S meanwhile."""
        self._running()
        deadline = time.monotonic() + max(0.0, timeout)
        out: list[Any] = []
        woken = False
        while True:
            self.check_health()
            try:
                item = self.events.get(timeout=min(HEALTH_SLICE_S, max(0.0, deadline - time.monotonic())))
                while True:
                    if item is _WAKE:
                        woken = True
                    elif type(item) is list:
                        out.extend(item)
                    else:
                        out.append(item)
                    item = self.events.get_nowait()
            except queue.Empty:
                pass
            if out or woken or time.monotonic() >= deadline:
                return out

    # ---- on the loop ----
    def _cancel(self, req_id: str, reason: str) -> None:
        """abort() on the loop: a request not yet started ends when it starts; one that runs is cancelled."""
        req = self._open.get(req_id)
        if req is None or req.aborted is not None:
            return
        req.aborted = reason
        if req.task is not None:
            req.task.cancel()

    async def _run(self, req: ClientRequest) -> None:
        error: Optional[str] = None
        req.task = asyncio.current_task()
        try:
            if req.aborted is not None:
                raise asyncio.CancelledError
            await self.serve(req)
        except StreamError as e:
            error = str(e)
        except asyncio.CancelledError:
            if req.aborted is None:
                raise  # the cluster stops; the harness records what was in flight
            error = req.aborted
        except Exception as e:  # noqa: BLE001 - one request's bug must not end the loop silently
            error = f"client error: {e.__class__.__name__}: {e}"
        finally:
            self._open.pop(req.req_id, None)
        self._emit(RequestDone(
            req.req_id, error is None, self.scrub(error or ""), list(req.output_ids), 0, req.prefill_worker,
            req.decode_worker, dict(req.phases), "remote" if req.decode_worker else "unified",
            client={"chunks": list(req.chunks), "usage": req.usage, **req.client}))

    def chunk(self, req: ClientRequest, worker: str, ids: Union[list[int], tuple[int, ...]], t: float,
              last: bool = False) -> None:
        """One streamed chunk of `req`, read at `t`: a TokenEvent per token, all at `t`. `last`: the server
        finished the request with it (a stop token, EOS): its last token is `finished` as the max_tokens-th is."""
        if not ids:
            return
        if len(ids) > 1:
            self.multi_token_chunks += 1  # on the loop thread only
        req.chunks.append(len(ids))
        for k, tok in enumerate(ids):
            index = len(req.output_ids)
            req.output_ids.append(int(tok))
            finished = index + 1 >= req.max_tokens or (last and k == len(ids) - 1)
            self._emit(TokenEvent(req.req_id, int(tok), t, index, finished, worker, t))

    def _emit(self, event: Any) -> None:
        """On the loop: queue an event. The loop's events go to the queue as one list per loop iteration:
        a put per token would wake the harness's thread per token, and each wake-up takes the GIL from the
        loop, whose reads (and so its stamps) then wait."""
        if not self._batch:
            self.client.loop.call_soon(self._flush)
        self._batch.append(event)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        self.events.put(batch)

    def _running(self) -> None:
        if not self._started or self._stopped:
            raise ClusterError("cluster is not running (call start(); stop() ends it)")
