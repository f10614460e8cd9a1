"""A cluster's CurveZMQ keys (`pdlab keys init`), and the router's door (pdlab.serve.guard): members get in,
everyone else is refused, counted and logged, and a run can say why a node never got in."""

import logging
import os
import stat
import time

import pytest
import zmq

from pdlab.serve.curve import ClusterKeys, KeysError, connect_as_member, init_keys, serve
from pdlab.serve.guard import Guard


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_init_writes_files_only_the_owner_can_read(tmp_path):
    d = tmp_path / "keys"
    files = init_keys(str(d))
    assert sorted(os.path.basename(f) for f in files) == ["client.key", "client.key_secret", "server.key",
                                                         "server.key_secret"]
    assert mode(d) == 0o700 and all(mode(f) == 0o600 for f in files)
    router, member = ClusterKeys.load(str(d), server=True), ClusterKeys.load(str(d), server=False)
    assert router.server_public == member.server_public and router.client_public == member.client_public
    assert router.server_secret and member.client_secret and member.server_secret is None
    assert "secret-key" not in (d / "server.key").read_text()  # the public halves hold no secret


def test_the_keys_init_command_writes_them_and_says_how_to_use_them(tmp_path):
    from cli_helpers import pdlab

    d = tmp_path / "keys"
    r = pdlab("keys", "init", str(d))
    assert r.returncode == 0, r.stderr
    assert "wrote 4 key files" in r.stdout and f"--keys {d}" in r.stdout
    assert ClusterKeys.load(str(d), server=True).server_secret
    again = pdlab("keys", "init", str(d))  # never overwritten: one line, exit 2
    assert again.returncode == 2 and "never overwritten" in again.stderr and again.stderr.count("\n") == 1


def test_keys_are_never_overwritten_and_loose_ones_are_refused(tmp_path):
    d = tmp_path / "keys"
    init_keys(str(d))
    with pytest.raises(KeysError, match="never overwritten"):
        init_keys(str(d))
    os.chmod(d / "client.key_secret", 0o644)
    with pytest.raises(KeysError, match=r"client.key_secret: readable by others \(mode 0644\)"):
        ClusterKeys.load(str(d), server=False)
    with pytest.raises(KeysError, match="No such file"):
        ClusterKeys.load(str(tmp_path / "none"), server=True)
    (tmp_path / "bad").mkdir(mode=0o700)
    with pytest.raises(KeysError, match="server.key_secret"):
        ClusterKeys.load(str(tmp_path / "bad"), server=True)


@pytest.fixture
def door(tmp_path):
    """A CURVE router with the guard, as the launcher builds it, on a loopback port."""
    keys = ClusterKeys.load(init_keys(str(tmp_path / "keys"))[0].rsplit("/", 1)[0], server=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    serve(sock, keys)
    own, own_public = keys.run_member()
    guard = Guard(ctx, sock, {keys.client_public, own_public}, "tcp://127.0.0.1:*")
    sock.bind("tcp://127.0.0.1:*")
    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    clients = []

    def client(member):
        c = ctx.socket(zmq.DEALER)
        c.setsockopt(zmq.LINGER, 0)
        connect_as_member(c, member)
        c.connect(address)
        c.send(b"hello")
        clients.append(c)

    yield ClusterKeys.load(str(tmp_path / "keys"), server=False), own, sock, guard, client
    for c in clients:
        c.close(0)
    guard.close()
    sock.close(0)
    ctx.term()


def received(sock, seconds=1.5):
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(50):
            out.append(sock.recv_multipart()[1])
    return out


def test_members_get_in(door):
    member, own, sock, guard, client = door
    client(member.member())
    client(own)  # the router's own workers: a pair made for the run
    assert received(sock) == [b"hello", b"hello"]
    assert guard.summary() == ""


def test_everyone_else_is_refused_counted_and_logged(door, tmp_path, caplog):
    member, own, sock, guard, client = door
    other = ClusterKeys.load(os.path.dirname(init_keys(str(tmp_path / "other"))[0]), server=False)
    impostor = dict(member.member(), **dict(zip(("public", "secret"), (k.decode() for k in zmq.curve_keypair()))))
    with caplog.at_level(logging.WARNING, logger="pdlab.control"):
        client(other.member())  # another cluster's keys
        client(None)  # plain TCP
        client(impostor)  # knows the router's public key, but its own key is not the cluster's
        assert received(sock, 3.0) == []
    text = guard.summary()
    assert text.startswith("refused ") and "connection attempts" in text
    for why in ("its keys are not this cluster's", "plain TCP", "its key is not this cluster's member key"):
        assert why in text
        assert sum(why in r.getMessage() for r in caplog.records) == 1  # logged once however often it retries
    assert any("from 127.0.0.1" in r.getMessage() for r in caplog.records)  # ZAP knows the peer's address


def control_plane(tmp_path, control):
    """The launcher's socket set-up for `control`, without starting workers (pdlab.serve.cluster)."""
    from pdlab.engine.config import EngineConfig
    from pdlab.recipe import Deployment, ModelSpec
    from pdlab.serve.cluster import Cluster

    c = Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"), EngineConfig(),
                Deployment.from_raw({"unified": {"devices": ["cpu:0"]}, "control": control}, "deployment"))
    c._ctx = zmq.Context()
    c._sock = c._ctx.socket(zmq.ROUTER)
    return c


def close(c):
    if c._guard is not None:
        c._guard.close()
    c._sock.close(0)
    c._ctx.term()


def test_plain_tcp_only_when_the_recipe_says_insecure_and_then_a_warning(tmp_path, caplog):
    c = control_plane(tmp_path, {"address": "tcp://127.0.0.1:5999", "insecure": True})
    with caplog.at_level(logging.WARNING, logger="pdlab.control"):
        assert c._secure("tcp://127.0.0.1:5999") is None
    assert not c._sock.curve_server and c._guard is None
    assert "insecure: true: plain TCP on tcp://127.0.0.1:5999" in caplog.text
    close(c)
    c = control_plane(tmp_path, "tcp://127.0.0.1:5999")  # no keys, no nodes: keys made for the run
    member = c._secure("tcp://127.0.0.1:5999")
    assert c._sock.curve_server and c._guard is not None and set(member) == {"server", "public", "secret"}
    assert member["public"].encode() in c._guard.members and len(c._guard.members) == 2  # its workers' pair too
    close(c)
    init_keys(str(tmp_path / "keys"))
    c = control_plane(tmp_path, {"address": "tcp://127.0.0.1:5999", "keys": str(tmp_path / "keys")})
    member = c._secure("tcp://127.0.0.1:5999")
    cluster = ClusterKeys.load(str(tmp_path / "keys"), server=True)
    assert member["server"] == cluster.server_public.decode() and member["public"] != cluster.client_public.decode()
    assert c._guard.members == {cluster.client_public, member["public"].encode()}  # the cluster's, and the run's own
    close(c)
