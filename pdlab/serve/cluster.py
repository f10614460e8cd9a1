"""The launcher: checks the machine for a deployment, spawns its workers, and drives them through the router.

    v = load_recipe("recipes/long-input.yaml").resolved("disagg-push")       # typed, already checked
    with Cluster(v.model, v.engine, v.deployment, seed=v.seed) as c:
        c.start()
        c.submit("r1", [1, 2, 3], {"max_tokens": 8})
        events = c.poll(1.0)      # TokenEvent, RequestDone, StepEvent, TransferEvent, WorkerFailed
        c.abort("r1")             # its client gave up: every worker lets go, RequestDone(ok=False) follows

A deployment this machine cannot run (a core or GPU it does not have) raises ClusterError before any
process starts (see pdlab.serve.topology); its shape was checked by the recipe layer. A tcp:// control
plane is CurveZMQ (pdlab.serve.curve, pdlab.serve.guard) unless the recipe says `insecure: true`. Workers
placed on other nodes are started there by the node's agent (`pdlab worker`), which the launcher waits for
(pdlab.serve.nodes); `start()` raises ClusterError naming a node that did not join in time. `stop()`
is idempotent and also runs on `__exit__`, at interpreter exit, and when start() fails: workers are
told to stop, then terminated, then killed; sockets and the private socket directory are removed and
the run's shared-memory segments swept, even those of a worker that died by SIGKILL.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from pdlab.constants import HEARTBEAT_TIMEOUT_S, NODE_IDENTITY, READY_TIMEOUT_S, REAP_TIMEOUT_S, STOP_TIMEOUT_S
from pdlab.engine.config import EngineConfig
from pdlab.kv import shm
from pdlab.kv.fingerprint import KvFingerprint, PairingError, check_pair
from pdlab.recipe.deployment import Deployment
from pdlab.recipe.model import ModelSpec
from pdlab.serve import messages as m
from pdlab.serve.curve import ClusterKeys, KeysError, serve as curve_serve
from pdlab.serve.guard import Guard, log as control_log
from pdlab.serve.nodes import NodeLink, RemoteProc
from pdlab.serve.placement import mirrors_caches
from pdlab.serve.launch import start_process, stop_helpers
from pdlab.serve.router import (RequestDone, Router, StepEvent, TokenEvent, TransferEvent, WorkerFailed,
                                WorkerState)
from pdlab.serve.topology import ClusterError, place
from pdlab.serve.spec import WorkerSpec
from pdlab.serve.worker import run_worker
from pdlab.timing.pace import Pace

__all__ = ["Cluster", "ClusterError", "WorkerInfo", "TokenEvent", "RequestDone", "StepEvent", "TransferEvent",
           "WorkerFailed"]

_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
_warned_insecure: set[str] = set()


@dataclass
class WorkerInfo:
    name: str
    role: str
    devices: list[str]
    pid: Optional[int] = None
    kernels: dict = field(default_factory=dict)  # CPU kernels its engine runs, and why (its Ready message)
    pace: Optional[Pace] = None  # the box's pace at its start (its Ready message; pdlab.timing.pace)


class Cluster:
    def __init__(self, model: ModelSpec, engine: EngineConfig, deployment: Deployment, *, seed: int = 0,
                 run_tmp: Optional[str] = None, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.placements = place(deployment)  # raises ClusterError: nothing has started yet
        self.deployment, self.model, self.engine, self.seed = deployment, model, engine, seed
        self.run_tmp = run_tmp
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.run_prefix = f"{shm.PREFIX}{secrets.token_hex(4)}-"
        self.router: Optional[Router] = None
        self._dir: Optional[str] = None
        self._ctx: Any = None
        self._sock: Any = None
        self._stopped = False
        self._token = 0
        # wake(): another thread makes a waiting poll() return (a pipe the socket poll also watches)
        self._wake_lock = threading.Lock()
        self._wake_fds: Optional[tuple[int, int]] = None
        self._poller: Any = None
        self._woken = False
        self._guard: Optional[Guard] = None  # tcp:// with keys: who may connect (pdlab.serve.guard)
        self._nodes: Optional[NodeLink] = None  # workers on other nodes (pdlab.serve.nodes)

    @property
    def workers(self) -> list[WorkerInfo]:
        procs = self.router.workers if self.router else {}
        return [WorkerInfo(w.name, w.role, list(w.where), getattr(procs.get(w.name), "proc", None) and
                           procs[w.name].proc.pid, dict(getattr(procs.get(w.name), "kernels", {}) or {}),
                           getattr(procs.get(w.name), "pace", None))
                for w in self.deployment.workers]

    @property
    def kv_tokens(self) -> Optional[int]:
        """The fewest tokens any worker's KV pool holds, once started: no request longer than that can be
        served (None before start)."""
        ws = [w for w in self.router.workers.values() if w.ready] if self.router else []
        return min((w.kv_blocks * w.block_size for w in ws), default=None)

    # ---- lifecycle ----
    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        # deferred: zmq
        import zmq

        if self.router is not None:
            raise ClusterError("cluster already started")
        _live.add(self)
        try:
            self._dir = tempfile.mkdtemp(prefix="pdlab-", dir=self.run_tmp)  # mode 0700: only we can connect
            d = self.deployment
            endpoint = d.control.address if d.control else f"ipc://{self._dir}/router"
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.LINGER, 0)
            keys = self._secure(endpoint)  # our workers' member keys, or None
            try:
                self._sock.bind(endpoint)
            except zmq.ZMQError as e:
                raise ClusterError(f"deployment.control: cannot listen on {endpoint}: {e.strerror}") from None
            self._wake_fds = os.pipe()
            for fd in self._wake_fds:
                os.set_blocking(fd, False)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._wake_fds[0], zmq.POLLIN)
            states = [WorkerState(p.worker.name, p.worker.role, list(p.worker.devices)) for p in self.placements]
            self.router = Router(self._sock, states, mode=d.mode, first_token=d.first_token,
                                 transfer_timeout_s=d.transfer_timeout_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
                                 step_timeout_s=d.step_timeout_s, on_transfer_failure=d.on_transfer_failure,
                                 remote_prefill_min_tokens=d.route.remote_prefill_min_tokens)
            remote: dict[str, list[dict]] = {}
            for p, w in zip(self.placements, states):
                spec = WorkerSpec(p.worker.name, p.worker.role, p.worker.devices, endpoint, self.model, self.engine,
                                  self.seed, d.transport if d.disaggregated else None, d.mode, self.run_prefix,
                                  d.first_token, p.visible_gpus, d.transfer_timeout_s, tp=p.worker.tp,
                                  nixl=d.nixl.to_raw() if d.nixl and d.transport == "nixl" else None,
                                  memory_share=p.memory_share, host_cores=p.host_cores,
                                  peers=tuple(o.name for o in d.workers if d.disaggregated and o.role != p.worker.role),
                                  report_cache=p.worker.role == "decode" and self._mirror_caches(d))
                if p.worker.node:  # its node's agent starts it, with the agent's own keys
                    remote.setdefault(p.worker.node, []).append(spec.to_raw())
                    continue
                spec = replace(spec, curve=keys)
                w.proc = start_process(run_worker, (spec.to_raw(),), f"pdlab-{p.worker.name}",
                                       gpus=bool(p.visible_gpus))
                w.last_hb = time.monotonic() + 60  # grace for imports before the first heartbeat
            if remote:
                self._nodes = NodeLink(lambda ident, frame: self._sock.send_multipart([ident, frame]),
                                       secrets.token_hex(8), self.run_prefix, d.to_raw(), remote,
                                       self.heartbeat_timeout_s)
                procs = {name: proc for on_node in self._nodes.procs.values() for name, proc in on_node.items()}
                for w in states:
                    w.proc = procs.get(w.name, w.proc)
                self._wait_nodes()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _secure(self, endpoint: str) -> Optional[dict]:
        """A tcp:// control plane: CURVE with the cluster's keys (or keys made for this run when no other node
        takes part), the guard at the door; `insecure: true`: plain TCP, with a warning. Returns the member keys
        of our own workers (None: plain)."""
        c = self.deployment.control
        if c is None or not c.tcp:
            return None
        if c.insecure:
            if endpoint not in _warned_insecure:
                _warned_insecure.add(endpoint)
                control_log.warning("pdlab: warning: deployment.control: insecure: true: plain TCP on %s; anyone "
                                    "who can reach it can read the control plane and drive the workers", endpoint)
            return None
        try:
            keys = ClusterKeys.load(c.keys, server=True) if c.keys else ClusterKeys.for_run()
        except KeysError as e:
            raise ClusterError(f"deployment.control.keys: {e}") from None
        curve_serve(self._sock, keys)
        member, public = keys.run_member()
        self._guard = Guard(self._ctx, self._sock, {keys.client_public, public}, endpoint)
        return member

    def _wait_nodes(self) -> None:
        """Until every node this deployment places workers on has joined and been sent its workers."""
        c, nodes = self.deployment.control, self._nodes
        deadline = time.monotonic() + c.join_timeout_s
        while nodes.waiting():
            self._pump(0.1)
            if nodes.error:
                raise ClusterError(nodes.error)
            failed = [e for e in self.router.events if isinstance(e, WorkerFailed)]
            if failed:
                raise ClusterError(f"worker {failed[0].worker} failed to start: {failed[0].reason}")
            if time.monotonic() > deadline:
                n = nodes.waiting()[0]
                refused = self._guard.summary() if self._guard else ""
                keys = f" --keys {c.keys}" if c.keys else " --insecure" if c.insecure else ""
                raise ClusterError(f"node {n} did not join within {c.join_timeout_s:g}s" +
                                   (f"; the control plane {refused}" if refused else "") +
                                   f" (on node {n}: pdlab worker --join {c.address} --devices "
                                   f"{nodes.describe(n)} --name {n}{keys})")
        for w in self.router.workers.values():
            if isinstance(w.proc, RemoteProc):
                w.last_hb = time.monotonic() + 60  # grace for imports before the first heartbeat

    def _mirror_caches(self, d: Any) -> bool:
        """Decode workers report their prefix-cache changes to the router (pdlab.serve.mirror) where its
        choice of decode worker can use them (pdlab.serve.placement.mirrors_caches)."""
        return mirrors_caches(d.disaggregated, sum(1 for w in d.workers if w.role == "decode"), d.route.selective,
                              bool(getattr(self.engine, "prefix_caching", False)))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        r = self.router
        while not all(w.ready for w in r.workers.values()):
            self._pump(min(0.1, max(0.0, deadline - time.monotonic())))
            failed = [e for e in r.events if isinstance(e, WorkerFailed)]
            if failed:
                raise ClusterError(f"worker {failed[0].worker} failed to start: {failed[0].reason}")
            if time.monotonic() > deadline:
                late = [w.name for w in r.workers.values() if not w.ready]
                raise ClusterError(f"workers not ready within {timeout:g}s: {', '.join(late)}")
        r.events = [e for e in r.events if not isinstance(e, StepEvent)]
        self._check_pairs()

    def _check_pairs(self) -> None:
        """Every prefill worker can hand KV to every decode worker (pdlab.kv.fingerprint), or nothing is sent."""

        ws = self.router.workers.values()
        try:
            for p in [w for w in ws if w.role == "prefill"]:
                for d in [w for w in ws if w.role == "decode"]:
                    check_pair(p.name, KvFingerprint.from_raw(p.fingerprint), d.name,
                               KvFingerprint.from_raw(d.fingerprint))
        except PairingError as e:
            raise ClusterError(str(e)) from None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop workers (Stop, then SIGTERM, then SIGKILL), close sockets, remove the run's files."""
        if self._stopped:
            return
        self._stopped = True
        procs = [w.proc for w in self.router.workers.values() if w.proc is not None and w.proc.pid is not None
                 and not isinstance(w.proc, RemoteProc)] if self.router else []
        if self.router is not None:
            for w in self.router.workers.values():
                if w.proc is not None and w.proc.exitcode is None:
                    self.router.send(w.name, m.Stop())
        if self._nodes is not None:
            self._nodes.end()  # each agent makes sure its workers are gone, then says Ended (awaited below)
        deadline = time.monotonic() + timeout / 2
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for sig in ("terminate", "kill"):
            alive = [p for p in procs if p.exitcode is None]
            for p in alive:
                getattr(p, sig)()
            for p in alive:
                p.join(timeout / 4)
        # Wait for every child, however long a SIGKILLed one takes to go (unmapping a large pool on a busy box
        # can take seconds): a child not waited for outlives us as a zombie, re-parented to init.
        deadline = time.monotonic() + REAP_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if self._nodes is not None:
            # an agent escalates as we do (Stop, SIGTERM, SIGKILL, reap): give it as long, plus a heartbeat
            deadline = time.monotonic() + timeout + REAP_TIMEOUT_S
            while not self._nodes.all_ended() and time.monotonic() < deadline:
                self._pump(0.05)
        if self._guard is not None:
            self._guard.close()
        with self._wake_lock:
            if self._wake_fds is not None:
                for fd in self._wake_fds:
                    os.close(fd)
                self._wake_fds = None
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        shm.sweep(self.run_prefix)
        shm.sweep_tmp(self.run_prefix)
        _live.discard(self)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- requests ----
    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        self._running().submit(req_id, prompt_ids, params)

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        """Give up a request (its client left, a stop string matched): every worker holding it lets go, and a
        RequestDone(ok=False, error=reason) follows. Nothing for a request that has already ended."""
        self._running().abort(req_id, reason)

    def wake(self) -> None:
        """Make a poll() that is waiting, in another thread, return now (with what it has, maybe nothing): that
        thread has something to submit. The one method that may be called from any thread."""
        with self._wake_lock:
            if self._wake_fds is not None:
                try:
                    os.write(self._wake_fds[1], b"w")
                except BlockingIOError:
                    pass  # the pipe is full: a wake-up is pending anyway

    def poll(self, timeout: float) -> list[Any]:
        """Events in arrival order; returns as soon as there are any, after `timeout` seconds, or when wake()
        was called."""
        r = self._running()
        deadline = time.monotonic() + timeout
        self._woken = False
        while True:
            self._pump(min(0.05, max(0.0, deadline - time.monotonic())))
            if r.events or self._woken or time.monotonic() >= deadline:
                events, r.events = r.events, []
                return events

    def _pump(self, wait_s: float) -> None:
        """Read every frame that is there (waiting up to `wait_s` for the first), then check health."""
        # deferred: zmq
        import zmq

        r = self.router
        ready = dict(self._poller.poll(int(wait_s * 1000)))
        if self._wake_fds is not None and self._wake_fds[0] in ready:
            self._woken = True
            try:
                while os.read(self._wake_fds[0], 4096):
                    pass
            except BlockingIOError:
                pass
        if self._sock in ready:
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2:
                    try:
                        if frames[0].startswith(NODE_IDENTITY.encode()):
                            if self._nodes is not None:
                                self._nodes.dispatch(frames[0], frames[1])
                        else:
                            r.dispatch(frames[1])
                    except m.MessageError:
                        pass  # not ours; never executed, just dropped
        r.check_health()
        if self._nodes is not None:
            for worker, why in self._nodes.check():
                r.fail_worker(worker, why)

    def _running(self) -> Router:
        if self.router is None or self._stopped:
            raise ClusterError("cluster is not running (call start(); stop() ends it)")
        return self.router

    def reset_prefix_cache(self) -> None:
        r = self._running()
        for w in r.workers.values():
            r.send(w.name, m.ResetPrefixCache())

    def kv_stats(self, timeout: float = 10.0) -> dict[str, m.Stats]:
        """Ask every live worker for its KV block counts (leak checks). Other events keep queueing."""
        r = self._running()
        self._token += 1
        live = [w.name for w in r.workers.values() if w.failed is None]
        for name in live:
            r.stats.pop(name, None)
            r.send(name, m.Query(self._token))
        deadline = time.monotonic() + timeout
        while not all(n in r.stats and r.stats[n].token == self._token for n in live):
            if time.monotonic() > deadline:
                raise ClusterError(f"no stats from {[n for n in live if n not in r.stats]} within {timeout:g}s")
            self._pump(0.05)
        return {n: r.stats[n] for n in live}


@atexit.register
def _stop_all() -> None:
    for c in list(_live):
        c.stop()
    stop_helpers()
