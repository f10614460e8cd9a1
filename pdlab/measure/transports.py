"""The KV path each variant actually used, as its transfer records report it: env.json and the live view.

The recipe says which transport a variant asks for; a transfer record's `path` says what it went through
(shm: shm; nixl: the backend and the UCX lanes its endpoint selected, e.g. `UCX intra-node rma_am(tcp/lo)
...`). Both go to env.json under `transports` as soon as they are known, and to the live view, so a run
whose NIXL hand-over silently took TCP says so while it runs and afterwards.
"""

from __future__ import annotations

from typing import Any, Optional

from pdlab.kv.ucx_log import rma_over_tcp


class TransportPaths:
    def __init__(self, rd: Any, view: Any):
        self.rd, self.view = rd, view
        self.entries: dict[str, dict] = {}  # variant -> env.json entry
        self.variant: Optional[str] = None

    def start(self, variant: str, deployment: Any) -> None:
        """A variant's cluster is up: record what it asked for; its workers show the transport."""
        self.variant = variant
        if not deployment.disaggregated or deployment.endpoint is not None:  # an endpoint's path is its own
            return
        entry = {"transport": deployment.transport, "mode": deployment.mode, "paths": []}
        if getattr(deployment, "nixl", None) is not None:
            entry["nixl"] = deployment.nixl.to_raw()
        self.entries[variant] = entry
        self._write()
        for w in deployment.workers:
            self.view.update_worker(w.name, transport=deployment.transport)

    def saw(self, record: dict) -> None:
        """A transfer record came in: a path not seen before for this variant is recorded and shown."""
        entry = self.entries.get(self.variant or "")
        path = record.get("path")
        if entry is None or not path or path in entry["paths"]:
            return
        entry["paths"].append(path)
        self._write()
        for w in (record.get("src"), record.get("dst")):
            if w:
                self.view.update_worker(w, transport=path)
        self.view.note(f"{self.variant}: KV hand-over {record.get('src')} -> {record.get('dst')} via {path}")
        if record.get("transport") == "nixl":
            if rma_over_tcp(path):
                self.view.note(f"warning: {self.variant}: NIXL moves KV over TCP ({path}); see pdlab doctor")

    def _write(self) -> None:
        self.rd.update_env(transports=self.entries)
