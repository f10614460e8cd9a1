"""`pdlab doctor --peer`: NIXL between this machine and a joined node, measured as hand-overs move KV.

The joined node's agent starts a *probe peer* (`run_peer`, a process like a worker): a NIXL agent with a
private pool of KV blocks (cpu-demo's layout, float32, filled with a known pattern), exported over the
control plane as a worker's Ready carries its pool. The doctor (pdlab.serve.peer_doctor) opens it and times
`measure`: at each size a pull (READ of the peer's blocks, what a decode worker does) and a push (WRITE into
the peer's blocks, what a prefill worker does), best and median of a few, every READ checked against the
pattern and every WRITE read back. Latency is the median time of the smallest transfer.
"""

from __future__ import annotations

import os
import secrets
import signal
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional

from pdlab.kv.ucx_log import remove_log_dir
from pdlab.serve import messages as m
from pdlab.serve import node_messages as nm
from pdlab.serve.curve import connect_as_member
from pdlab.serve.process import die_with_parent, exit_on_signal

PEER_NAME = "doctor-peer"  # its identity on the doctor's socket (not node:...)
PEER_WAIT_S = 600.0  # a probe peer left alone this long (no Stop) ends itself


@dataclass(frozen=True)
class PeerSpec:
    endpoint: str
    shape: tuple  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    ucx_tls: str
    name: str = PEER_NAME
    curve: Optional[dict] = None  # filled in by the agent, in memory
    prefix: str = "pdlab-"  # the session's run prefix, filled in by the agent: names what the peer leaves in /tmp

    def to_raw(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_raw(cls, raw: dict) -> "PeerSpec":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known} | {"shape": tuple(raw["shape"])})


def pattern(shape: tuple, salt: int) -> Any:
    """Deterministic pool contents (every value exact in float32), different per `salt`."""
    # deferred: torch
    import torch

    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 1009).to(torch.float32).reshape(shape)


def run_peer(raw: dict) -> None:
    """Process entry on the joined node: register a pool with NIXL, send its handle, wait for Stop."""
    # deferred: zmq
    import zmq

    spec = PeerSpec.from_raw(raw)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_on_signal)
    die_with_parent()
    # deferred: torch
    import torch

    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    connect_as_member(sock, spec.curve)
    sock.connect(spec.endpoint)
    transport = None
    try:
        try:
            # deferred: torch
            from pdlab.kv.nixl import NixlTransport

            # named with the session's prefix: the agent sweeps its UCX log folder even if it is killed
            transport = NixlTransport(spec.name, f"{spec.prefix}peer-{secrets.token_hex(3)}", ucx_tls=spec.ucx_tls)
            transport.kv_alloc(spec.shape, torch.float32).copy_(pattern(spec.shape, 1))
            sock.send(m.encode(nm.ProbeReady(spec.name, transport.export())))
        except Exception as e:  # noqa: BLE001 - the doctor reports it
            sock.send(m.encode(nm.ProbeReady(spec.name, None, f"{type(e).__name__}: {e}")))
            return
        deadline = time.monotonic() + PEER_WAIT_S
        while time.monotonic() < deadline:
            if sock.poll(200) and isinstance(m.decode(sock.recv()), m.Stop):
                return
    finally:
        if transport is not None:
            transport.close()
            remove_log_dir()  # this child ends with os._exit, which runs no atexit hook
        sock.close()
        ctx.term()


def measure(local: Any, peer: Any, sizes: tuple[int, ...], repeats: int = 5) -> list[dict]:
    """Pull and push between our pool (`local`, a NixlTransport whose pool has twice the peer's blocks) and the
    peer's (`peer`, opened) at each size (bytes; whole blocks, at least one). Raises RuntimeError when bytes do
    not arrive intact."""
    # deferred: torch
    import torch

    pool = local.pool
    per_block = pool[:, :, :1].numel() * pool.element_size()
    theirs = pattern(tuple(peer.shape), 1)  # what the peer's pool holds (it filled it so)
    ours = pattern(tuple(pool.shape), 2)
    out = []
    for size in sizes:
        n = max(1, min(size // per_block, peer.blocks, pool.shape[2] // 2))
        blocks, scratch = list(range(n)), list(range(n, 2 * n))
        reads, writes = [], []
        for _ in range(repeats + 1):  # the first of each is a warm-up
            pool[:, :, :n] = 0
            t0 = time.perf_counter()
            local.copy(peer, blocks, pool, blocks)
            reads.append(time.perf_counter() - t0)
            if not torch.equal(pool[:, :, :n], theirs[:, :, :n]):
                raise RuntimeError(f"NIXL READ of {n} blocks completed but the bytes differ")
            pool[:, :, :n] = ours[:, :, :n]
            t0 = time.perf_counter()
            local.copy(pool, blocks, peer, blocks)
            writes.append(time.perf_counter() - t0)
            theirs[:, :, :n] = ours[:, :, :n]
            local.copy(peer, blocks, pool, scratch)  # read it back
            if not torch.equal(pool[:, :, n:2 * n], ours[:, :, :n]):
                raise RuntimeError(f"NIXL WRITE of {n} blocks completed but reading them back differs")
        reads, writes = reads[1:], writes[1:]
        nbytes = n * per_block
        out.append({"bytes": nbytes, "blocks": n, "read_gbps": nbytes / min(reads) / 1e9,
                    "read_ms_p50": 1e3 * statistics.median(reads), "write_gbps": nbytes / min(writes) / 1e9,
                    "write_ms_p50": 1e3 * statistics.median(writes), "repeats": repeats})
    return out


def peer_spec(endpoint: str, ucx_tls: str, max_bytes: int) -> PeerSpec:
    """A probe peer with room for the largest size, in cpu-demo's block layout."""
    # deferred: torch
    from pdlab.kv.probe import kv_shape

    like = kv_shape("cpu-demo", 16)
    per_block = 4 * like[0] * like[1] * like[3] * like[4] * like[5]
    return replace(PeerSpec(endpoint, like, ucx_tls), shape=like[:2] + (max(1, max_bytes // per_block),) + like[3:])


def hostname() -> str:
    return os.uname().nodename
