"""What a worker process is told to be (pdlab.serve.worker), as plain data for the spawn call: its name and role,
devices, model, engine, transport and the router's socket. Its own module so that what spawns workers (the
launcher, a node's agent, a tensor-parallel group's rank 0) need not import the worker's code."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from pdlab.constants import HEARTBEAT_S
from pdlab.engine.config import EngineConfig
from pdlab.recipe.model import ModelSpec


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, from the variant's typed recipe and the launcher."""

    name: str  # "prefill0", "decode1", "unified0"
    role: str
    devices: tuple[str, ...]  # this worker's devices, e.g. ("cpu:0",) or ("cuda:2",)
    endpoint: str  # the router's socket
    model: ModelSpec
    engine: EngineConfig
    seed: int
    transport: Optional[str]  # disaggregated roles only
    mode: str
    run_prefix: str
    first_token: str
    visible_gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries (index, UUID, MIG), own GPUs first in rank order
    transfer_timeout_s: float
    heartbeat_s: float = HEARTBEAT_S
    tp: int = 1  # tensor-parallel ranks: this process is rank 0 on devices[0], followers take the rest
    nixl: Optional[dict] = None  # transport nixl: the deployment's nixl section, plain data
    memory_share: float = 1.0  # of each of its GPUs' memory (workers sharing a GPU split it, pdlab.serve.sharing)
    host_cores: tuple[int, ...] = ()  # a GPU worker's host cores (pinned, one torch thread each)
    peers: tuple[str, ...] = ()  # the workers of the other role (cuda-ipc: one pool export each)
    report_cache: bool = False  # decode role, selective routing: report prefix-cache changes (CacheEvents)
    # a tcp:// control plane's member keys (pdlab.serve.curve.ClusterKeys.member): put here by whoever spawns the
    # worker (the launcher, or the agent of its node), in memory; never part of a control message
    curve: Optional[dict] = None

    def to_raw(self) -> dict:
        """Plain data for the spawn arguments: nothing pickled needs pdlab classes."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw.update(model=self.model.to_raw(), engine=self.engine.to_raw(), devices=list(self.devices),
                   visible_gpus=list(self.visible_gpus), host_cores=list(self.host_cores), peers=list(self.peers))
        return raw

    @classmethod
    def from_raw(cls, raw: dict) -> "WorkerSpec":
        return cls(**{**raw, "model": ModelSpec.from_raw(raw["model"], "model"),
                      "engine": EngineConfig.from_raw(raw["engine"], "engine"), "devices": tuple(raw["devices"]),
                      "visible_gpus": tuple(str(g) for g in raw["visible_gpus"]),
                      "host_cores": tuple(raw.get("host_cores", ())), "peers": tuple(raw.get("peers", ()))})
