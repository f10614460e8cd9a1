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

Tensor-parallel groups (pdlab.kv.sharded): a group's rank 0 maps its followers' shards (CPU: in /dev/shm,
pdlab.serve.tensor_group) and registers them with its agent (`adopt`); the group's handle lists one NIXL
handle per shard, all of that one agent. A peer opens every shard. A hand-over between groups whose shards
line up (same TP) is one READ / WRITE per shard pair; otherwise heads are re-sliced through a registered
staging buffer on the initiating side: pull READs each source shard's blocks into it and copies the heads
each local shard needs; push gathers each destination shard's heads into it and WRITEs it.

CUDA: VRAM registration, device ids and a stream sync before NIXL touches the pool are written here but
were not run (no GPU on the box this was built on).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from pdlab.kv.sharded import ShardedPool, as_sharded, copy_heads, plan, whole
from pdlab.kv.copy import block_bytes, copy_blocks
from pdlab.kv.transfer import Transport
from pdlab.kv.ucx_log import read_lanes, ucx_log_file
from pdlab.recipe.nixl import INSTALL_HINT, nixl_module, resolve_ucx_tls


def load_api() -> Any:
    """NIXL's python API module (nixl_agent, nixl_agent_config, ...); ImportError with the install hint."""

    name = nixl_module()
    if name is None:
        raise ImportError(f"NIXL is not installed: {INSTALL_HINT}")
    api = importlib.import_module(f"{name}._api")

    if not os.environ.get("NIXL_LOG_LEVEL"):  # its INFO lines go to stdout, the run's own output
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


NOT_LOGGED = "(lanes not logged)"  # a peer's path before UCX logged its endpoint's lanes


@dataclass
class NixlPeer:
    """A peer's pool (or one shard of a peer group's pool) as this agent sees it: the peer's agent name and a
    prepared descriptor list over its blocks."""

    name: str  # the handle's name
    agent: str
    dlist: Any
    blocks: int
    path: str  # what UCX selected towards this peer
    shape: tuple = ()


@dataclass
class _Local:
    """A registered local tensor: the pool, a follower's shard or a staging buffer."""

    tensor: torch.Tensor
    reg: Any
    dlist: Any


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, worker: str, agent_name: str, backends: Sequence[str] = ("UCX",), ucx_tls: str = "auto",
                 device: str = "cpu", timeout_s: float = 30.0):
        super().__init__(worker)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.ucx_tls = resolve_ucx_tls(ucx_tls, self.device.type == "cuda")
        os.environ["UCX_TLS"] = self.ucx_tls  # read by UCX when this agent creates its backend
        self.log_file = ucx_log_file(f"{agent_name}-")  # the agent is named with its run's prefix
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
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self._locals: dict[int, _Local] = {}  # by data_ptr: our pool, adopted shards, staging buffers
        self._staging: dict[tuple, _Local] = {}  # by shard shape without the block count
        self._agents: dict[str, tuple[str, str]] = {}  # peer agent name -> (NIXL's name for it, UCX path)

    # ---- our pool ----
    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=self.device)  # private memory, not /dev/shm
        self.adopt(self.pool)
        return self.pool

    def adopt(self, t: torch.Tensor) -> None:
        """Register a local tensor of pool layout (a follower's shard this process mapped) with our agent."""
        if t.data_ptr() in self._locals:
            return
        reg = self.agent.register_memory(t)
        dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors(t.data_ptr(), t.shape, t.element_size(),
                                           _dev(t)), self.mem)
        self._locals[t.data_ptr()] = _Local(t, reg, dlist)

    def export(self) -> dict:
        assert self.pool is not None, "pool not allocated yet"
        return self.export_shard(self.pool, self.agent_name)

    def export_shard(self, t: torch.Tensor, name: str) -> dict:
        self.adopt(t)
        return {"kind": "nixl", "name": name, "agent": self.agent_name, "metadata": self.agent.get_agent_metadata(),
                "addr": int(t.data_ptr()), "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1],
                "mem": self.mem, "dev": _dev(t), "host": socket.gethostname(), "ucx_tls": self.ucx_tls}

    # ---- peers ----
    def _open(self, h: dict) -> NixlPeer:
        assert self.pool is not None, "pool not allocated yet"
        shape = tuple(h["shape"])
        mine = tuple(self.pool.shape)
        # KV heads per shard may differ (tensor-parallel groups of other sizes): re-sliced in the copy
        if shape[0] != mine[0] or shape[1] != 2 or shape[3] != mine[3] or shape[5] != mine[5] or \
                h["dtype"] != str(self.pool.dtype).split(".")[-1]:
            raise ValueError(f"peer pool {h['name']} is {shape} {h['dtype']}, ours {mine} "
                             f"{self.pool.dtype}: block layouts differ")
        key = h.get("agent", h["name"])
        if key not in self._agents:  # a group's shards are all of one agent: load and connect it once
            agent = self.agent.add_remote_agent(h["metadata"])
            agent = agent.decode() if isinstance(agent, bytes) else agent
            self.agent.make_connection(agent)  # the endpoint now, not at the first transfer (and its lanes logged)
            self._agents[key] = (agent, self._lanes(agent))
        agent, path = self._agents[key]
        dlist = self.agent.prep_xfer_dlist(agent, descriptors(h["addr"], shape, self.pool.element_size(), h["dev"]),
                                           h["mem"])
        return NixlPeer(h["name"], agent, dlist, shape[2], path, shape)

    def _lanes(self, agent: str) -> str:
        deadline = time.monotonic() + 1.0  # UCX writes the line as it creates the endpoint
        while True:
            lanes = read_lanes(self.agent_name, self.log_file)
            if lanes or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return self._describe(lanes)

    def _describe(self, lanes: Optional[str]) -> str:
        return f"{'+'.join(self.backends)} {lanes or NOT_LOGGED} [UCX_TLS={self.ucx_tls}]"

    def path(self, peer: str) -> str:
        """What the hand-over to/from `peer` (its handle name) actually went through. Lanes UCX had not logged
        by the connection's deadline (a busy box wires an endpoint up late) are read again here, after the
        transfers."""
        p = self._peers.get(peer)
        if isinstance(p, ShardedPool):
            p = p.shards[0]
        if not isinstance(p, NixlPeer):
            return self.name
        if NOT_LOGGED in p.path:
            lanes = read_lanes(self.agent_name, self.log_file)
            if lanes:
                p.path = self._describe(lanes)
                key = next((k for k, (a, _) in self._agents.items() if a == p.agent), None)
                if key is not None:
                    self._agents[key] = (p.agent, p.path)
        return p.path

    # ---- the hand-over ----
    def copy(self, src: Any, src_blocks: Sequence[int], dst: Any, dst_blocks: Sequence[int],
             layer: Optional[int] = None, non_blocking: bool = False) -> int:
        """READ (src is a peer) or WRITE (dst is a peer) these blocks, all layers or one; returns the bytes.
        Either side may be a tensor-parallel group's pool (ShardedPool): shard by shard, heads re-sliced."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"block lists differ in length: {len(src_blocks)} source, {len(dst_blocks)} destination")
        if isinstance(src, ShardedPool) or isinstance(dst, ShardedPool):
            return self._copy_sharded(src, src_blocks, dst, dst_blocks, layer)
        if isinstance(src, NixlPeer):
            return self._xfer("READ", dst, dst_blocks, src, src_blocks, layer)
        if isinstance(dst, NixlPeer):
            return self._xfer("WRITE", src, src_blocks, dst, dst_blocks, layer)
        # both local (not a hand-over between workers)
        return copy_blocks(src, src_blocks, dst, dst_blocks, layer=layer, non_blocking=non_blocking)

    def _xfer(self, op: str, local: torch.Tensor, mine: Sequence[int], peer: NixlPeer, theirs: Sequence[int],
              layer: Optional[int]) -> int:
        """One READ into / WRITE from a registered local tensor; blocks until NIXL reports it DONE."""
        if not len(mine):
            return 0
        entry = self._locals.get(local.data_ptr())
        if entry is None:
            raise RuntimeError(f"{self.worker}: a local tensor not registered with NIXL took part in a {op}")
        if local.device.type == "cuda":  # NIXL is not stream-ordered: the KV must be computed first
            torch.cuda.current_stream(local.device).synchronize()
        layers = local.shape[0]
        handle = self.agent.make_prepped_xfer(op, entry.dlist, block_indices(mine, local.shape[2], layers, layer),
                                              peer.dlist, block_indices(theirs, peer.blocks, layers, layer))
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
        return len(mine) * block_bytes(local) // (1 if layer is None else layers)

    def _copy_sharded(self, src: Any, src_blocks: Sequence[int], dst: Any, dst_blocks: Sequence[int],
                      layer: Optional[int]) -> int:
        heads = (src if isinstance(src, ShardedPool) else dst).kv_heads
        s_pool, d_pool = as_sharded(src, heads), as_sharded(dst, heads)
        pairs = plan(s_pool, d_pool)
        n = len(src_blocks)
        if not n:
            return 0
        staged = list(range(n))
        total = 0
        if isinstance(s_pool.shards[0], NixlPeer):  # pull: READ each source shard, re-slice into ours
            for i, peer in enumerate(s_pool.shards):
                mine = [(j, sl, dl) for ii, j, sl, dl in pairs if ii == i]
                j, sl, dl = mine[0]
                if len(mine) == 1 and whole(sl, peer.shape[4]) and whole(dl, d_pool.shards[j].shape[4]):
                    total += self._xfer("READ", d_pool.shards[j], dst_blocks, peer, src_blocks, layer)
                    continue
                stage = self._stage(peer.shape, n)
                total += self._xfer("READ", stage, staged, peer, src_blocks, layer)
                for j, sl, dl in mine:
                    copy_heads(stage, staged, sl, d_pool.shards[j], dst_blocks, dl, layer)
            return total
        for j, peer in enumerate(d_pool.shards):  # push: gather each destination shard's heads, WRITE it
            theirs = [(i, sl, dl) for i, jj, sl, dl in pairs if jj == j]
            i, sl, dl = theirs[0]
            if len(theirs) == 1 and whole(sl, s_pool.shards[i].shape[4]) and whole(dl, peer.shape[4]):
                total += self._xfer("WRITE", s_pool.shards[i], src_blocks, peer, dst_blocks, layer)
                continue
            stage = self._stage(peer.shape, n)
            for i, sl, dl in theirs:
                copy_heads(s_pool.shards[i], src_blocks, sl, stage, staged, dl, layer)
            total += self._xfer("WRITE", stage, staged, peer, dst_blocks, layer)
        return total

    def _stage(self, shape: Sequence[int], blocks: int) -> torch.Tensor:
        """A registered staging buffer laid out like a shard of `shape`, with room for `blocks` blocks (kept
        and grown, so registration is paid once per size class, not per hand-over)."""
        key = (tuple(shape[:2]), tuple(shape[3:]))
        have = self._staging.get(key)
        if have is None or have.tensor.shape[2] < blocks:
            if have is not None:
                self._drop(have)
            cap = max(blocks, 2 * have.tensor.shape[2] if have is not None else 16)
            t = torch.zeros((shape[0], shape[1], cap, *shape[3:]), dtype=self.pool.dtype, device=self.pool.device)
            self.adopt(t)
            have = self._staging[key] = self._locals[t.data_ptr()]
        return have.tensor

    def _drop(self, entry: _Local) -> None:
        self._locals.pop(entry.tensor.data_ptr(), None)
        _quietly(entry.dlist.release)
        _quietly(self.agent.deregister_memory, entry.reg)

    copy.host_driven = True  # type: ignore[attr-defined]  # a blocking call: copiers run it on a thread

    def close(self) -> None:
        for p in self._peers.values():
            for shard in (p.shards if isinstance(p, ShardedPool) else [p]):
                if isinstance(shard, NixlPeer):
                    _quietly(shard.dlist.release)
        for agent, _ in self._agents.values():
            _quietly(self.agent.remove_remote_agent, agent)
        self._agents.clear()
        super().close()
        for entry in list(self._locals.values()):
            self._drop(entry)
        self._staging.clear()


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
