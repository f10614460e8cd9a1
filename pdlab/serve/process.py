"""How a worker process sets itself up and goes down: pinned to its devices before torch touches them, one
torch thread per core, ended with its parent. Shared by every pdlab process that computes (workers,
tensor-parallel followers, `pdlab profile`'s measuring process, a peer probe), so each runs as a worker does."""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any


def pin_process(devices: tuple[str, ...], tp: int = 1, visible_gpus: tuple[str, ...] = (),
                host_cores: tuple[int, ...] = ()) -> list[int]:
    """Pin this process to a worker's devices before torch touches them (CUDA_VISIBLE_DEVICES; CPU affinity
    and a matching OMP thread count); returns its CPU cores, for `use_threads`. Also what `pdlab profile`'s
    measuring process does (pdlab.timing.process), so a profile times steps as a worker runs them."""
    mine = devices[:1] if tp > 1 else devices  # under TP each rank pins to its own device
    cpu_cores = [int(d.split(":")[1]) for d in mine if d.startswith("cpu:")]
    if visible_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        if host_cores:  # a GPU worker's host side: its own cores, one thread each (followers inherit)
            cpu_cores = list(host_cores)
            os.sched_setaffinity(0, cpu_cores)
            os.environ["OMP_NUM_THREADS"] = str(len(cpu_cores))
    elif cpu_cores:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.sched_setaffinity(0, cpu_cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cpu_cores))
    return cpu_cores


def use_threads(cpu_cores: list[int]) -> None:
    """One torch thread per pinned core (none pinned: torch's default)."""
    if cpu_cores:
        # deferred: torch
        import torch

        torch.set_num_threads(len(cpu_cores))


def exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM us if the main process dies (even by SIGKILL): no orphan workers."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the heartbeat thread's ppid check still ends us
        pass
