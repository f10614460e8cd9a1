"""How pdlab starts its compute processes (workers, probe peers, a profile's measuring process): forked from
multiprocessing's fork server, which imports what they need once, or spawned where a GPU is to be used.

Why a fork server: a spawned CPU worker spent ~6 s of its core importing torch and transformers before it
loaded its model (2-core box); the fork server imports WORKER_PRELOAD once per pdlab process and each worker
is a fork of it, ready in a fraction of a second. A fork of a process that has touched CUDA cannot use CUDA,
and nothing here can promise that of the server for every driver and torch build: a process that will use a
GPU is spawned, as before, and so is every process under PDLAB_WORKER_START=spawn (a sitecustomize or
another import-time hook runs in each process then).

What a forked process would otherwise lose, it is given: the fork server holds the environment, directory,
CPU affinity and outputs pdlab had when the server started, so each process takes on ours at its start; and it is ended
with the process that started it (a pipe whose other end only that process holds, read by a thread), since
PR_SET_DEATHSIG would tie it to the server.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing import forkserver, reduction, resource_tracker
from typing import Any, Callable, Optional

from pdlab.constants import WORKER_PRELOAD, WORKER_START_ENV, WORKER_START_MODES

_lifeline: Optional[tuple[int, int, int]] = None  # (read end, write end, the pid that made it)


def start_process(target: Callable[..., None], args: tuple, name: str, gpus: bool = False) -> Any:
    """Start `target(*args)` in a daemonic process called `name` (also its OS-level name, as ps and top show
    it: pdlab-decode0); returns its multiprocessing.Process."""
    if gpus or start_mode() == "spawn":
        proc = mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(WORKER_PRELOAD))  # read when the server starts: once per pdlab process
        here = (dict(os.environ), os.getcwd(), _affinity(), _Fd(1), _Fd(2), _Fd(_lifeline_end()), name)
        proc = ctx.Process(target=_enter, args=(here, target, args), name=name, daemon=True)
    proc.start()
    return proc


def start_mode() -> str:
    """$PDLAB_WORKER_START, one of WORKER_START_MODES (ValueError otherwise: `pdlab run` checks it before
    anything starts)."""
    mode = os.environ.get(WORKER_START_ENV, WORKER_START_MODES[0]) or WORKER_START_MODES[0]
    if mode not in WORKER_START_MODES:
        raise ValueError(f"${WORKER_START_ENV}: {mode!r} is not one of {', '.join(WORKER_START_MODES)}")
    return mode


def prepare() -> None:
    """Start the fork server and wait until it has imported WORKER_PRELOAD, so that the next start_process
    returns at once where it would wait seconds for those imports: for a process that must keep answering
    while it starts workers (a node's agent heartbeats to its router)."""
    start_process(_none, (), "pdlab-prepare").join()


def stop_helpers() -> None:
    """Starting workers also started multiprocessing's fork server and resource tracker, children that Python
    < 3.13 leaves running at exit: each ends when our end of its pipe closes, after we are gone, a zombie
    re-parented to init. Stop both and wait for them, so that every child of pdlab is reaped before pdlab
    exits. Call it once no worker runs."""
    for stop in (forkserver._forkserver._stop, resource_tracker._resource_tracker._stop):
        try:
            stop()
        except Exception:  # noqa: BLE001 - a private API: if it changed, the helper ends as before
            pass


def _lifeline_end() -> int:
    """The read end of this process's lifeline: it reads EOF once this process is gone, however it ended."""
    global _lifeline
    if _lifeline is None or _lifeline[2] != os.getpid():
        r, w = os.pipe()  # not inheritable: only the processes we hand the read end to get anything
        _lifeline = (r, w, os.getpid())
    return _lifeline[0]


def _enter(here: tuple, target: Callable[..., None], args: tuple) -> None:
    """First thing in a forked process: what a spawned child would have had from its starter, then `target`."""
    env, cwd, cores, out, err, lifeline, name = here
    # every child of a fork server holds the pipe whose EOF tells the server that its clients are gone: with
    # ours held, the server would outlive pdlab as long as we run
    try:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    except (AttributeError, TypeError, OSError):  # a private API: if it changed, the server ends with us
        pass
    if lifeline is not None:
        threading.Thread(target=_end_with_starter, args=(lifeline,), name="pdlab-lifeline", daemon=True).start()
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(cwd)
    except OSError:  # removed since: stay where the fork server is
        pass
    if cores is not None:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:  # cores gone since (a cgroup changed): keep the fork server's
            pass
    for fd, own in ((out, 1), (err, 2)):
        if fd is not None:
            os.dup2(fd, own)
            os.close(fd)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - not Linux: ps shows python
        pass
    target(*args)


def _affinity() -> Optional[set[int]]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return None


def _end_with_starter(fd: int) -> None:
    """SIGTERM ourselves when the process that started us is gone (what PR_SET_PDEATHSIG does for a child)."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


class _Fd:
    """One of our file descriptors, handed to a forked process as multiprocessing hands over a pipe's end."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple:
        try:
            os.fstat(self.fd)
        except OSError:  # closed here: the child keeps the fork server's
            return (_none, ())
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return dup.detach()


def _none() -> None:
    return None


def _in_fork_server() -> bool:
    """True while the fork server imports its preload list (multiprocessing.forkserver.main is on the stack)."""
    f = sys._getframe()
    while f is not None:
        if f.f_code.co_name == "main" and f.f_code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        f = f.f_back
    return False


if _in_fork_server():
    # The server holds nothing to flush: skip the interpreter's teardown of torch and transformers (~1.5 s of a
    # core), which pdlab would otherwise wait for at its own exit (stop_helpers)
    atexit.register(os._exit, 0)
