"""What UCX actually selected for a NIXL agent's endpoints, read from UCX's own log.

NIXL does not say which UCX transports carry a transfer (its backend params are empty, `query_xfer_backend`
answers "UCX"). UCX does, at log level info: for every new endpoint it prints the lanes it chose, e.g.
`pdlab-...-decode0 intra-node cfg#1 rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)`
(the first word is the agent's name). UCX reads UCX_LOG_FILE and UCX_LOG_LEVEL once per process, when it
loads, so `ucx_log_file()` sets them before the first agent; the file is private to this process (and
keeps UCX's warnings off the run's own output), and it is removed at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import tempfile
from typing import Optional

_LANES = re.compile(r"UCX\s+INFO\s+(\S+)\s+((?:intra|inter)-node) cfg#\d+\s+(.*)$")
_log_dir: Optional[str] = None


def ucx_log_file(prefix: str = "pdlab-") -> str:
    """The file UCX logs to in this process (set before UCX loads: UCX reads it once per process). Its folder's
    name starts with `prefix`: a worker passes its run's prefix, so the cluster that started it removes the
    folder even when the worker was killed and ran no exit hook (pdlab.kv.shm.sweep_tmp)."""
    global _log_dir
    if os.environ.get("UCX_LOG_FILE"):
        return os.environ["UCX_LOG_FILE"]
    _log_dir = tempfile.mkdtemp(prefix=f"{prefix}ucx-")
    atexit.register(shutil.rmtree, _log_dir, True)
    os.environ["UCX_LOG_FILE"] = os.path.join(_log_dir, "ucx.log")
    os.environ.setdefault("UCX_LOG_LEVEL", "info")  # the lanes of each endpoint are logged at info
    return os.environ["UCX_LOG_FILE"]


def remove_log_dir() -> None:
    """Remove the log folder this process made, if it made one: a worker calls this on its way out, since a
    forked worker ends with os._exit, which runs no atexit hook. Its lanes can no longer be read after."""
    global _log_dir
    if _log_dir is not None:
        shutil.rmtree(_log_dir, ignore_errors=True)
        _log_dir = None


def read_lanes(agent: str, log_file: Optional[str] = None) -> Optional[str]:
    """The last endpoint configuration UCX logged for `agent`: 'intra-node rma_am(tcp/lo) ...', or None."""
    _flush_stdio()  # UCX writes its log through a buffered FILE*
    try:
        with open(log_file or ucx_log_file(), errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = _LANES.search(line.rstrip())
        if m and m.group(1) == agent:
            return f"{m.group(2)} {' '.join(m.group(3).split())}"
    return None


def data_lanes(lanes: Optional[str]) -> list[str]:
    """The UCX transports that move the bytes of a READ/WRITE: the `rma` lanes, or, where RMA is emulated
    over active messages (`rma_am`), those and the `am` lanes (whose zero-copy lane, e.g. cma/memory,
    carries the bulk data)."""
    groups = dict(re.findall(r"\b(rma|rma_am|am)\(([^)]*)\)", lanes or ""))
    if "rma" in groups:
        return groups["rma"].split()
    return (groups.get("rma_am", "") + " " + groups.get("am", "")).split() if "rma_am" in groups else []


def rma_over_tcp(lanes: Optional[str]) -> bool:
    """True when UCX moves the data over TCP only: the slow path NIXL users hit unawares."""
    data = data_lanes(lanes)
    return bool(data) and all(t.startswith("tcp/") for t in data)


def _flush_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - not glibc: the lanes show once UCX flushes on its own
        pass
