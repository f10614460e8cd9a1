"""The doctor's side of `pdlab doctor --peer tcp://HOST:PORT`: listen where a run's router would, wait for a
node's agent to join, have it start a probe peer, and measure NIXL to it (pdlab.serve.peer_probe).

The address is the one a recipe gives as `control.address` and agents `--join`: the doctor stands in for the
router, with the same keys and the same guard (pdlab.serve.curve, pdlab.serve.guard), so a peer that a run
would refuse is refused here too. What UCX selected towards the peer is read from its log, as for a run's
transfers, and a data path over TCP where something faster exists is flagged (pdlab.kv.nixl_probe).
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any, Callable, Optional

import torch

from pdlab.constants import HEARTBEAT_TIMEOUT_S, NODE_IDENTITY, PEER_PROBE_SIZES, STOP_TIMEOUT_S
from pdlab.kv import shm
from pdlab.kv.nixl import NixlTransport
from pdlab.kv.nixl_probe import path_warning
from pdlab.serve import messages as m
from pdlab.serve import node_messages as nm
from pdlab.serve.curve import ClusterKeys, serve as curve_serve
from pdlab.serve.guard import Guard
from pdlab.serve.nodes import other_protocol
from pdlab.serve.peer_probe import PEER_NAME, measure, peer_spec


class PeerError(RuntimeError):
    """The probe could not run: nobody joined, the peer could not start, NIXL failed; one line."""


def probe_peer(address: str, keys: Optional[ClusterKeys], wait_s: float, ucx_tls: str = "auto",
               sizes: tuple[int, ...] = PEER_PROBE_SIZES, say: Callable[[str], None] = print) -> dict:
    """Listen at `address` (keys None: plain TCP), wait up to `wait_s` for a node, measure; the report."""
    # deferred: zmq
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    guard = None
    if keys is not None:
        curve_serve(sock, keys)
        guard = Guard(ctx, sock, {keys.client_public}, address)
    session, node, transport = secrets.token_hex(8), None, None
    inbox: list[tuple[bytes, Any]] = []

    def wait(what: Callable[[bytes, Any], bool], until: float) -> Optional[tuple[bytes, Any]]:
        while time.monotonic() < until:
            for i, (ident, msg) in enumerate(inbox):
                if what(ident, msg):
                    return inbox.pop(i)
            if sock.poll(100):
                ident, frame = sock.recv_multipart()[:2]
                try:
                    inbox.append((ident, m.decode(frame)))
                except m.MessageError:
                    pass
        return None

    def send(ident: bytes, msg: Any) -> None:
        try:
            sock.send_multipart([ident, m.encode(msg)])
        except zmq.ZMQError:
            pass

    try:
        sock.bind(address)
        say(f"waiting up to {wait_s:g}s for a node to join {address} (pdlab worker --join {address} ...)")
        got = wait(lambda i, msg: isinstance(msg, nm.Offer) and i == f"{NODE_IDENTITY}{msg.node}".encode(),
                   time.monotonic() + wait_s)
        if got is None:
            refused = guard.summary() if guard else ""
            raise PeerError(f"no node joined {address} within {wait_s:g}s" + (f"; {refused}" if refused else ""))
        node, offer = got
        if offer.protocol != nm.PROTOCOL:
            raise PeerError(other_protocol(offer))
        say(f"node {offer.node} (pid {offer.pid} on {offer.host}) joined; starting its probe peer")
        spec = peer_spec(address, ucx_tls, max(sizes))
        send(node, nm.Probe(session, f"{shm.PREFIX}{secrets.token_hex(4)}-", spec.to_raw()))
        got = wait(lambda i, msg: (i == PEER_NAME.encode() and isinstance(msg, nm.ProbeReady)) or
                   (i == node and isinstance(msg, (nm.StartFailed, nm.WorkerExited))), time.monotonic() + 120)
        if got is None or not isinstance(got[1], nm.ProbeReady) or got[1].pool is None:
            why = ("no answer within 120s" if got is None else getattr(got[1], "reason", "") or
                   getattr(got[1], "error", "") or f"it exited with code {got[1].code}")
            raise PeerError(f"node {offer.node} could not start a NIXL probe peer: {why}")
        handle = got[1].pool

        torch.set_num_threads(1)  # a worker copies with one thread
        transport = NixlTransport("doctor", f"pdlab-doctor-{secrets.token_hex(3)}", ucx_tls=ucx_tls)
        shape = tuple(handle["shape"])
        transport.kv_alloc(shape[:2] + (2 * shape[2],) + shape[3:], torch.float32)
        peer = transport.open(handle)
        results = measure(transport, peer, sizes)
        same_host = handle.get("host") == socket.gethostname()
        return {"peer": address, "node": offer.node, "host": offer.host, "same_host": same_host,
                "ucx_tls": transport.ucx_tls, "path": peer.path, "warning": path_warning(peer.path, same_host),
                "latency_ms": results[0]["read_ms_p50"], "latency_bytes": results[0]["bytes"], "sizes": results}
    except zmq.ZMQError as e:
        raise PeerError(f"--peer {address}: cannot listen there ({e})") from None
    finally:
        if transport is not None:
            transport.close()
        if node is not None:
            send(PEER_NAME.encode(), m.Stop())
            send(node, nm.End(session))
            # the peer stops at once; an agent that is gone has nothing to end (its children die with it)
            wait(lambda i, msg: i == node and isinstance(msg, nm.Ended), time.monotonic() + STOP_TIMEOUT_S +
                 HEARTBEAT_TIMEOUT_S)
        if guard is not None:
            guard.close()
        sock.close(0)
        ctx.term()
