"""EndpointCluster: the harness's `Cluster`, played by a running OpenAI-compatible server that pdlab measures
but neither starts nor stops (engine.backend: endpoint; docs/external.md).

`start` probes it again (pdlab.external.probe: it may have changed since the run began) and writes what it
found to `servers/<label>.json`. Every request is one streamed `/completions` on the cluster's client loop:
the prompt as token ids, or as text decoded with the recipe's tokenizer where the server refuses ids; the
output as the ids the server returns, or its text counted with that tokenizer.

The service is one worker to pdlab: unified, it is the prefill and the decode worker of every request (the
client-side attribution matches a slow gap to other requests' prefills there); disaggregated, its prefill
and decode are named apart (`NAME:prefill`, `NAME:decode`), since the service says it prefills elsewhere.
A connection that breaks off makes the client ask /models once: a server that no longer answers is a failed
worker, which ends the run as a dead pdlab worker does, with partial results.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional
from urllib.parse import urlsplit

from pdlab.external.client import ClientCluster, ClientRequest
from pdlab.external.cluster import ServerInfo
from pdlab.external.probe import EndpointInfo, api_key, auth_headers, load_tokenizer, probe, redact, root_of
from pdlab.serve.topology import ClusterError
from pdlab.external.stream import StreamError, chunk_text, chunk_tokens, completion_body, request_json, stream_completion
from pdlab.serve.events import WorkerFailed

LIVENESS_TIMEOUT_S = 10.0
RESET_PATH = "/reset_prefix_cache"  # vLLM's (served with VLLM_SERVER_DEV_MODE=1); others may lack it


class EndpointCluster(ClientCluster):
    def __init__(self, v: Any, deployment: Any, *, label: str, log_dir: Optional[str] = None):
        super().__init__(label, deployment.step_timeout_s)
        self.v, self.backend, self.deployment, self.label = v, v.backend, deployment, label
        self.log_dir = log_dir  # None: no run directory, and nothing written (a client of its own, a benchmark)
        ep = deployment.endpoint
        self.name = ep.label or urlsplit(self.backend.url).netloc
        self._key = api_key(self.backend, f"variants.{v.name}")  # in memory only: never written, never quoted
        self.headers = auth_headers(self._key)
        self.info: Optional[EndpointInfo] = None
        self.tokenizer: Any = None
        self.resets = {"ok": 0, "failed": 0, "error": None}
        self.dead: Optional[str] = None
        self._reported = False
        self._checking = False

    @property
    def workers(self) -> list[ServerInfo]:
        ep = self.deployment.endpoint
        return [ServerInfo(self.name, "unified" if ep.kind == "unified" else "disagg",
                           [f"{ep.devices} device{'s' if ep.devices != 1 else ''} @ {urlsplit(self.backend.url).netloc}"])]

    # ---- lifecycle: nothing to start or stop, only the client ----
    def start(self) -> None:
        super().start()
        try:
            self.info = self.client.call(probe(self.client.session, self.backend, self._key, self._has_tokenizer))
        except ClusterError as e:
            self.stop()
            raise ClusterError(redact(str(e), self._key)) from None
        except BaseException:
            self.stop()
            raise
        self._write_info()

    def _has_tokenizer(self) -> bool:
        self.tokenizer = self.tokenizer or load_tokenizer(self.v.model)
        return self.tokenizer is not None

    def _write_info(self) -> None:
        """What served the variant (never the key: only the name of its variable), in the run directory's
        servers/ (none without one)."""
        if self.log_dir is None:
            return
        ep = self.deployment.endpoint
        info = {"backend": "endpoint", **(self.info.to_dict() if self.info else {}), "label": self.name,
                "kind": ep.kind, "devices": ep.devices, "api_key_env": self.backend.api_key_env,
                "prefix_cache_reset": dict(self.resets)}
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{self.label}.json"), "w") as f:
            json.dump(info, f, indent=2)

    def reset_prefix_cache(self) -> bool:
        """Best effort: vLLM's /reset_prefix_cache. Whether it worked is counted in servers/<label>.json."""
        url = f"{root_of(self.backend.url)}{RESET_PATH}"
        try:
            self.client.call(request_json(self.client.session, "POST", url, None, self.headers, LIVENESS_TIMEOUT_S))
            self.resets["ok"] += 1
            ok = True
        except StreamError as e:
            self.resets["failed"] += 1
            self.resets["error"] = self.scrub(str(e))
            ok = False
        self._write_info()
        return ok

    # ---- requests ----
    def scrub(self, error: str) -> str:
        return redact(error, self._key)

    def check_health(self) -> None:
        if self.dead and not self._reported:
            self._reported = True
            self.events.put(WorkerFailed(self.name, self.dead))

    def prepare(self, req: ClientRequest) -> None:
        """In the submitting thread: the body, with the prompt decoded to text where the server wants text
        (a tokenizer's work kept off the loop, where it would delay the stamps of other streams)."""
        info = self.info
        assert info is not None, "start() probes the endpoint first"
        prompt: Any = self.tokenizer.decode(req.prompt_ids) if info.prompt_as == "text" else req.prompt_ids
        req.client["prompt_as"] = info.prompt_as
        req.body = completion_body(prompt, req.max_tokens, stream=True, model=info.model)

    async def serve(self, req: ClientRequest) -> None:
        info = self.info
        if self.deployment.disaggregated:
            req.prefill_worker, req.decode_worker = f"{self.name}:prefill", f"{self.name}:decode"
        else:
            req.prefill_worker = self.name
        worker = req.decode_worker or self.name

        def on_chunk(event: dict, t: float) -> None:
            ids = chunk_tokens(event)
            if not ids and info.output_as == "text" and (text := chunk_text(event)):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.chunk(req, worker, ids, t)

        try:
            final = await stream_completion(self.client.session, f"{info.url}/completions", req.body, on_chunk,
                                            headers=self.headers)
        except StreamError as e:
            if e.connection:
                await self._still_there()
            raise
        req.usage = final.get("usage")

    async def _still_there(self) -> None:
        """A connection broke off: is the server still there? One check at a time; a failed one is final."""
        if self._checking or self.dead:
            return
        self._checking = True
        try:
            await request_json(self.client.session, "GET", f"{self.backend.url}/models", headers=self.headers,
                               timeout=LIVENESS_TIMEOUT_S)
        except StreamError as e:
            if e.connection:
                self.dead = self.scrub(f"endpoint {self.name} ({self.backend.url}) stopped answering: "
                                       f"{str(e).split(': ', 1)[-1]}")
        finally:
            self._checking = False
