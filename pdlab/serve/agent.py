"""The agent of a node (`pdlab worker --join tcp://HOST:PORT --devices cpu:2-3 --name b`): offers this machine's
devices to a run and runs the workers the run places here.

One small process with one DEALER socket to the router (a CurveZMQ client with the cluster's member keys,
pdlab.serve.curve). While idle it offers its devices every heartbeat period; a router whose deployment has
workers on this node answers with their specs (`Start`, plain data, pdlab.serve.node_messages). The agent
places them on this machine (pdlab.serve.topology: its cores, its GPUs), gives them its keys and the address
it joined, and starts them as the launcher starts local workers (multiprocessing spawn, `run_worker`); they
then talk to the router themselves. The workers are the agent's children, in its process group: it reports
each one's death (`WorkerExited`), beats while the session lasts (`NodeBeat`), and ends the session when

- the router says `End` (it already told the workers to stop: they get time to, then SIGTERM, then SIGKILL);
- the router goes away: the connection drops, or ZeroMQ's own heartbeat (answered by the router's I/O thread,
  busy or not) times out: SIGTERM at once, then SIGKILL;
- the agent itself gets SIGTERM or Ctrl-C (then it exits), or dies (its workers get SIGTERM from the kernel,
  PR_SET_PDEATHSIG, and unwind).

Ending a session reaps every worker and sweeps the run's shared-memory segments on this node. Then the agent
offers its devices again, or exits with `--once`. A peer that the router refuses (other keys, plain TCP
against keys) is told so by the handshake: the agent logs it once and keeps trying.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any, Callable, Optional

from pdlab.constants import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, NODE_IDENTITY, REAP_TIMEOUT_S, STOP_TIMEOUT_S
from pdlab.serve import messages as m
from pdlab.serve import node_messages as nm
from pdlab.serve.curve import ClusterKeys, connect_as_member
from pdlab.serve.node_start import start_probe, start_workers
from pdlab.serve.launch import prepare

_REFUSALS = {  # the handshake events a refused client sees
    "HANDSHAKE_FAILED_AUTH": "the router does not admit our key (--keys is not this cluster's)",
    "HANDSHAKE_FAILED_PROTOCOL": "the handshake failed: our keys are not the router's, or one side is plain TCP "
                                 "(--keys / --insecure must match the recipe's control)",
    "HANDSHAKE_FAILED_NO_DETAIL": "the handshake failed",
}


class Agent:
    def __init__(self, join: str, devices: list[str], name: str, keys: Optional[ClusterKeys], once: bool = False,
                 say: Callable[[str], None] = print):
        self.join, self.devices, self.name, self.once, self.say = join, list(devices), name, once, say
        self.member = keys.member() if keys else None
        self.session: Optional[str] = None
        self.run_prefix = ""
        self.procs: dict[str, Any] = {}  # worker name -> multiprocessing.Process
        self.reported: set[str] = set()
        self.connected = False
        self.refused: set[str] = set()

    # ---- the loop ----
    def run(self) -> int:
        # deferred: zmq
        import zmq

        old = signal.signal(signal.SIGTERM, _raise_exit)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{NODE_IDENTITY}{self.name}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a router that is not there: offers are fresh
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        connect_as_member(self.sock, self.member)
        events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
                  zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.monitor = self.sock.get_monitor_socket(events)
        prepare()  # before joining: a run's Start must not wait for the imports its workers need
        self.sock.connect(self.join)
        self.say(f"node {self.name}: joining {self.join}, offering {', '.join(self.devices)} "
                 f"({'CurveZMQ keys' if self.member else 'plain TCP: insecure'})")
        try:
            return self._loop()
        except KeyboardInterrupt:
            return 130
        except SystemExit:  # SIGTERM: stopped as asked, its workers with it
            return 0
        finally:
            self._end("the agent is stopping", graceful=False)
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)
            self.ctx.term()
            signal.signal(signal.SIGTERM, old)

    def _loop(self) -> int:
        # deferred: zmq
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        beat = 0.0
        while True:
            ready = dict(poller.poll(50))
            if self.monitor in ready and self._watch():
                return 0
            if self.sock in ready:
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = m.decode(frame)
                    except m.MessageError:
                        continue  # not ours: dropped, never executed
                    if self._handle(msg):
                        return 0
            self._reap()
            now = time.monotonic()
            if now - beat >= HEARTBEAT_S:
                beat = now
                self._send(nm.NodeBeat(self.name, self.session) if self.session else
                           nm.Offer(self.name, self.devices, socket.gethostname(), os.getpid(), nm.PROTOCOL))

    def _watch(self) -> bool:
        """A connection event; True when the agent is done (the router went away mid-session, --once)."""
        # deferred: zmq
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        ev = recv_monitor_message(self.monitor)["event"]
        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self.say(f"node {self.name}: connected to {self.join}; waiting for a run")
        elif ev == zmq.EVENT_DISCONNECTED:
            self.connected = False
            if self.session:
                return self._end("the router went away", graceful=False) and self.once
        else:
            why = _REFUSALS.get(zmq.Event(ev).name, "the handshake failed")
            if why not in self.refused:  # it retries every second or so: say it once
                self.refused.add(why)
                self.say(f"node {self.name}: refused by {self.join}: {why}")
        return False

    def _handle(self, msg: Any) -> bool:
        if isinstance(msg, (nm.Start, nm.Probe)) and self.session is None:
            self._start(msg)
        elif getattr(msg, "session", None) != self.session or self.session is None:
            return False  # about a session that is over
        elif isinstance(msg, nm.Kill) and msg.worker in self.procs:
            self.procs[msg.worker].kill()
        elif isinstance(msg, nm.End):
            return self._end("the run ended it", graceful=True) and self.once
        return False

    # ---- a session ----
    def _start(self, msg: Any) -> None:
        self.session, self.run_prefix, self.reported = msg.session, msg.run_prefix, set()
        try:
            if isinstance(msg, nm.Probe):
                self.procs = start_probe(msg.spec, self.join, self.member, msg.run_prefix)
            else:
                self.procs = start_workers(msg.deployment, msg.specs, self.name, self.devices, self.join,
                                           self.member)
        except Exception as e:  # noqa: BLE001 - a spec this machine cannot run: the router says why
            self.say(f"node {self.name}: cannot start run {msg.session}: {e}")
            self._send(nm.StartFailed(self.name, msg.session, f"{type(e).__name__}: {e}"
                                      if not isinstance(e, ValueError) else str(e)))
            self._end("it could not start", graceful=False, report=False)
            return
        self._send(nm.Started(self.name, self.session, {n: p.pid for n, p in self.procs.items()}))
        self.say(f"node {self.name}: run {self.session}: started " +
                 ", ".join(f"{n} (pid {p.pid})" for n, p in self.procs.items()))

    def _reap(self) -> None:
        for name, p in self.procs.items():
            if p.exitcode is not None and name not in self.reported:
                self.reported.add(name)
                self._send(nm.WorkerExited(self.name, self.session, name, p.pid, p.exitcode))

    def _end(self, why: str, graceful: bool, report: bool = True) -> bool:
        """Make sure the session's processes are gone (reaped) and its shared memory swept; True if one ran."""
        # deferred: torch
        from pdlab.kv import shm

        if self.session is None:
            return False
        procs = list(self.procs.values())
        if graceful:  # the router told them to stop: let them
            deadline = time.monotonic() + STOP_TIMEOUT_S / 2
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for sig in ("terminate", "kill"):
            alive = [p for p in procs if p.exitcode is None]
            for p in alive:
                getattr(p, sig)()
            for p in alive:
                p.join(STOP_TIMEOUT_S / 4)
        deadline = time.monotonic() + REAP_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        swept = []
        if self.run_prefix:
            swept = shm.sweep(self.run_prefix)
            shm.sweep_tmp(self.run_prefix)  # the workers' folders in the temporary directory (UCX logs, TP stores)
        codes = ", ".join(f"{n} exited {p.exitcode}" for n, p in self.procs.items())
        if report:
            self._reap()
            self._send(nm.Ended(self.name, self.session, swept))
        self.say(f"node {self.name}: run {self.session} over ({why}): {codes or 'nothing ran'}" +
                 (f"; swept {len(swept)} shared-memory segments" if swept else ""))
        self.session, self.procs = None, {}
        return True

    def _send(self, msg: Any) -> None:
        # deferred: zmq
        import zmq

        try:
            self.sock.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no router connected: nothing to tell


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
