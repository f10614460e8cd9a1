"""One external server process (a vLLM OpenAI API server): start it, wait until it is healthy, watch it,
stop it. It listens on loopback only, on a port pdlab picked free.

The server runs in its own process group (it forks engine processes of its own), so stopping it is one
signal to the group: SIGTERM, then SIGKILL, then a wait, which reaps the leader; members reparented to
init are reaped by init. Its output goes to a log file in the run directory; a failure quotes the last
meaningful line of it, so the one-line error names the cause.

Its temporary directory (TMPDIR) is a private one that stop() removes: vLLM puts its ipc:// sockets and
vllm_dist_* files in tempfile.gettempdir() and leaves them behind when its group is killed (seven sockets and
a file in /tmp per run otherwise). torch inductor's compile cache, which lives there too, is pointed back at
its usual place, so each start does not compile vLLM's CPU kernels afresh. A TMPDIR in the recipe's
`engine.env` is overridden for the same reason.
"""

from __future__ import annotations

import getpass
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from pdlab.constants import SHM_DIR

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 40
_PORT_WORDS = ("address already in use", "errno 98")


class ServerError(RuntimeError):
    """An external server that could not start or stopped; the message is one line and names the cause."""


def free_port() -> int:
    """A loopback TCP port that nothing listens on now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class ServerSpec:
    name: str  # the worker it plays: unified0, prefill0, decode0
    role: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # added to pdlab's environment
    port: int
    log_path: str
    cores: tuple[int, ...] = ()  # CPU affinity; () leaves it as it is


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError:
        return []


def cause(path: str) -> str:
    """The last line of a log that says what went wrong (an exception, an error), else its last line."""
    tail = [line.strip() for line in log_tail(path, 200) if line.strip()]
    for line in reversed([t for t in tail if " WARNING " not in t]):  # vLLM warns with exception text
        low = line.lower()
        if any(w in low for w in ("error", "exception", "no module named", "not found", "killed")):
            return line[-300:]
    return tail[-1][-300:] if tail else "(no output)"


class Server:
    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self.shm: set[str] = set()  # /dev/shm files its processes were seen to map
        self.tmp: Optional[str] = None  # its private TMPDIR, removed by stop()

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        s = self.spec
        exe = s.argv[0]
        if not os.path.isfile(exe):
            raise ServerError(f"{s.name}: interpreter {exe} does not exist (create vLLM's environment with "
                              "scripts/vllm-env.sh, or set engine.python)")
        if not os.access(exe, os.X_OK):
            raise ServerError(f"{s.name}: interpreter {exe} is not executable")
        if port_in_use(s.port):
            raise ServerError(f"{s.name}: port {s.port} on {HOST} is in use by another process")
        os.makedirs(os.path.dirname(s.log_path) or ".", exist_ok=True)
        self._log = open(s.log_path, "ab")
        cores = set(s.cores)
        self.tmp = tempfile.mkdtemp(prefix=f"pdlab-{s.name}-")
        env = {**_inductor_cache(), **os.environ, **dict(s.env), "TMPDIR": self.tmp}
        self.proc = subprocess.Popen(
            list(s.argv), env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def exit_reason(self) -> Optional[str]:
        """None while it runs; otherwise one line: how it ended and why (from its log)."""
        code = self.proc.poll() if self.proc else None
        if code is None:
            return None
        if code < 0:  # killed from outside: its log does not say why
            return f"server {self.spec.name} (pid {self.proc.pid}) was killed by signal {-code}"
        how = f"exited with code {code}"
        why = cause(self.spec.log_path)
        if any(w in why.lower() for w in _PORT_WORDS):
            return f"server {self.spec.name} {how}: port {self.spec.port} on {HOST} is in use ({why})"
        return f"server {self.spec.name} (pid {self.proc.pid}) {how}: {why}"

    def healthy(self, timeout: float = 2.0) -> bool:
        conn = http.client.HTTPConnection(HOST, self.spec.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def version(self) -> Optional[str]:
        """The server's own /version, None when it has none."""
        conn = http.client.HTTPConnection(HOST, self.spec.port, timeout=5)
        try:
            conn.request("GET", "/version")
            resp = conn.getresponse()
            return json.loads(resp.read()).get("version") if resp.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return None
        finally:
            conn.close()

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers 200; raises ServerError when the server exits or the deadline passes."""
        while True:
            reason = self.exit_reason()
            if reason:
                raise ServerError(f"{reason} (log: {self.spec.log_path})")
            if self.healthy():
                self.shm |= _shm_mapped(_group_pids(self.proc.pid))  # what its engine set up, for stop()
                return
            if time.monotonic() > deadline:
                raise ServerError(f"server {self.spec.name} not healthy on {HOST}:{self.spec.port} in time "
                                  f"(engine.ready_timeout_s); last log line: {cause(self.spec.log_path)} "
                                  f"(log: {self.spec.log_path})")
            time.sleep(0.5)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL after `grace`, reap the leader, then remove the shared memory its
        processes mapped that nobody maps any more (vLLM's CPU engine leaves psm_* segments behind when its
        group is killed, its resource tracker with it). Idempotent."""
        p = self.proc
        if p is not None:
            self.shm |= _shm_mapped(_group_pids(p.pid))
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
                try:
                    os.killpg(p.pid, sig)  # the group outlives its leader: its engine processes too
                except (ProcessLookupError, PermissionError):
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and _group_alive(p.pid):
                    p.poll()
                    time.sleep(0.05)
                if not _group_alive(p.pid):
                    break
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if self.shm and (p is None or not _group_alive(p.pid)):
            left = _remove_unmapped(self.shm)
            self.shm.clear()
            if left and self._log is not None:
                self._log.write(f"pdlab: removed shared memory the server left: {' '.join(left)}\n".encode())
        if self.tmp and (p is None or not _group_alive(p.pid)):
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _inductor_cache() -> dict[str, str]:
    """torch inductor's cache where it would be under the usual TMPDIR (its default), unless the user cannot be
    named, where the server's compiles go to its private TMPDIR and are lost."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names it
    except (KeyError, OSError):
        return {}
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")}


def _group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies do not count: their parent reaps them)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return bool(_group_pids(pgid))


def _shm_mapped(pids: Optional[list[int]] = None) -> set[str]:
    """/dev/shm files mapped by `pids` (None: by every process we can read)."""
    found: set[str] = set()
    for pid in pids if pids is not None else [int(d) for d in os.listdir("/proc") if d.isdigit()]:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR + "/")
                    if i >= 0:
                        found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def _remove_unmapped(paths: set[str]) -> list[str]:
    """Unlink those of `paths` that still exist and that no live process maps; returns their names."""
    in_use = _shm_mapped()
    gone = []
    for path in sorted(paths - in_use):
        try:
            os.unlink(path)
            gone.append(os.path.basename(path))
        except OSError:
            pass
    return gone
