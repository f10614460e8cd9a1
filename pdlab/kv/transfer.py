"""KV hand-over between a prefill worker's pool and a decode worker's pool.

A pool is a tensor [layers, 2, blocks, block_size, kv_heads, head_dim]. A hand-over copies a
request's blocks from the prefill pool into the blocks the decode worker reserved for it. The peer's
pool is opened once through a transport-specific handle exchanged at start-up:

- `shm`      CPU pools live in /dev/shm; the peer maps the segment (pdlab.kv.shm).
- `cuda-ipc` GPU pools exported with CUDA IPC handles; a device or peer copy (pdlab.kv.cuda_ipc).
- `host`     private pools, each with a shared host mirror; the owner stages blocks between them (D2H / H2D
             on GPUs, a copy on CPU; pdlab.kv.host).
- `nixl`     pools registered with a NIXL agent; the peer READs / WRITEs them over UCX (pdlab.kv.nixl).

Modes: `pull` - the decode worker reads the prefill pool after prefill finished; `push` - the prefill
worker writes each layer into the decode pool as the layer is computed (see PushCopier).

Here: a transfer's record and the transport base class (and shm's); the block copy itself is pdlab.kv.copy,
and pdlab.kv.factory makes a worker's transport by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from pdlab.kv import shm
from pdlab.kv.copy import copy_blocks
from pdlab.kv.sharded import ShardedPool, as_sharded, copy_sharded


@dataclass
class TransferRecord:
    request: str  # the request's id (DESIGN.md's transfers.jsonl field)
    bytes: int
    blocks: int
    start: float  # time.monotonic()
    end: float
    transport: str
    mode: str
    src: str  # worker names
    dst: str
    saved_bytes: int = 0  # prefix-cache blocks the decode side already held, not sent
    copy_s: float = 0.0  # time spent copying (push: less than end - start, the copies interleave with compute)
    path: str = ""  # what the transport actually went through (nixl: backend and UCX lanes), Transport.path

    def to_dict(self) -> dict:
        return asdict(self)


class Transport:
    """One worker's end of a transport: places its pool, exports a handle, opens peers' pools."""

    name = "base"

    def __init__(self, worker: str):
        self.worker = worker
        self.pool: Optional[torch.Tensor] = None
        self._peers: dict[str, torch.Tensor] = {}

    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        raise NotImplementedError

    def export(self) -> dict:
        """A plain-data handle of the pool (or its exchange area) that peers pass to `open`."""
        raise NotImplementedError

    def _open(self, handle: dict) -> torch.Tensor:
        raise NotImplementedError

    def open(self, handle: dict) -> torch.Tensor:
        """The peer's exchange tensor, mapped once and cached by name (a tensor-parallel peer: its shards,
        as a pdlab.kv.sharded.ShardedPool)."""
        key = handle["name"]
        if key not in self._peers:
            if handle.get("kind") == "sharded":
                self._peers[key] = ShardedPool([self.open(h) for h in handle["shards"]], handle["kv_heads"])
            else:
                self._peers[key] = self._open(handle)
        return self._peers[key]

    def adopt(self, t: torch.Tensor) -> None:
        """Make a local tensor of pool layout (a follower's shard this process mapped) usable in hand-overs
        (nixl: register it with the agent)."""

    def export_shard(self, t: torch.Tensor, name: str) -> dict:
        """The handle of a follower's KV shard this process mapped (a tensor-parallel group's rank 0), named
        `name`: one entry of the group's handle (pdlab.serve.tensor_group)."""
        raise NotImplementedError(f"transport {self.name} has no tensor-parallel hand-over")

    def exchange(self) -> torch.Tensor:
        """What peers read from / write into: the pool itself, or its host mirror."""
        assert self.pool is not None
        return self.pool

    def stage_out(self, blocks: Sequence[int]) -> None:
        """Make `blocks` of the pool readable by peers (host: D2H into the mirror). Pull, prefill side."""

    def stage_in(self, blocks: Sequence[int]) -> None:
        """Move `blocks` written by a peer into the pool (host: H2D from the mirror). Push, decode side."""

    def sync(self) -> None:
        """Wait until copies issued so far are complete."""

    def copy(self, src: object, src_blocks: Sequence[int], dst: object, dst_blocks: Sequence[int], **kw: object) -> int:
        """The hand-over between our pool and an opened peer (copy_blocks; nixl: a READ or WRITE); between
        tensor-parallel groups, shard by shard with the heads re-sliced."""
        if isinstance(src, ShardedPool) or isinstance(dst, ShardedPool):
            heads = (src if isinstance(src, ShardedPool) else dst).kv_heads  # type: ignore[union-attr]
            return copy_sharded(as_sharded(src, heads), src_blocks, as_sharded(dst, heads), dst_blocks, copy_blocks,
                                **kw)  # type: ignore[arg-type]
        return copy_blocks(src, src_blocks, dst, dst_blocks, **kw)  # type: ignore[arg-type]

    def path(self, peer: str) -> str:
        """What a hand-over with `peer` (its handle name) actually went through, for the records."""
        return self.name

    def close(self) -> None:
        self._peers.clear()


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, worker: str, segment_name: str):
        super().__init__(worker)
        self.alloc = shm.ShmAllocator(segment_name)

    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = self.alloc(shape, dtype)
        return self.pool

    def export(self) -> dict:
        seg = self.alloc.segment
        assert seg is not None, "pool not allocated yet"
        return {"kind": "shm", "name": seg.name, "shape": list(seg.shape), "dtype": str(seg.dtype).split(".")[-1]}

    def export_shard(self, t: torch.Tensor, name: str) -> dict:
        return {"kind": "shm", "name": name, "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1]}

    def _open(self, handle: dict) -> torch.Tensor:
        return shm.attach(handle["name"], handle["shape"], getattr(torch, handle["dtype"])).tensor

    def close(self) -> None:
        super().close()
        if self.alloc.segment is not None:
            self.alloc.segment.unlink()
