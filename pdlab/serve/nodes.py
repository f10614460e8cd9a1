"""The router's side of the other nodes: waits for their agents, hands them their workers, follows them.

An agent (`pdlab worker`, pdlab.serve.agent) connects to the router's socket and offers its devices. For a
node the deployment places workers on, the first offer gets `Start` with those workers' specs; the agent
starts them, and they connect to the router themselves, as local workers do. The router never sees their
processes, so each is a `RemoteProc`: its pid and exit code are what the agent reports (`WorkerExited`), and
killing it asks the agent to. An agent that stops beating (`NodeBeat`, like a worker's heartbeat), or that
offers again (it lost the session), fails its node's workers, and the router's failure handling applies.

At the end `end()` asks every started agent to make sure its workers are gone and its shared memory swept,
and the launcher waits for each `Ended` (an agent that is gone has nothing left to end: its workers die with
it, PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from pdlab.constants import HEARTBEAT_TIMEOUT_S, NODE_IDENTITY
from pdlab.devices import format_devices, on_node, parse_devices
from pdlab.serve import messages as m
from pdlab.serve import node_messages as nm


def other_protocol(offer: nm.Offer) -> str:
    """Why a node whose agent speaks other messages than this pdlab cannot join (nm.PROTOCOL)."""
    theirs = f"its messages {offer.protocol}" if offer.protocol else "its messages from before agents said which"
    return (f"node {offer.node} (pid {offer.pid} on {offer.host}) runs another pdlab ({theirs}; here {nm.PROTOCOL}): "
            "start its agent (pdlab worker) from the same pdlab as the run")


class RemoteProc:
    """A worker process on another node, as far as its agent says (the attributes the router reads of a
    multiprocessing.Process: pid, exitcode, kill)."""

    def __init__(self, link: "NodeLink", node: str, worker: str):
        self.link, self.node, self.worker = link, node, worker
        self.pid: Optional[int] = None
        self.exitcode: Optional[int] = None

    def kill(self) -> None:
        self.link.send(self.node, nm.Kill(self.link.session, self.worker))


class NodeLink:
    def __init__(self, send_frame: Callable[[bytes, bytes], None], session: str, run_prefix: str,
                 deployment: dict, specs: dict[str, list[dict]], heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
        """`specs`: node -> the raw WorkerSpecs it runs; `deployment`: the deployment's recipe form."""
        self._send_frame, self.session, self.run_prefix = send_frame, session, run_prefix
        self.deployment, self.specs = deployment, specs
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.procs = {n: {s["name"]: RemoteProc(self, n, s["name"]) for s in ss} for n, ss in specs.items()}
        self.offers: dict[str, nm.Offer] = {}  # nodes that joined: their offer
        self.started: set[str] = set()  # nodes whose Started arrived
        self.ended: set[str] = set()
        self.gone: dict[str, str] = {}  # node -> why it is out of the session
        self.last: dict[str, float] = {}
        self.error: Optional[str] = None  # a node that cannot run its workers: the cluster cannot start
        self._lost: list[tuple[str, str]] = []  # (worker, why) not yet reported by check()

    # ---- frames ----
    def send(self, node: str, msg: Any) -> None:
        if node in self.gone and not isinstance(msg, nm.End):
            return
        try:
            self._send_frame(f"{NODE_IDENTITY}{node}".encode(), m.encode(msg))
        except Exception:  # noqa: BLE001 - unreachable agent: its beats stop, check() reports it
            pass

    def dispatch(self, identity: bytes, frame: bytes, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        msg = m.decode(frame)
        node = getattr(msg, "node", None)
        if node is None or identity != f"{NODE_IDENTITY}{node}".encode() or node not in self.specs:
            return  # not a node of this deployment (an idle agent waiting for another run, or a stray)
        if isinstance(msg, nm.Offer):
            return self._offered(msg, now)
        if getattr(msg, "session", None) != self.session:
            return  # words about an earlier session
        self.last[node] = now
        if isinstance(msg, nm.Started):
            self.started.add(node)
            for name, pid in msg.pids.items():
                if name in self.procs[node]:
                    self.procs[node][name].pid = int(pid)
        elif isinstance(msg, nm.StartFailed):
            self.error = f"node {node} could not start its workers: {msg.reason}"
        elif isinstance(msg, nm.WorkerExited):
            p = self.procs[node].get(msg.worker)
            if p is not None and p.exitcode is None:
                p.pid, p.exitcode = msg.pid, msg.code
        elif isinstance(msg, nm.Ended):
            self.ended.add(node)

    def _offered(self, offer: nm.Offer, now: float) -> None:
        node = offer.node
        if node in self.started and node not in self.gone:
            self._lose(node, f"its agent (pid {offer.pid} on {offer.host}) left the session: it offers its "
                             "devices again")
            return
        if node in self.offers:
            return  # offers sent before our Start reached it
        if offer.protocol != nm.PROTOCOL:
            self.error = other_protocol(offer)
            return
        try:
            have = set(parse_devices(list(offer.devices)))
        except ValueError as e:
            self.error = f"node {node} offers devices that are not device specs: {e}"
            return
        for s in self.specs[node]:
            missing = [d for d in parse_devices(list(s["devices"])) if d not in have]
            if missing:
                self.error = (f"node {node} offers {', '.join(offer.devices)}, but {s['name']} is placed on "
                              f"{on_node(node, format_devices(missing))} (pdlab worker --devices there)")
                return
        self.offers[node], self.last[node] = offer, now
        self.send(node, nm.Start(self.session, self.run_prefix, self.deployment, self.specs[node]))

    # ---- state ----
    def waiting(self) -> list[str]:
        """Nodes that have not joined yet."""
        return [n for n in self.specs if n not in self.offers]

    def check(self, now: Optional[float] = None) -> list[tuple[str, str]]:
        """(worker, why) for the workers of agents lost since the last call: gone quiet, or idle again."""
        now = time.monotonic() if now is None else now
        for node in list(self.offers):
            if node not in self.gone and node not in self.ended and now - self.last[node] > self.heartbeat_timeout_s:
                o = self.offers[node]
                self._lose(node, f"its agent (pid {o.pid} on {o.host}) is gone: no word from it for "
                                 f"{now - self.last[node]:.1f}s")
        lost, self._lost = self._lost, []
        return lost

    def _lose(self, node: str, why: str) -> None:
        self.gone[node] = why
        self._lost += [(w, f"worker {w} on node {node}: {why}") for w in self.procs[node]]

    # ---- the end ----
    def end(self) -> None:
        """Ask every agent that was sent its workers to finish the session."""
        for node in self.offers:
            if node not in self.ended:
                self.send(node, nm.End(self.session))

    def all_ended(self) -> bool:
        return all(n in self.ended or n in self.gone for n in self.offers)

    def describe(self, node: str) -> str:
        """What node `node` must offer, for the line that says it did not join."""
        devs = [d for s in self.specs[node] for d in s["devices"]]
        return format_devices(parse_devices(devs))
