"""A worker's end of a KV transport, by the name a recipe gives it (deployment.transport): shm, cuda-ipc,
host or nixl. Each lives in its own module, imported only when asked for (nixl and CUDA are optional)."""

from __future__ import annotations

from typing import Optional, Sequence

from pdlab.constants import TRANSPORTS
from pdlab.kv.cuda_ipc import CudaIpcTransport
from pdlab.kv.host import HostTransport
from pdlab.kv.nixl import NixlTransport
from pdlab.kv.transfer import ShmTransport, Transport


def make_transport(name: str, worker: str, run_prefix: str, device: str = "cpu",
                   visible: Sequence[int] = (), options: Optional[dict] = None) -> Transport:
    """The transport end for one worker. `run_prefix` names its shared segments (swept on stop) and its
    NIXL agent; `options`: the deployment's nixl section as plain data, plus `timeout_s`."""
    if name == "nixl":
        o = options or {}
        return NixlTransport(worker, f"{run_prefix}{worker}", o.get("backends", ("UCX",)), o.get("ucx_tls", "auto"),
                             device, o.get("timeout_s", 30.0))
    if name == "shm":
        return ShmTransport(worker, f"{run_prefix}{worker}-kv")
    if name == "host":
        return HostTransport(worker, device, f"{run_prefix}{worker}-host")
    if name == "cuda-ipc":
        return CudaIpcTransport(worker, device, visible, (options or {}).get("peers", ()))
    raise ValueError(f"transport {name!r} is not available here (known: {', '.join(TRANSPORTS)})")
