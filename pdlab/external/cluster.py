"""ExternalCluster: the harness's `Cluster`, played by external servers (vLLM) that pdlab starts.

It has the Cluster's surface (start, stop, submit, poll, reset_prefix_cache, workers, context manager)
and emits the same events (TokenEvent, RequestDone, WorkerFailed), so the harness, records, summary,
compare and verdict do not know which engine ran. Each request is one client thread: unified, one
streamed completion on the least-loaded server; disaggregated, pdlab plays vLLM's proxy: the prefill
server gets the prompt with max_tokens 1 and `kv_transfer_params: {do_remote_decode: true, ...}`, then
the decode server streams the whole output with the parameters the prefill server returned (it pulls the
KV over NIXL instead of recomputing it).

There are no step records (the servers keep their steps to themselves), so interference attribution is
empty for these variants. Every server is stopped on exit, on failure, on Ctrl-C and at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.external.server import Server, ServerError
from pdlab.external.stream import StreamError, completion_body, post_json, stream_completion
from pdlab.external.vllm import model_dir, server_specs
from pdlab.serve.router import RequestDone, TokenEvent, WorkerFailed
from pdlab.serve.topology import ClusterError, place

_live: "weakref.WeakSet[ExternalCluster]" = weakref.WeakSet()
# what vLLM's proxy sends the prefill server: "decode happens elsewhere, keep the KV for it"
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class ServerInfo:
    name: str
    role: str
    devices: list[str]
    pid: Optional[int] = None
    port: int = 0


@dataclass
class _Slot:
    server: Server
    devices: list[str]
    inflight: int = 0
    failed: Optional[str] = None


@dataclass
class _Req:
    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    phases: dict = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)


class ExternalCluster:
    def __init__(self, v: Any, deployment: Any, *, label: str, log_dir: Optional[str] = None):
        """`v`: a resolved Variant (model, engine, backend, seed); `deployment` may differ from v's
        (calibration runs one unified worker); `label` names its server logs in `log_dir`."""
        self.placements = place(deployment)  # raises ClusterError: nothing has started yet
        self.v, self.deployment, self.label = v, deployment, label
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pdlab-servers-")
        self.timeout_s = deployment.step_timeout_s
        self.slots: dict[str, _Slot] = {}
        self.events: "queue.Queue[Any]" = queue.Queue()
        self.multi_token_chunks = 0  # chunks that carried more than one token (docs/external.md)
        self._lock = threading.Lock()
        self._started = self._stopped = False

    @property
    def workers(self) -> list[ServerInfo]:
        return [ServerInfo(n, s.server.spec.role, s.devices, s.server.pid, s.server.spec.port)
                for n, s in self.slots.items()]

    # ---- lifecycle ----
    def start(self) -> None:
        if self._started:
            raise ClusterError("cluster already started")
        self._started = True
        _live.add(self)
        b = self.v.backend
        try:
            path = model_dir(self.v.model)
            specs = server_specs(name=self.label, backend=b, model=self.v.model, engine=self.v.engine,
                                 deployment=self.deployment, placements=self.placements, seed=self.v.seed,
                                 log_dir=self.log_dir, model_path=path)
            for s, p in zip(specs, self.placements):
                self.slots[s.name] = _Slot(Server(s), list(p.worker.devices))
                self.slots[s.name].server.start()
            deadline = time.monotonic() + b.ready_timeout_s
            for slot in self.slots.values():
                slot.server.wait_ready(deadline)
            self._write_version()
        except ServerError as e:
            self.stop()
            raise ClusterError(f"{b.backend}: {e}") from None
        except BaseException:
            self.stop()
            raise

    def _write_version(self) -> None:
        """What served the variant, beside its logs: the server's /version and the interpreter."""
        first = next(iter(self.slots.values()))
        info = {"backend": self.v.backend.backend, "python": self.v.backend.interpreter,
                "version": first.server.version(), "args": list(first.server.spec.argv[1:])}
        with open(os.path.join(self.log_dir, f"{self.label}.json"), "w") as f:
            json.dump(info, f, indent=2)

    def stop(self) -> None:
        """Stop every server this cluster started. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for slot in self.slots.values():
            slot.server.stop()
        _live.discard(self)

    def __enter__(self) -> "ExternalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- requests ----
    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        self._running()
        req = _Req(req_id, list(prompt_ids), int(params.get("max_tokens", 16)), {"queued": time.monotonic()})
        threading.Thread(target=self._serve, args=(req,), name=f"pdlab-client-{req_id}", daemon=True).start()

    def poll(self, timeout: float) -> list[Any]:
        """Events in arrival order; returns as soon as there are any, or after `timeout` seconds."""
        self._running()
        self._check_health()
        out = []
        try:
            out.append(self.events.get(timeout=max(0.0, timeout)))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    def reset_prefix_cache(self) -> None:
        """Every rate starts cold (vLLM's /reset_prefix_cache, served in its dev mode on loopback)."""
        for slot in self._live_slots():
            try:
                post_json(slot.server.spec.port, "/reset_prefix_cache", {}, 30.0)
            except StreamError:
                pass  # an older server without the endpoint: the cache stays warm

    # ---- internals ----
    def _running(self) -> None:
        if not self._started or self._stopped:
            raise ClusterError("cluster is not running (call start(); stop() ends it)")

    def _live_slots(self, role: Optional[str] = None) -> list[_Slot]:
        return [s for s in self.slots.values() if s.failed is None and (role is None or s.server.spec.role == role)]

    def _take(self, role: str) -> _Slot:
        with self._lock:
            slots = self._live_slots(role)
            if not slots:
                raise StreamError(f"no live {role} server")
            slot = min(slots, key=lambda s: (s.inflight, s.server.spec.name))
            slot.inflight += 1
            return slot

    def _give_back(self, slot: Optional[_Slot]) -> None:
        if slot is not None:
            with self._lock:
                slot.inflight -= 1

    def _check_health(self) -> None:
        for name, slot in self.slots.items():
            if slot.failed is None and (reason := slot.server.exit_reason()):
                slot.failed = reason
                self.events.put(WorkerFailed(name, reason))

    def _serve(self, req: _Req) -> None:
        prefill = decode = None
        extra: dict = {}
        try:
            if self.deployment.disaggregated:
                prefill = self._take("prefill")
                req.phases["prefill_start"] = time.monotonic()
                body = completion_body(req.prompt_ids, 1, stream=False, extra={"kv_transfer_params": PREFILL_KV_PARAMS})
                resp = post_json(prefill.server.spec.port, "/v1/completions", body, self.timeout_s)
                req.phases["prefill_end"] = time.monotonic()
                kv = resp.get("kv_transfer_params")
                if not kv:
                    raise StreamError(f"prefill server {prefill.server.spec.name} returned no kv_transfer_params "
                                      "(is it a NixlConnector kv_producer?)")
                extra = {"kv_transfer_params": kv}
            decode = self._take("decode" if self.deployment.disaggregated else "unified")
            body = completion_body(req.prompt_ids, req.max_tokens, stream=True, extra=extra)
            stream_completion(decode.server.spec.port, body, lambda ids, t: self._tokens(req, decode, ids, t),
                              self.timeout_s)
            self._done(req, prefill, decode, None)
        except StreamError as e:
            self._done(req, prefill, decode, str(e))
        finally:
            self._give_back(prefill)
            self._give_back(decode)

    def _tokens(self, req: _Req, slot: _Slot, ids: list[int], t: float) -> None:
        if len(ids) > 1:
            with self._lock:
                self.multi_token_chunks += 1
        for tok in ids:
            index = len(req.output_ids)
            req.output_ids.append(tok)
            self.events.put(TokenEvent(req.req_id, tok, t, index, index + 1 >= req.max_tokens,
                                       slot.server.spec.name, t))

    def _done(self, req: _Req, prefill: Optional[_Slot], decode: Optional[_Slot], error: Optional[str]) -> None:
        p = prefill.server.spec.name if prefill else (decode.server.spec.name if decode else None)
        d = decode.server.spec.name if (prefill and decode) else None
        self.events.put(RequestDone(req.req_id, error is None, error or "", list(req.output_ids), 0, p, d,
                                    dict(req.phases)))


@atexit.register
def _stop_all() -> None:
    for c in list(_live):
        c.stop()
