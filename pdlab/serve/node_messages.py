"""Control messages between the router and the agents of other nodes (`pdlab worker`, pdlab.serve.agent).

The same rules as pdlab.serve.messages (typed dataclasses, msgpack of plain data, never pickle), in the same
registry: an agent's frames are decoded by the one `decode`. An agent's identity on the router's socket is
`node:<name>` (constants.NODE_IDENTITY), which no worker name can be, so the launcher sends its frames here
and workers' frames to the router.

A *session* is one deployment's life on a node (one `Cluster`, or one `pdlab doctor --peer` probe): it starts
with `Start` (or `Probe`) and ends with `End` -> `Ended`, or when either side goes away.
"""

from __future__ import annotations

from dataclasses import field
from typing import Optional

from pdlab.serve import messages as m
from pdlab.serve.messages import message

# ---- agent -> router -------------------------------------------------------------------------------


@message
class Offer:
    """An idle agent, every heartbeat period: the devices it lets a run use (device specs of its machine)."""

    node: str
    devices: list
    host: str
    pid: int
    protocol: str = ""  # PROTOCOL of the agent's pdlab ("": one from before agents sent it)


@message
class NodeBeat:
    """An agent in a session, every heartbeat period: it is alive and its workers are its children."""

    node: str
    session: str


@message
class Started:
    """The agent started the session's processes: their pids by worker name."""

    node: str
    session: str
    pids: dict


@message
class StartFailed:
    """The agent could not start the session here (a device its machine lacks, a spec it cannot run)."""

    node: str
    session: str
    reason: str


@message
class WorkerExited:
    """One of the session's processes ended: its exit code (negative: the signal that killed it)."""

    node: str
    session: str
    worker: str
    pid: int
    code: int


@message
class Ended:
    """The session's processes are gone (stopped, terminated or killed, and reaped), and the shared-memory
    segments of the run on this node swept (`swept`: the names it had to remove)."""

    node: str
    session: str
    swept: list = field(default_factory=list)


# ---- router -> agent -------------------------------------------------------------------------------


@message
class Start:
    """Start these workers (pdlab.serve.worker.WorkerSpec.to_raw, without keys: the agent gives them its own)
    of this deployment (its recipe form: the agent places them on its machine, pdlab.serve.topology)."""

    session: str
    run_prefix: str
    deployment: dict
    specs: list


@message
class Probe:
    """`pdlab doctor --peer`: start a probe peer (pdlab.kv.peer_probe.PeerSpec.to_raw) for this session."""

    session: str
    run_prefix: str
    spec: dict


@message
class Kill:
    """Kill this worker now (the router declared it hung or dead)."""

    session: str
    worker: str


@message
class End:
    """The session is over: the router told its workers to stop; make sure they are gone, then `Ended`."""

    session: str


# ---- probe peer -> doctor ----------------------------------------------------------------------------


@message
class ProbeReady:
    """A probe peer's registered pool, as a worker's Ready carries it (pdlab.kv.nixl export), or why not."""

    worker: str
    pool: Optional[dict]
    error: str = ""


# the messages this pdlab speaks, router and workers and agents: a node whose agent offers another is refused
# at its Offer with a line that says so, instead of failing later on a frame the other side cannot decode
PROTOCOL = m.digest(c for c in m.MESSAGES.values() if c.__module__ in (m.__name__, __name__))
