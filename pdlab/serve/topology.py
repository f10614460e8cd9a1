"""Deployment checking: which workers, on which devices, with which transport - decided before any
process starts, so a bad topology is one clear error instead of a half-started cluster.

    {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}
    {"prefill": {"replicas": 1, "devices": ["cuda:0"]}, "decode": {"devices": ["cuda:1"]},
     "transport": "cuda-ipc", "mode": "push", "first_token": "decode", "share_devices": False,
     "transfer_timeout_s": 30, "control": "tcp://10.0.0.1:5555"}   # control: only to leave ipc://

A role's devices are split among its replicas: one list entry per replica when the counts match
(["cuda:0-3", "cuda:4-7"]), else the devices spread evenly. With `share_devices`, replicas may also
share devices round-robin, and roles may overlap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.devices import Device, overlaps, parse_devices

KNOWN_KEYS = {"unified", "prefill", "decode", "transport", "mode", "first_token", "share_devices",
              "transfer_timeout_s", "control"}


class ClusterError(ValueError):
    """A deployment that cannot run, or a cluster that failed; the message says which and why."""


@dataclass
class PlannedWorker:
    name: str
    role: str
    devices: list[str]
    visible_gpus: list[int] = field(default_factory=list)  # physical GPUs, own first (cuda only)


@dataclass
class Plan:
    workers: list[PlannedWorker]
    disaggregated: bool
    transport: str = "shm"
    mode: str = "pull"
    first_token: str = "decode"
    transfer_timeout_s: float = 30.0
    control: Optional[str] = None


def cpu_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


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


def _groups(role: str, cfg: Any, share: bool) -> list[list[Device]]:
    if not isinstance(cfg, dict):
        raise ClusterError(f"deployment.{role} must be a mapping like {{replicas: 1, devices: [cpu:0]}}")
    replicas = cfg.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        raise ClusterError(f"deployment.{role}.replicas must be >= 1, got {replicas!r} (zero {role} workers)")
    specs = cfg.get("devices") or [f"cpu:{c}" for c in cpu_cores()]
    specs = [specs] if isinstance(specs, str) else list(specs)
    try:
        if len(specs) == replicas and replicas > 1:
            groups = [parse_devices(s) for s in specs]
        else:
            devs = parse_devices(specs)
            if len(devs) % replicas == 0:
                k = len(devs) // replicas
                groups = [devs[i * k:(i + 1) * k] for i in range(replicas)]
            elif share and replicas % len(devs) == 0:
                groups = [[devs[i % len(devs)]] for i in range(replicas)]
            else:
                raise ClusterError(f"deployment.{role}: {len(devs)} devices cannot be split among {replicas} "
                                   "replicas (give one device entry per replica, or share_devices: true)")
    except ClusterError:
        raise
    except ValueError as e:
        raise ClusterError(f"deployment.{role}.devices: {e}") from None
    return groups


def plan(deployment: dict) -> Plan:
    if not isinstance(deployment, dict):
        raise ClusterError("deployment must be a mapping")
    unknown = set(deployment) - KNOWN_KEYS
    if unknown:
        raise ClusterError(f"deployment: unknown keys {sorted(unknown)} (known: {sorted(KNOWN_KEYS)})")
    share = bool(deployment.get("share_devices", False))
    if "unified" in deployment:
        if "prefill" in deployment or "decode" in deployment:
            raise ClusterError("deployment: give either unified, or prefill and decode, not both")
        roles = ["unified"]
    else:
        missing = [r for r in ("prefill", "decode") if r not in deployment]
        if missing:
            raise ClusterError(f"deployment: a disaggregated deployment needs prefill and decode workers; "
                               f"zero {' and '.join(missing)} workers given")
        roles = ["prefill", "decode"]
    p = Plan([], roles != ["unified"], str(deployment.get("transport", "shm")), str(deployment.get("mode", "pull")),
             str(deployment.get("first_token", "decode")), float(deployment.get("transfer_timeout_s", 30)),
             deployment.get("control"))
    if p.mode not in ("pull", "push"):
        raise ClusterError(f"deployment.mode must be pull or push, got {p.mode!r}")
    if p.first_token not in ("decode", "prefill"):
        raise ClusterError(f"deployment.first_token must be decode or prefill, got {p.first_token!r}")
    if p.transfer_timeout_s <= 0:
        raise ClusterError("deployment.transfer_timeout_s must be > 0")
    if p.control is not None and not str(p.control).startswith(("tcp://", "ipc://")):
        raise ClusterError(f"deployment.control must be a tcp:// or ipc:// address, got {p.control!r}")
    placed: list[tuple[str, list[Device]]] = []
    for role in roles:
        for i, devs in enumerate(_groups(role, deployment[role], share)):
            placed.append((f"{role}{i}", devs))
    _check_exist(placed)
    if not share:
        for i, (a, da) in enumerate(placed):
            for b, db in placed[i + 1:]:
                common = overlaps(da, db)
                if common:
                    raise ClusterError(f"workers {a} and {b} both use {', '.join(map(str, common))}; give them "
                                       "separate devices or set deployment.share_devices: true")
    kinds = {d.kind for _, devs in placed for d in devs}
    if len(kinds) > 1:
        raise ClusterError("deployment mixes cpu and cuda workers; all workers run on one kind of device")
    kind = kinds.pop()
    if p.disaggregated:
        _check_transport(p.transport, kind)
    phys = gpu_ids() if kind == "cuda" else []
    for name, devs in placed:
        w = PlannedWorker(name, name.rstrip("0123456789"), [str(d) for d in devs])
        if kind == "cuda":
            own = [phys[d.index] for d in devs]
            peers = []
            if p.disaggregated and p.transport == "cuda-ipc":  # peers' GPUs must be visible to open handles
                other = "decode" if w.role == "prefill" else "prefill"
                peers = [phys[d.index] for n, ds in placed if n.startswith(other) for d in ds]
            w.visible_gpus = own + [g for g in dict.fromkeys(peers) if g not in own]
        p.workers.append(w)
    return p


def _check_exist(placed: list[tuple[str, list[Device]]]) -> None:
    cores, gpus = None, None
    for name, devs in placed:
        for d in devs:
            if d.kind == "cpu":
                cores = cpu_cores() if cores is None else cores
                if d.index not in cores:
                    raise ClusterError(f"worker {name}: {d} does not exist (this process may use cores "
                                       f"{cores[0]}-{cores[-1]})")
            else:
                gpus = gpu_ids() if gpus is None else gpus
                if d.index >= len(gpus):
                    raise ClusterError(f"worker {name}: {d} does not exist ({len(gpus)} CUDA devices visible)")


def _check_transport(transport: str, kind: str) -> None:
    if transport == "shm" and kind != "cpu":
        raise ClusterError("transport shm moves CPU pools; GPU workers need cuda-ipc or host")
    if transport in ("cuda-ipc", "host") and kind != "cuda":
        raise ClusterError(f"transport {transport} needs CUDA workers; CPU workers use shm")
    if transport == "nixl":
        raise ClusterError("transport nixl is not available: pdlab has no NIXL backend yet (one node: use "
                           "cuda-ipc or host)")
    if transport not in ("shm", "cuda-ipc", "host"):
        raise ClusterError(f"unknown transport {transport!r} (known: shm, cuda-ipc, host, nixl)")
