"""The machine check: does this machine have what a deployment asks for? Decided before any process starts,
so a missing core or GPU is one clear error instead of a half-started cluster. The deployment's shape
was checked when the recipe was parsed (pdlab.recipe.deployment); this module only looks at the machine.

GPUs are named by their CUDA_VISIBLE_DEVICES entries (index, UUID or MIG; pdlab.gpus). cuda-ipc between two
different GPUs needs peer access: without it CUDA stages the copy through the host outside any stream the
peer orders against, so such a deployment is refused here with a pointer to the `host` transport. What GPU
workers share (memory of a shared GPU, host cores) is split here too (pdlab.serve.sharing).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

from pdlab import gpus as gpu_inventory
from pdlab.devices import parse_devices
from pdlab.recipe.deployment import Deployment, PlannedWorker
from pdlab.recipe.nodes import ControlSpec
from pdlab.serve.curve import ClusterKeys, KeysError
from pdlab.serve.sharing import host_cores, memory_shares


class ClusterError(ValueError):
    """A deployment that cannot run here, or a cluster that failed; the message says which and why."""


@dataclass(frozen=True)
class Placement:
    """A planned worker and what it may see: GPU entries, its own first in rank order (cuda only); its share
    of its GPUs' memory; the host cores a GPU worker is pinned to."""

    worker: PlannedWorker
    visible_gpus: tuple[str, ...] = ()
    memory_share: float = 1.0
    host_cores: tuple[int, ...] = ()


_CORES: list[int] = []


def cpu_cores() -> list[int]:
    """The cores this process could use when first asked: `pdlab run` may later move its main process off the
    workers' cores, and the workers may still use theirs."""
    if not _CORES:
        _CORES.extend(sorted(os.sched_getaffinity(0)))
    return list(_CORES)


def deployment_cores(dep: Deployment) -> set[int]:
    """The cores of this machine a deployment's workers are pinned to (a GPU worker: its host cores, as the
    launcher will give them, pdlab.serve.sharing; a worker on another node pins that node's; an endpoint none)."""
    if dep.endpoint is not None:
        return set()
    if dep.device_kind == "cuda":
        return {c for mine in host_cores(cpu_cores(), len(dep.workers)) for c in mine}
    return {d.index for w in dep.workers if w.node is None for d in parse_devices(list(w.devices)) if d.kind == "cpu"}


def main_shares_cores(dep: Deployment) -> bool:
    """Whether a run of deployment `dep` here leaves its main process (router, harness) no core of its own: every
    worker on this machine's CPU cores, and none of the cores this process may use spare (`pdlab run` moves it
    off the workers' cores when one is)."""
    if dep.device_kind != "cpu" or any(w.node is not None for w in dep.workers):
        return False
    cores = deployment_cores(dep)
    return bool(cores) and not set(cpu_cores()) - cores


def gpu_ids() -> list[str]:
    """GPU entries this process may use, by visible index (no CUDA context is created)."""
    return gpu_inventory.gpu_entries()


def place(deployment: Deployment, peer_access: gpu_inventory.PeerAccess = gpu_inventory.nvml_peer_access,
          node: Optional[str] = None) -> list[Placement]:
    """Check that the devices of every worker on `node` (None: this machine, the launcher's) exist and are
    visible to this process (and, for cuda-ipc across GPUs, can reach each other); say what each may see and
    what share of its GPUs it gets. Workers on other nodes are placed by their node's agent (`node` there):
    here they get a bare Placement, in the deployment's order."""
    if node is None and deployment.control is not None:
        _check_control(deployment.control)
    mine = [w for w in deployment.workers if w.node == node]
    placed = {p.worker.name: p for p in _place(deployment, mine, peer_access)}
    return [placed.get(w.name) or Placement(w) for w in deployment.workers]


def _place(deployment: Deployment, workers: list[PlannedWorker], peer_access: gpu_inventory.PeerAccess
           ) -> list[Placement]:
    cores = cpu_cores() if deployment.device_kind == "cpu" else []
    gpus = gpu_ids() if deployment.device_kind == "cuda" else []
    for w in workers:
        for d in parse_devices(list(w.devices)):
            if d.kind == "cpu" and d.index not in cores:
                raise ClusterError(f"worker {w.name}: {d} does not exist (this process may use cores "
                                   f"{cores[0]}-{cores[-1]})")
            if d.kind == "cuda" and d.index >= len(gpus):
                raise ClusterError(f"worker {w.name}: {d} does not exist ({len(gpus)} CUDA devices visible)")
    if deployment.device_kind != "cuda" or not workers:
        return [Placement(w) for w in workers]
    own_of = {w.name: [gpus[d.index] for d in parse_devices(list(w.devices))] for w in workers}
    if deployment.disaggregated and deployment.transport == "cuda-ipc":
        _check_peer_access(workers, own_of, peer_access)
    shares = memory_shares([own_of[w.name] for w in workers])
    cores = host_cores(cpu_cores(), len(workers))
    out = []
    for w, share, mine in zip(workers, shares, cores):
        own = own_of[w.name]
        peers = []
        if deployment.disaggregated and deployment.transport == "cuda-ipc":  # to open the peers' handles
            other = "decode" if w.role == "prefill" else "prefill"
            peers = [g for p in workers if p.role == other for g in own_of[p.name]]
        visible = tuple(own + [g for g in dict.fromkeys(peers) if g not in own])
        out.append(Placement(w, visible, share, mine))
    return out


def _check_peer_access(workers: list[PlannedWorker], own_of: dict[str, list[str]],
                       peer_access: gpu_inventory.PeerAccess) -> None:
    pairs = [(a, b) for p in workers if p.role == "prefill" for d in workers
             if d.role == "decode" for a in own_of[p.name][:1] for b in own_of[d.name][:1]]
    bad = gpu_inventory.no_peer_pairs(pairs, peer_access)
    if bad:
        a, b = bad[0]
        raise ClusterError(f"transport cuda-ipc between GPU {a} and GPU {b}: no peer access between them (or "
                           "NVML cannot tell), so a copy would be staged through the host unordered against "
                           "the peer's stream; use transport: host, or place both workers on GPUs with peer access")


def _check_control(control: ControlSpec) -> None:
    """The router's keys load, and its tcp:// address can be listened on here (a free port of this machine)."""
    if control.keys is not None:
        try:
            ClusterKeys.load(control.keys, server=True)
        except KeysError as e:
            raise ClusterError(f"deployment.control.keys: {e}") from None
    if control.tcp:
        host, _, port = control.address[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ listens
            try:
                s.bind(("" if host in ("*", "0.0.0.0") else host, int(port)))
            except OSError as e:
                raise ClusterError(f"deployment.control: cannot listen on {control.address} here: {e.strerror}"
                                   ) from None
