"""A process's descendants, as the tests that check for orphans look for them.

pdlab forks its CPU workers from multiprocessing's fork server (pdlab.serve.process.start_process): they are
grandchildren of the pdlab process, named pdlab-<worker> at the OS level (/proc/PID/comm)."""

import os


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
