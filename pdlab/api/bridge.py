"""The thread between pdlab serve's asyncio HTTP side and a deployment's cluster.

A cluster is driven from one thread, as the harness drives it: `submit(req_id, prompt_ids, params)` and
`poll(timeout)`, whose events are TokenEvent, RequestDone, StepEvent, TransferEvent and WorkerFailed. The
bridge is that thread. The HTTP side hands it commands (submit, release) through a queue and wakes its
poll (`cluster.wake()`, where the cluster has it: pdlab's own; an external cluster is polled in short
slices instead, so a new request waits at most that long to be submitted). Each request's events go to its
HTTP handler through `Submission.deliver` (loop.call_soon_threadsafe onto an asyncio queue), until the
handler releases it. Everything measured is written and counted here (pdlab.api.ledger, pdlab.api.metrics),
from the workers' stamps, whatever the HTTP side and its clients are doing.

A request its handler released before the engine finished it (a stop string, a client that left,
cancelled at shutdown) is aborted in the engine where the cluster can abort (`cluster.abort`); where it
cannot (an external engine), its events are no longer delivered and it runs to its end unseen.

`stop()` ends the thread: it waits (up to ENGINE_GRACE_S) for requests still in the engine, writes the
records of what is left, stops the cluster (its workers, sockets and shared memory) and writes trace.json.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

from pdlab.api.ledger import Ledger, Live, Release, Submission
from pdlab.api.metrics import ServeMetrics
from pdlab.serve.events import RequestDone, StepEvent, TokenEvent, TransferEvent, WorkerFailed

POLL_S = 0.5  # a cluster that wakes: the idle wait (its health checks run in slices within it)
POLL_NO_WAKE_S = 0.002  # a cluster without wake(): how long a new request may wait to be submitted
ENGINE_GRACE_S = 5.0  # stop(): requests aborted in the engine get this long to be confirmed


class Bridge:
    def __init__(self, cluster: Any, ledger: Ledger, metrics: ServeMetrics, on_failure: Callable[[str], None],
                 paths: Any = None):
        """`cluster`: started; from now on only this bridge's thread touches it (it stops it at the end).
        `on_failure(reason)`: a worker or the cluster failed (called on the bridge's thread)."""
        self.cluster, self.ledger, self.metrics, self.paths = cluster, ledger, metrics, paths
        self.on_failure = on_failure
        self.live: dict[str, Live] = {}
        self.failure: Optional[str] = None
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._wake = getattr(cluster, "wake", None)
        self._abort = getattr(cluster, "abort", None)
        self._stopping: Optional[float] = None  # when stop() was asked
        self._thread = threading.Thread(target=self._run, name="pdlab-bridge")

    def start(self) -> None:
        self._thread.start()

    # ---- any thread ----
    def submit(self, sub: Submission) -> None:
        self._send(("submit", sub))

    def release(self, req_id: str, release: Release) -> None:
        self._send(("release", req_id, release))

    def stop(self) -> None:
        """Finish (see the module's doc) and wait for the thread; idempotent."""
        if self._thread.is_alive():
            self._send(("stop",))
            self._thread.join()

    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        if self._wake is not None:
            self._wake()

    # ---- the bridge's thread ----
    def _run(self) -> None:
        try:
            while not self._finished():
                self._commands_in()
                wait = POLL_S if self._wake is not None else POLL_NO_WAKE_S
                self._handle(self.cluster.poll(wait if self._stopping is None else min(wait, 0.05)))
        except Exception as e:  # noqa: BLE001 - a broken cluster ends the server, which says why
            self._fail(f"the cluster failed: {type(e).__name__}: {e}")
        finally:
            why = "server stopped before the engine finished it"
            for live in list(self.live.values()):
                if live.release is None:  # its handler still waits: end it
                    live.sub.deliver(RequestDone(live.sub.req_id, False, why, [], 0, None, None, {}))
                self._settle(live, why)
            try:
                self.cluster.stop()
            finally:
                self.ledger.close()

    def _finished(self) -> bool:
        if self._stopping is None:
            return False
        self._commands_in()
        return not self.live or time.monotonic() - self._stopping > ENGINE_GRACE_S

    def _commands_in(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                self._submit(cmd[1])
            elif cmd[0] == "release":
                self._release(cmd[1], cmd[2])
            elif cmd[0] == "stop" and self._stopping is None:
                self._stopping = time.monotonic()

    def _submit(self, sub: Submission) -> None:
        self.live[sub.req_id] = Live(sub)
        try:
            self.cluster.submit(sub.req_id, list(sub.prompt_ids), dict(sub.params))
        except Exception as e:  # noqa: BLE001 - the cluster refused it (stopped, no live worker): that request fails
            self._handle([RequestDone(sub.req_id, False, f"not submitted: {e}", [], 0, None, None, {})])

    def _release(self, req_id: str, release: Release) -> None:
        live = self.live.get(req_id)
        if live is None or live.release is not None:
            return
        live.release = release
        if live.done is not None:
            self._settle(live)
        elif self._abort is not None:
            self._abort(req_id, release.error or f"finished ({release.finish_reason}) before the engine did")

    def _handle(self, events: list) -> None:
        steps, transfers = [], []
        for e in events:
            if isinstance(e, TokenEvent):
                live = self.live.get(e.req_id)
                if live is None:
                    continue
                self.metrics.token(live, e)
                live.output_ids.append(e.token_id)
                live.token_times.append(e.t)
                live.received.append(e.received)
                if live.release is None:
                    live.sub.deliver(e)
            elif isinstance(e, RequestDone):
                live = self.live.get(e.req_id)
                if live is None:
                    continue
                live.done = e
                if live.release is None:
                    live.sub.deliver(e)
                else:
                    self._settle(live)
            elif isinstance(e, StepEvent):
                steps.append({"worker": e.worker, "role": e.role, **e.record})
                self.metrics.step(e.worker, e.record)
            elif isinstance(e, TransferEvent):
                transfers.append(e.record)
                self.metrics.transfer(e.record)
                if self.paths is not None:
                    self.paths.saw(e.record)
            elif isinstance(e, WorkerFailed):
                self._fail(f"worker {e.worker} failed: {e.reason}")
        self.ledger.steps(steps)
        self.ledger.transfers(transfers)

    def _settle(self, live: Live, why: Optional[str] = None) -> None:
        self.live.pop(live.sub.req_id, None)
        self.ledger.request(live, why)
        if live.release is not None and live.release.error is None:
            self.metrics.done(live, live.release.finish_reason)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.on_failure(reason)
