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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pdlab.constants import TRANSPORTS
from pdlab.kv import shm


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


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block across every layer, K and V."""
    return pool[:, :, 0].numel() * pool.element_size()


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block lists into runs contiguous on both sides: [(src0, dst0, length)]."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} source, {len(dst)} destination")
    n = len(src)
    if n == 0:
        return []
    # fast path, the common case of a fresh pool: both sides one run (list compare runs in C)
    if list(src) == list(range(src[0], src[0] + n)) and list(dst) == list(range(dst[0], dst[0] + n)):
        return [(src[0], dst[0], n)]
    a, b = np.asarray(src), np.asarray(dst)
    cut = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(a[starts].tolist(), b[starts].tolist(), lengths.tolist()))


# CPU: up to this many runs torch copies them; more go through numpy.
_CPU_TORCH_RUNS = 4
# GPU: above this many runs one gather/scatter kernel pair beats a copy per run (launch overhead).
_MAX_RUNS = 16
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_blocks(src_pool: torch.Tensor, src_blocks: Sequence[int], dst_pool: torch.Tensor,
                dst_blocks: Sequence[int], layer: Optional[int] = None, non_blocking: bool = False) -> int:
    """Copy blocks src_pool[..., src_blocks] -> dst_pool[..., dst_blocks], all layers or one.

    Returns the bytes copied. Pools may sit on different devices (D2H / H2D / peer copies).
    """
    if src_pool.shape[0] != dst_pool.shape[0] or src_pool.shape[3:] != dst_pool.shape[3:]:
        raise ValueError(f"pool shapes do not match: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}")
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"pool dtypes differ: {src_pool.dtype} vs {dst_pool.dtype}")
    if not src_blocks:
        return 0
    src = src_pool if layer is None else src_pool[layer : layer + 1]
    dst = dst_pool if layer is None else dst_pool[layer : layer + 1]
    runs = block_runs(src_blocks, dst_blocks)
    if src.device.type != dst.device.type:  # D2H / H2D (host transport): only contiguous pieces, see below
        for d_piece, s_piece in host_device_pieces(src, dst, runs):
            d_piece.copy_(s_piece, non_blocking=non_blocking)
    elif src.device.type == "cpu" and dst.device.type == "cpu" and len(runs) > _CPU_TORCH_RUNS:
        # numpy slice copies on [layers*2, blocks, block] views: less per-op overhead than torch when
        # a scattered block table makes one copy per block (about 3x faster at 128 one-block runs);
        # for a few long runs torch's copy is faster (memcpy of whole strided slices)
        sv = src.reshape(src.shape[0] * 2, src.shape[2], -1).view(_INT[src.element_size()]).numpy()
        dv = dst.reshape(dst.shape[0] * 2, dst.shape[2], -1).view(_INT[dst.element_size()]).numpy()
        for s, d, n in runs:
            dv[:, d : d + n] = sv[:, s : s + n]
    elif len(runs) <= _MAX_RUNS or src.device != dst.device:
        # [layers*2, blocks, block elements]: each run is then one strided 2-D slice per pool
        sv = src.view(src.shape[0] * 2, src.shape[2], -1)
        dv = dst.view(dst.shape[0] * 2, dst.shape[2], -1)
        for s, d, n in runs:
            dv[:, d : d + n].copy_(sv[:, s : s + n], non_blocking=non_blocking)
    else:
        si = torch.tensor(list(src_blocks), device=src.device)
        di = torch.tensor(list(dst_blocks), device=dst.device)
        dst.index_copy_(2, di, src.index_select(2, si))
    return len(src_blocks) * (src.numel() // src.shape[2]) * src.element_size()


def host_device_pieces(src: torch.Tensor, dst: torch.Tensor,
                       runs: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pieces of a copy between a GPU pool and a host buffer of the same layout, each
    contiguous on both sides: one per run of blocks and per (layer, K|V) row. A strided slice copied across
    devices goes through a pageable temporary (a CPU memcpy, then a synchronous copy); a contiguous piece
    of pinned memory is one DMA, asynchronous with non_blocking. More copies, each at DMA speed."""
    sv = src.view(src.shape[0] * 2, src.shape[2], -1)
    dv = dst.view(dst.shape[0] * 2, dst.shape[2], -1)
    return [(dv[r, d:d + n], sv[r, s:s + n]) for s, d, n in runs for r in range(sv.shape[0])]


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
                from pdlab.kv.sharded import ShardedPool

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
        from pdlab.kv.sharded import ShardedPool, as_sharded, copy_sharded

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


def make_transport(name: str, worker: str, run_prefix: str, device: str = "cpu",
                   visible: Sequence[int] = (), options: Optional[dict] = None) -> Transport:
    """The transport end for one worker. `run_prefix` names its shared segments (swept on stop) and its
    NIXL agent; `options`: the deployment's nixl section as plain data, plus `timeout_s`."""
    if name == "nixl":
        from pdlab.kv.nixl import NixlTransport

        o = options or {}
        return NixlTransport(worker, f"{run_prefix}{worker}", o.get("backends", ("UCX",)), o.get("ucx_tls", "auto"),
                             device, o.get("timeout_s", 30.0))
    if name == "shm":
        return ShmTransport(worker, f"{run_prefix}{worker}-kv")
    if name == "host":
        from pdlab.kv.host import HostTransport

        return HostTransport(worker, device, f"{run_prefix}{worker}-host")
    if name == "cuda-ipc":
        from pdlab.kv.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(worker, device, visible, (options or {}).get("peers", ()))
    raise ValueError(f"transport {name!r} is not available here (known: {', '.join(TRANSPORTS)})")
