"""ExternalCluster: the harness's `Cluster`, played by external servers (vLLM) that pdlab starts.

It has the Cluster's surface and events (pdlab.external.client), so the harness, records, summary, compare
and verdict do not know which engine ran. Each request is one coroutine on the cluster's client loop:
unified, one streamed completion on the least-loaded server; disaggregated, pdlab plays vLLM's proxy: the
prefill server gets the prompt with max_tokens 1 and `kv_transfer_params: {do_remote_decode: true, ...}`,
then the decode server streams the whole output with the parameters the prefill server returned (it pulls
the KV over NIXL instead of recomputing it).

Each request carries its own sampling (temperature, top_p, seed, ignore_eos, stop_token_ids: the client's
under `pdlab serve`, greedy with EOS ignored under the harness; pdlab.external.client.vllm_sampling); the
prefill call carries it too, as vLLM's proxy forwards the whole request. `abort` cancels a request's
coroutine, which closes its stream, and vLLM aborts it.

There are no step records (the servers keep their steps to themselves): interference attribution of these
variants is the client-side one. Every server is stopped on exit, on failure, on Ctrl-C and at interpreter
exit.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.external.client import ClientCluster, ClientRequest
from pdlab.external.server import HOST, Server, ServerError
from pdlab.external.stream import StreamError, chunk_tokens, completion_body, request_json, stream_completion
from pdlab.external.vllm import model_dir, server_specs
from pdlab.serve.events import WorkerFailed
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
    inflight: int = 0  # touched on the client loop only
    failed: Optional[str] = None

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.server.spec.port}{path}"


class ExternalCluster(ClientCluster):
    def __init__(self, v: Any, deployment: Any, *, label: str, log_dir: str):
        """`v`: a resolved Variant (model, engine, backend, seed); `deployment` may differ from v's
        (calibration runs one unified worker); `label` names its server logs in `log_dir` (a run directory's
        `servers/`: the logs outlive the servers, for whoever reads why one failed)."""
        self.placements = place(deployment)  # raises ClusterError: nothing has started yet
        super().__init__(label, deployment.step_timeout_s)
        self.v, self.deployment, self.label = v, deployment, label
        self.log_dir = log_dir
        self.slots: dict[str, _Slot] = {}

    @property
    def workers(self) -> list[ServerInfo]:
        return [ServerInfo(n, s.server.spec.role, s.devices, s.server.pid, s.server.spec.port)
                for n, s in self.slots.items()]

    # ---- lifecycle ----
    def start(self) -> None:
        super().start()
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
        """Stop the client, then every server this cluster started. Idempotent."""
        if self._stopped:
            return
        super().stop()
        for slot in self.slots.values():
            slot.server.stop()
        _live.discard(self)

    def reset_prefix_cache(self) -> bool:
        """Every rate starts cold (vLLM's /reset_prefix_cache, served in its dev mode on loopback). Whether
        every live server reset its cache."""
        ok = True
        for slot in self._live_slots():
            try:
                self.client.call(request_json(self.client.session, "POST", slot.url("/reset_prefix_cache"), {}),
                                 timeout=60.0)
            except StreamError:
                ok = False  # an older server without the endpoint: the cache stays warm
        return ok

    # ---- internals ----
    def _live_slots(self, role: Optional[str] = None) -> list[_Slot]:
        return [s for s in self.slots.values() if s.failed is None and (role is None or s.server.spec.role == role)]

    def _take(self, role: str) -> _Slot:
        slots = self._live_slots(role)
        if not slots:
            raise StreamError(f"no live {role} server")
        slot = min(slots, key=lambda s: (s.inflight, s.server.spec.name))
        slot.inflight += 1
        return slot

    def check_health(self) -> None:
        for name, slot in self.slots.items():
            if slot.failed is None and (reason := slot.server.exit_reason()):
                slot.failed = reason
                self.events.put(WorkerFailed(name, reason))

    async def serve(self, req: ClientRequest) -> None:
        session = self.client.session
        prefill = decode = None
        extra: dict = {}
        try:
            if self.deployment.disaggregated:
                prefill = self._take("prefill")
                req.prefill_worker = prefill.server.spec.name
                req.phases["prefill_start"] = time.monotonic()
                body = completion_body(req.prompt_ids, 1, stream=False,
                                       extra={**req.sampling, "kv_transfer_params": PREFILL_KV_PARAMS})
                resp = await request_json(session, "POST", prefill.url("/v1/completions"), body)
                req.phases["prefill_end"] = time.monotonic()
                kv = resp.get("kv_transfer_params") if isinstance(resp, dict) else None
                if not kv:
                    raise StreamError(f"prefill server {prefill.server.spec.name} returned no kv_transfer_params "
                                      "(is it a NixlConnector kv_producer?)")
                extra = {"kv_transfer_params": kv}
            decode = self._take("decode" if self.deployment.disaggregated else "unified")
            name = decode.server.spec.name
            if prefill is None:
                req.prefill_worker = name
            else:
                req.decode_worker = name
            body = completion_body(req.prompt_ids, req.max_tokens, stream=True, extra={**req.sampling, **extra})

            def on_chunk(event: dict, t: float) -> None:
                self.chunk(req, name, chunk_tokens(event), t, finished(event))

            final = await stream_completion(session, decode.url("/v1/completions"), body, on_chunk)
            req.usage = final.get("usage")
        finally:
            for slot in (prefill, decode):
                if slot is not None:
                    slot.inflight -= 1


def finished(event: dict) -> bool:
    """Whether a streamed chunk is the server's last for its request (it carries a finish_reason)."""
    return any(c.get("finish_reason") for c in event.get("choices") or [])


@atexit.register
def _stop_all() -> None:
    for c in list(_live):
        c.stop()
