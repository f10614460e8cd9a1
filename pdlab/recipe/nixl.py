"""The deployment's `nixl` section: which NIXL backends the agents create and which UCX transports they may use.

    deployment: {transport: nixl, nixl: {backends: [UCX], ucx_tls: "tcp,sm,self"}}

`ucx_tls` becomes UCX_TLS in each worker before its agent starts. `auto` (the default) is resolved on the
worker's own machine by `resolve_ucx_tls`, so one recipe works on a CPU box and on an RDMA cluster; an
explicit list is passed as is (UCX warns about, and skips, listed transports the machine lacks). Whatever
was chosen, the path UCX actually took is recorded per transfer (`path` in transfers.jsonl) and in env.json.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import NIXL_BACKENDS, NIXL_MODULES, NIXL_UCX_TLS, NIXL_UCX_TLS_BASE
from pdlab.fields import Section, spec

INSTALL_HINT = "pip install -e '.[nixl]' (the nixl-cu12 wheel)"


def _backends(v: Any) -> tuple[str, ...]:
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError
    return tuple(names)


def _tls(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or " " in v.strip():
        raise ValueError
    return v.strip()


@dataclass(frozen=True)
class NixlConfig(Section):
    backends: tuple[str, ...] = spec(NIXL_BACKENDS, "a list of NIXL backend names such as [UCX]", _backends)
    ucx_tls: str = spec(NIXL_UCX_TLS, "auto or a UCX_TLS list such as \"tcp,sm,self\" or \"rc,sm,self,cuda_copy\"",
                        _tls)


def rdma_devices() -> list[str]:
    """InfiniBand/RoCE devices the kernel knows (what UCX's rc/ud transports would use)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def resolve_ucx_tls(value: str, cuda: bool) -> str:
    """UCX_TLS for one worker: `auto` -> what works here; anything else unchanged."""
    if value != "auto":
        return value
    tls = NIXL_UCX_TLS_BASE
    if rdma_devices():
        tls += ",rc,ud"
    if cuda:
        tls += ",cuda_copy,cuda_ipc"
    return tls


def nixl_module() -> Optional[str]:
    """The importable NIXL module (its `_api` holds nixl_agent), or None when the extra is not installed."""
    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None
