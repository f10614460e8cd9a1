"""The agent of a node (`pdlab worker`) and the router's side of it (pdlab.serve.nodes), piece by piece: what
the router sends a node that offers enough devices and what it refuses, what it learns of processes it cannot
see, when it gives a node up; an agent's session ends with its processes reaped and the run's shared memory
swept; an agent whose router goes away stops its processes and waits for the next run."""

import multiprocessing as mp
import os
import secrets
import time

import pytest
import zmq

from pdlab.constants import NODE_IDENTITY
from pdlab.kv import shm
from pdlab.serve import messages as m
from pdlab.serve import node_messages as nm
from pdlab.serve.agent import Agent
from pdlab.serve.nodes import NodeLink

SPECS = {"b": [{"name": "decode0", "devices": ["cpu:1"]}, {"name": "decode1", "devices": ["cpu:2"]}]}


def link():
    sent = []
    return NodeLink(lambda ident, frame: sent.append((ident, m.decode(frame))), "s1", "pdlab-0a1b2c3d-",
                    {"a": "deployment"}, SPECS, heartbeat_timeout_s=5.0), sent


def frame(msg):
    return m.encode(msg)


def test_a_node_that_offers_too_little_is_an_error_naming_the_device():
    nodes, sent = link()
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:0-1"], "hostb", 42, nm.PROTOCOL)), now=0.0)
    assert nodes.error == "node b offers cpu:0-1, but decode1 is placed on b:cpu:2 (pdlab worker --devices there)"
    assert sent == [] and nodes.waiting() == ["b"]


def test_a_node_whose_agent_speaks_other_messages_is_an_error_naming_it():
    """An agent started from another pdlab (its messages differ: a field added, say) is refused at its Offer
    with a line that says so, and is sent nothing; one from before agents sent their protocol as well."""
    for theirs, said in (("0123456789ab", "its messages 0123456789ab"),
                         ("", "its messages from before agents said which")):
        nodes, sent = link()
        nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:0-3"], "hostb", 42, theirs)), now=0.0)
        assert nodes.error == (f"node b (pid 42 on hostb) runs another pdlab ({said}; here {nm.PROTOCOL}): start its "
                               "agent (pdlab worker) from the same pdlab as the run")
        assert sent == [] and nodes.waiting() == ["b"]


def test_the_protocol_follows_the_messages_fields():
    """Two processes speak the same messages when their digests agree: a field added, renamed or moved changes
    it; the order the classes are given in does not."""
    from dataclasses import make_dataclass

    a, b = make_dataclass("A", ["x", "y"]), make_dataclass("B", ["z"])
    base = m.digest([a, b])
    assert base == m.digest([b, a]) and len(base) == 12
    for other in ([make_dataclass("A", ["x", "y", "w"]), b], [make_dataclass("A", ["y", "x"]), b],
                  [make_dataclass("A", ["x", "v"]), b], [a, make_dataclass("C", ["z"])]):
        assert m.digest(other) != base


def test_a_node_that_offers_enough_gets_its_workers_and_is_followed():
    nodes, sent = link()
    nodes.dispatch(b"node:c", frame(nm.Offer("b", ["cpu:0-3"], "x", 1, nm.PROTOCOL)), now=0.0)  # claims another's name
    nodes.dispatch(b"node:c", frame(nm.Offer("c", ["cpu:0-3"], "x", 1, nm.PROTOCOL)), now=0.0)  # not a node of this run
    assert sent == [] and nodes.waiting() == ["b"]
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:0-3"], "hostb", 42, nm.PROTOCOL)), now=0.0)
    # sent before Start landed
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:0-3"], "hostb", 42, nm.PROTOCOL)), now=0.1)
    assert sent == [(f"{NODE_IDENTITY}b".encode(), nm.Start("s1", "pdlab-0a1b2c3d-", {"a": "deployment"},
                                                             SPECS["b"]))]
    assert nodes.waiting() == [] and nodes.error is None
    nodes.dispatch(b"node:b", frame(nm.Started("b", "s1", {"decode0": 100, "decode1": 101})), now=1.0)
    nodes.dispatch(b"node:b", frame(nm.WorkerExited("b", "old-session", "decode0", 100, -9)), now=1.0)
    d0, d1 = nodes.procs["b"]["decode0"], nodes.procs["b"]["decode1"]
    assert (d0.pid, d0.exitcode, d1.pid) == (100, None, 101)
    nodes.dispatch(b"node:b", frame(nm.WorkerExited("b", "s1", "decode1", 101, -9)), now=2.0)
    assert d1.exitcode == -9  # the router's health check reads it as it reads a local process's
    d0.kill()
    assert sent[-1][1] == nm.Kill("s1", "decode0")
    assert nodes.check(now=2.0 + 4.9) == []
    nodes.end()
    assert sent[-1][1] == nm.End("s1") and not nodes.all_ended()
    nodes.dispatch(b"node:b", frame(nm.Ended("b", "s1", [])), now=7.0)
    assert nodes.all_ended()


def test_a_node_that_goes_quiet_or_offers_again_fails_its_workers_once():
    nodes, sent = link()
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:1-2"], "hostb", 42, nm.PROTOCOL)), now=0.0)
    nodes.dispatch(b"node:b", frame(nm.Started("b", "s1", {"decode0": 100, "decode1": 101})), now=0.5)
    nodes.dispatch(b"node:b", frame(nm.NodeBeat("b", "s1")), now=3.0)
    assert nodes.check(now=7.9) == []
    lost = nodes.check(now=8.5)
    assert [w for w, _ in lost] == ["decode0", "decode1"]
    assert lost[0][1] == "worker decode0 on node b: its agent (pid 42 on hostb) is gone: no word from it for 5.5s"
    assert nodes.check(now=20.0) == [] and nodes.all_ended()  # reported once; nothing left to end there

    nodes, sent = link()
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:1-2"], "hostb", 42, nm.PROTOCOL)), now=0.0)
    nodes.dispatch(b"node:b", frame(nm.Started("b", "s1", {"decode0": 100, "decode1": 101})), now=0.5)
    nodes.dispatch(b"node:b", frame(nm.Offer("b", ["cpu:1-2"], "hostb", 43, nm.PROTOCOL)), now=1.0)  # a new agent, idle
    assert "left the session: it offers its devices again" in nodes.check(now=1.0)[0][1]


class _Sent:
    def __init__(self):
        self.msgs = []

    def send(self, frame, flags=0):
        self.msgs.append(m.decode(frame))


@pytest.mark.slow
def test_ending_a_session_reaps_its_processes_and_sweeps_the_runs_shared_memory():
    agent = Agent("tcp://127.0.0.1:1", ["cpu:0"], "b", None, say=lambda s: None)
    agent.sock = _Sent()
    agent.session, agent.run_prefix = "s1", f"{shm.PREFIX}{secrets.token_hex(4)}-"
    leaked = agent.run_prefix + "pool"  # what a worker killed by SIGKILL leaves behind
    os.close(os.open(os.path.join(shm.SHM_DIR, leaked), os.O_CREAT | os.O_WRONLY, 0o600))
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(300,), daemon=True)
    proc.start()
    agent.procs = {"decode0": proc}
    assert agent._end("a test", graceful=False) is True
    assert proc.exitcode == -15 and not os.path.exists(os.path.join(shm.SHM_DIR, leaked))
    assert agent.sock.msgs == [nm.WorkerExited("b", "s1", "decode0", proc.pid, -15), nm.Ended("b", "s1", [leaked])]
    assert agent.session is None and agent.procs == {} and agent._end("again", graceful=False) is False


@pytest.mark.slow
@pytest.mark.skipif(__import__("pdlab.recipe.nixl", fromlist=["x"]).nixl_module() is None,
                    reason="NIXL not installed")
def test_an_agent_whose_router_goes_away_stops_its_processes_and_waits_for_the_next(tmp_path):
    """A fake router in this process: it starts a probe peer on the agent (a real process, a NIXL agent), then
    closes its socket as a router that dies does. The agent, a separate process, kills the peer and offers its
    devices again to the next router on the same port."""
    import subprocess
    import sys
    import tempfile

    from tests.test_run import ROOT

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    tmp = tempfile.gettempdir()  # the agent's too: its peer's UCX log folder goes there (a deep TMPDIR would
    # push the agent's own socket paths past the 107-byte limit)
    agent = subprocess.Popen([sys.executable, "-m", "pdlab.cli", "worker", "--join", address, "--devices", "cpu:0",
                              "--name", "b", "--insecure"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,  # UCX_LOG_FILE: set here by an earlier NIXL test
                             env={**{k: v for k, v in os.environ.items() if k != "UCX_LOG_FILE"}, "PYTHONPATH": ROOT})
    ctx = zmq.Context()

    def router():
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.bind(address)
        return r

    def next_msg(r, kind, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if r.poll(100):
                ident, f = r.recv_multipart()
                msg = m.decode(f)
                if isinstance(msg, kind):
                    return ident, msg
        raise AssertionError(f"no {kind.__name__} within {timeout}s")

    try:
        r = router()
        ident, offer = next_msg(r, nm.Offer)
        assert ident == b"node:b" and offer.devices == ["cpu:0"] and offer.pid == agent.pid
        from pdlab.serve.peer_probe import peer_spec

        spec = peer_spec(address, "tcp,self", 1 << 16)
        prefix = f"{shm.PREFIX}{secrets.token_hex(4)}-"
        r.send_multipart([ident, m.encode(nm.Probe("s1", prefix, spec.to_raw()))])
        _, started = next_msg(r, nm.Started)
        pid = started.pids["doctor-peer"]
        next_msg(r, nm.ProbeReady)
        assert [n for n in os.listdir(tmp) if n.startswith(f"{prefix}peer-")]  # its UCX log folder, named for the run
        r.close(0)  # the router dies
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped by the agent
        r = router()
        ident, offer = next_msg(r, nm.Offer)  # the next run gets it
        # the agent offers again only once the session has ended, after its sweep
        assert not [n for n in os.listdir(tmp) if n.startswith(prefix)], "the probe peer's folder was left"
        assert agent.poll() is None
        r.close(0)
    finally:
        agent.terminate()
        out = agent.communicate(timeout=60)[0]
        ctx.destroy(linger=0)  # closes a socket a failed assertion left open: term() would wait on it
    assert agent.returncode == 0, out
    assert "over (the router went away)" in out and "doctor-peer exited" in out
