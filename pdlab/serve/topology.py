"""The machine check: does this machine have what a deployment asks for? Decided before any process starts,
so a missing core or GPU is one clear error instead of a half-started cluster. The deployment's shape
was checked when the recipe was parsed (pdlab.recipe.deployment); this module only looks at the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdlab.devices import parse_devices
from pdlab.recipe.deployment import Deployment, PlannedWorker


class ClusterError(ValueError):
    """A deployment that cannot run here, or a cluster that failed; the message says which and why."""


@dataclass(frozen=True)
class Placement:
    """A planned worker and what it may see: physical GPUs, its own first (cuda only)."""

    worker: PlannedWorker
    visible_gpus: tuple[int, ...] = ()


_CORES: list[int] = []


def cpu_cores() -> list[int]:
    """The cores this process could use when first asked: `pdlab run` may later move its main process off the
    workers' cores, and the workers may still use theirs."""
    if not _CORES:
        _CORES.extend(sorted(os.sched_getaffinity(0)))
    return list(_CORES)


def gpu_ids() -> list[int]:
    """Physical GPU ids this process may use, by visible index (no CUDA context is created)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        count = 0
    ids = list(range(count))
    if env is not None:
        ids = [int(x) for x in env.split(",") if x.strip().isdigit() and int(x) < count]
    return ids


def place(deployment: Deployment) -> list[Placement]:
    """Check that every worker's devices exist and are visible to this process; say what each may see."""
    cores = cpu_cores() if deployment.device_kind == "cpu" else []
    gpus = gpu_ids() if deployment.device_kind == "cuda" else []
    for w in deployment.workers:
        for d in parse_devices(list(w.devices)):
            if d.kind == "cpu" and d.index not in cores:
                raise ClusterError(f"worker {w.name}: {d} does not exist (this process may use cores "
                                   f"{cores[0]}-{cores[-1]})")
            if d.kind == "cuda" and d.index >= len(gpus):
                raise ClusterError(f"worker {w.name}: {d} does not exist ({len(gpus)} CUDA devices visible)")
    out = []
    for w in deployment.workers:
        visible: tuple[int, ...] = ()
        if deployment.device_kind == "cuda":
            own = [gpus[d.index] for d in parse_devices(list(w.devices))]
            peers = []
            if deployment.disaggregated and deployment.transport == "cuda-ipc":  # to open the peers' handles
                other = "decode" if w.role == "prefill" else "prefill"
                peers = [gpus[d.index] for p in deployment.workers if p.role == other
                         for d in parse_devices(list(p.devices))]
            visible = tuple(own + [g for g in dict.fromkeys(peers) if g not in own])
        out.append(Placement(w, visible))
    return out
