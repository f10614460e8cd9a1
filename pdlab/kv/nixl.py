"""`nixl` transport: KV hand-over through NVIDIA's NIXL library (UCX backend), between processes or nodes.

Each worker runs one NIXL agent and registers its pool with it: DRAM for a CPU pool, VRAM for a GPU pool.
Nothing is shared between the sides: the pool is ordinary process memory (never /dev/shm), and the
prefill and decode workers reach each other only through pdlab's control plane and NIXL itself.

- `export()` is plain data carried by `Ready` over the control plane (msgpack): the agent's metadata
  (bytes from NIXL), and what the peer needs to address our blocks: base address, pool shape, dtype,
  memory kind and device id. The peer computes our descriptors itself; nothing is pickled.
- `open(handle)` loads the peer's agent, connects, and prepares a descriptor list over the peer's pool:
  one descriptor per (layer, K/V, block), so a transfer picks descriptors by index (NIXL merges the ones
  that are contiguous on both sides).
- `copy` is the hand-over itself: pull READs the peer's blocks into ours (decode initiates), push WRITEs
  ours into the blocks the decode worker reserved (prefill initiates). It blocks until NIXL reports the
  transfer DONE; UCX flushes the endpoint before that, so the bytes have landed on the remote side when
  the initiator sees DONE and the control-plane message that follows can admit the request.

What UCX actually selected is read from its own log (pdlab.kv.ucx_log): `path(peer)`.

CUDA: VRAM registration, device ids and a stream sync before NIXL touches the pool are written here but
were not run (no GPU on the box this was built on).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from pdlab.kv.transfer import Transport, block_bytes, copy_blocks
from pdlab.kv.ucx_log import read_lanes, ucx_log_file
from pdlab.recipe.nixl import INSTALL_HINT, nixl_module, resolve_ucx_tls


def load_api() -> Any:
    """NIXL's python API module (nixl_agent, nixl_agent_config, ...); ImportError with the install hint."""
    import importlib

    name = nixl_module()
    if name is None:
        raise ImportError(f"NIXL is not installed: {INSTALL_HINT}")
    api = importlib.import_module(f"{name}._api")
    import logging

    if not os.environ.get("NIXL_LOG_LEVEL"):  # its INFO lines go to stdout, the run's own output
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


@dataclass
class NixlPeer:
    """A peer's pool as this agent sees it: its agent name and a prepared descriptor list over its blocks."""

    name: str  # the handle's name (the peer's agent name)
    agent: str
    dlist: Any
    blocks: int
    path: str  # what UCX selected towards this peer


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, worker: str, agent_name: str, backends: Sequence[str] = ("UCX",), ucx_tls: str = "auto",
                 device: str = "cpu", timeout_s: float = 30.0):
        super().__init__(worker)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.ucx_tls = resolve_ucx_tls(ucx_tls, self.device.type == "cuda")
        os.environ["UCX_TLS"] = self.ucx_tls  # read by UCX when this agent creates its backend
        self.log_file = ucx_log_file()
        api = load_api()
        conf = api.nixl_agent_config(backends=list(backends),
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # copier threads
        self.agent_name = agent_name
        self.agent = api.nixl_agent(agent_name, conf)
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backend {', '.join(missing)} not created (plugins here: "
                               f"{', '.join(self.agent.plugin_list)}; UCX_TLS={self.ucx_tls})")
        self.backends = list(backends)
        self.reg: Any = None
        self.local: Any = None  # prepared descriptor list over our own pool
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"

    # ---- our pool ----
    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=self.device)  # private memory, not /dev/shm
        self.reg = self.agent.register_memory(self.pool)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors(self.pool.data_ptr(), shape,
                                                self.pool.element_size(), _dev(self.pool)), self.mem)
        return self.pool

    def export(self) -> dict:
        assert self.pool is not None, "pool not allocated yet"
        return {"kind": "nixl", "name": self.agent_name, "metadata": self.agent.get_agent_metadata(),
                "addr": int(self.pool.data_ptr()), "shape": list(self.pool.shape),
                "dtype": str(self.pool.dtype).split(".")[-1], "mem": self.mem, "dev": _dev(self.pool),
                "host": socket.gethostname(), "ucx_tls": self.ucx_tls}

    # ---- peers ----
    def _open(self, h: dict) -> NixlPeer:
        assert self.pool is not None, "pool not allocated yet"
        shape = tuple(h["shape"])
        if shape[0] != self.pool.shape[0] or shape[1] != 2 or shape[3:] != tuple(self.pool.shape[3:]) or \
                h["dtype"] != str(self.pool.dtype).split(".")[-1]:
            raise ValueError(f"peer pool {h['name']} is {shape} {h['dtype']}, ours {tuple(self.pool.shape)} "
                             f"{self.pool.dtype}: block layouts differ")
        agent = self.agent.add_remote_agent(h["metadata"])
        agent = agent.decode() if isinstance(agent, bytes) else agent
        self.agent.make_connection(agent)  # the endpoint now, not at the first transfer (and its lanes logged)
        dlist = self.agent.prep_xfer_dlist(agent, descriptors(h["addr"], shape, self.pool.element_size(), h["dev"]),
                                           h["mem"])
        return NixlPeer(h["name"], agent, dlist, shape[2], self._lanes(agent))

    def _lanes(self, agent: str) -> str:
        deadline = time.monotonic() + 1.0  # UCX writes the line as it creates the endpoint
        while True:
            lanes = read_lanes(self.agent_name, self.log_file)
            if lanes or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return f"{'+'.join(self.backends)} {lanes or '(lanes not logged)'} [UCX_TLS={self.ucx_tls}]"

    def path(self, peer: str) -> str:
        """What the hand-over to/from `peer` (its handle name) actually went through."""
        p = self._peers.get(peer)
        return p.path if isinstance(p, NixlPeer) else self.name

    # ---- the hand-over ----
    def copy(self, src: Any, src_blocks: Sequence[int], dst: Any, dst_blocks: Sequence[int],
             layer: Optional[int] = None, non_blocking: bool = False) -> int:
        """READ (src is a peer) or WRITE (dst is a peer) these blocks, all layers or one; returns the bytes."""
        if isinstance(src, NixlPeer):
            op, peer, mine, theirs = "READ", src, dst_blocks, src_blocks
        elif isinstance(dst, NixlPeer):
            op, peer, mine, theirs = "WRITE", dst, src_blocks, dst_blocks
        else:  # both local (not a hand-over between workers)
            return copy_blocks(src, src_blocks, dst, dst_blocks, layer=layer, non_blocking=non_blocking)
        if len(mine) != len(theirs):
            raise ValueError(f"block lists differ in length: {len(mine)} local, {len(theirs)} remote")
        if not mine:
            return 0
        if self.pool.device.type == "cuda":  # NIXL is not stream-ordered: the KV must be computed first
            torch.cuda.current_stream(self.pool.device).synchronize()
        layers = self.pool.shape[0]
        local = block_indices(mine, self.pool.shape[2], layers, layer)
        remote = block_indices(theirs, peer.blocks, layers, layer)
        handle = self.agent.make_prepped_xfer(op, self.local, local, peer.dlist, remote)
        done = False
        try:
            state = self.agent.transfer(handle)
            deadline, nap = time.monotonic() + self.timeout_s, 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL {op} with {peer.agent} not done within {self.timeout_s:g}s")
                time.sleep(nap)  # yield the core the worker shares with this copy
                nap = min(2e-4, nap + 2e-5)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} with {peer.agent} failed (state {state})")
            done = True
        finally:
            try:
                handle.release()  # a transfer still in flight is cancelled (NIXL raises if it cannot be)
            except Exception:  # noqa: BLE001 - after a failure, that failure is the one to report
                if done:
                    raise
        return len(mine) * block_bytes(self.pool) // (1 if layer is None else layers)

    copy.host_driven = True  # type: ignore[attr-defined]  # a blocking call: copiers run it on a thread

    def close(self) -> None:
        for p in self._peers.values():
            if isinstance(p, NixlPeer):
                _quietly(p.dlist.release)
                _quietly(self.agent.remove_remote_agent, p.agent)
        super().close()
        if self.local is not None:
            _quietly(self.local.release)
            self.local = None
        if self.reg is not None:
            _quietly(self.agent.deregister_memory, self.reg)
            self.reg = None


def descriptors(base: int, shape: Sequence[int], itemsize: int, dev: int) -> np.ndarray:
    """(address, length, device) of every (layer, K/V, block) of a contiguous pool, in index order."""
    rows = int(shape[0]) * int(shape[1]) * int(shape[2])
    part = int(np.prod(shape[3:])) * itemsize
    out = np.empty((rows, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(rows, dtype=np.uint64) * part
    out[:, 1] = part
    out[:, 2] = dev
    return out


def block_indices(blocks: Sequence[int], num_blocks: int, layers: int, layer: Optional[int] = None) -> np.ndarray:
    """Descriptor indices of `blocks` in every layer (or one), K and V: ((layer * 2 + kv) * blocks + block)."""
    ls = np.arange(layers) if layer is None else np.array([layer])
    rows = (ls[:, None] * 2 + np.arange(2)[None, :]).reshape(-1)
    return (rows[:, None] * num_blocks + np.asarray(blocks)[None, :]).reshape(-1).astype(np.int32)


def _dev(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)  # DRAM: 0


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - closing: the agent goes away with the process anyway
        pass
