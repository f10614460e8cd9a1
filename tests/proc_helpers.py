"""A process's descendants, as the tests that check for orphans look for them.

pdlab forks its CPU workers from multiprocessing's fork server (pdlab.serve.process.start_process): they are
grandchildren of the pdlab process, named pdlab-<worker> at the OS level (/proc/PID/comm).

The suite may run in several processes at once (pytest-xdist), so a check for what is left behind looks only
at what is its own: processes started under the same xdist worker (`ours`), and shared-memory segments of the
runs its processes had mapped (`run_prefixes`, `segments_with`)."""

import os

from pdlab.constants import SHM_DIR
from pdlab.kv.shm import PREFIX


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in sorted(kids.get(todo.pop(0), [])):
            out.append(k)
            todo.append(k)
    return out


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; only its parent, or init, has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def workers_of(pid: int) -> list[int]:
    """`pid`'s worker processes (pdlab-prefill0, pdlab-decode0, ...)."""
    return [p for p in descendants(pid) if name_of(p).startswith("pdlab-")]


def ours(pid: int) -> bool:
    """`pid` was started under this test process's xdist worker (its environment says the same worker; a
    process re-parented to init keeps its environment, so an orphan is still recognised)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    mine = os.environ.get("PYTEST_XDIST_WORKER")
    theirs = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PYTEST_XDIST_WORKER=")), None)
    return theirs == mine


def run_prefixes(pids) -> set[str]:
    """The run prefixes (`pdlab-<hex>-`) of the shared-memory segments that `pids` have mapped."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths = [line.split()[-1] for line in f if f" {SHM_DIR}/{PREFIX}" in line]
        except OSError:
            continue
        out |= {"-".join(os.path.basename(p).split("-")[:2]) + "-" for p in paths}
    return out


def segments_with(prefixes) -> set[str]:
    """The segments in /dev/shm whose names start with one of `prefixes`."""
    prefixes = tuple(prefixes)
    return {n for n in os.listdir(SHM_DIR) if prefixes and n.startswith(prefixes)}
