"""GPU transports: `cuda-ipc` (pools shared through CUDA IPC handles) and `host` (pinned shared mirrors).

cuda-ipc: the pool's storage is exported at start-up with torch's own IPC reduction, but the handle
travels as plain data (bytes and ints, msgpack), never pickled. Each export carries its own slot in
torch's IPC reference-count file (set to 1: one consumer), and a consumer decrements it when it lets the
pool go; so a pool opened by several peers is exported once *per peer* (`peers`), each opening its own,
never one export shared by several consumers' ref counts. The peer maps it and copies with an ordinary
`copy_`: a device copy on one GPU, a peer copy (NVLink/PCIe) across two. Opening a handle needs the owner's
GPU to be visible in the opening process, so the launcher makes each worker's peers' GPUs visible after its
own; handles carry the GPU's CUDA_VISIBLE_DEVICES *entry* (index, UUID or MIG) and `visible` maps it to the
local index. Two different GPUs must have peer access (checked by pdlab.serve.topology before start):
without it CUDA stages the copy through the host, unordered against the peer's streams. On one GPU the
decode side's blocks are idle when reserved, since every engine step ends with a synchronize.

host: each worker's GPU pool has a mirror of the same shape in pinned shared host memory (/dev/shm,
registered with cudaHostRegister). Peers read/write mirrors like shm pools; the owner stages its blocks
D2H (`stage_out`, pull) or H2D (`stage_in`, push), in pieces contiguous on both sides (a DMA each, no
pageable temporary: pdlab.kv.transfer.host_device_pieces). It still costs host memory equal to the pool
(a bounded staging area would need mirror slots in the hand-over messages: not done), and works between
GPUs without peer access.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdlab.kv import shm
from pdlab.kv.transfer import Transport, copy_blocks


def _entry(visible: list[str], local: int) -> str:
    return visible[local] if local < len(visible) else str(local)


class CudaIpcTransport(Transport):
    name = "cuda-ipc"

    def __init__(self, worker: str, device: str = "cuda:0", visible: Sequence[str] = (), peers: Sequence[str] = ()):
        super().__init__(worker)
        self.device = torch.device(device)
        self.visible = [str(v) for v in visible]  # the CUDA_VISIBLE_DEVICES entry of each local index
        self.peers = list(peers)  # the workers that open this pool: one export each

    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        return self.pool

    def export(self) -> dict:
        """{kind, name, per_peer: {peer: handle}}: a handle of its own for each peer (without peers, one
        handle inline, for a single consumer)."""
        assert self.pool is not None, "pool not allocated yet"
        head = {"kind": "cuda-ipc", "name": f"{self.worker}-kv"}
        if not self.peers:
            return {**self._handle(), **head}
        return {**head, "per_peer": {p: self._handle() for p in self.peers}}

    def _handle(self) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        _, a = reduce_tensor(self.pool)  # a fresh IPC sent-data (own ref-count slot) on every call
        # a: cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
        #    requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required
        return {
            "kind": "cuda-ipc", "name": f"{self.worker}-kv", "size": list(a[1]), "stride": list(a[2]),
            "offset": int(a[3]), "dtype": str(a[5]).split(".")[-1], "gpu": _entry(self.visible, int(a[6])),
            "handle": bytes(a[7]), "storage_size": int(a[8]), "storage_offset": int(a[9]),
            "ref_handle": bytes(a[11]), "ref_offset": int(a[12]),
            "event_handle": None if a[13] is None else bytes(a[13]), "event_sync": bool(a[14]),
        }

    def _open(self, h: dict) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = own_handle(h, self.worker)
        if h["gpu"] not in self.visible and self.visible:
            raise RuntimeError(f"{self.worker}: GPU {h['gpu']} of {h['name']} is not visible here ({self.visible})")
        local = self.visible.index(h["gpu"]) if self.visible else int(h["gpu"])
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], torch.UntypedStorage,
            getattr(torch, h["dtype"]), local, h["handle"], h["storage_size"], h["storage_offset"], False,
            h["ref_handle"], h["ref_offset"], h["event_handle"], h["event_sync"],
        )

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def own_handle(h: dict, worker: str) -> dict:
    """The handle exported for `worker` (an export per peer), or the single inline one."""
    if "per_peer" not in h:
        return h
    if worker not in h["per_peer"]:
        raise RuntimeError(f"{worker}: {h['name']} was exported for {sorted(h['per_peer'])}, not for this worker")
    return {**h["per_peer"][worker], "name": h["name"]}


class HostTransport(Transport):
    name = "host"

    def __init__(self, worker: str, device: str, segment_name: str):
        super().__init__(worker)
        self.device = torch.device(device)
        self.segment_name = segment_name
        self.mirror: shm.ShmTensor | None = None

    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        self.mirror = shm.create(shape, dtype, name=self.segment_name)
        _pin(self.mirror.tensor)
        return self.pool

    def export(self) -> dict:
        assert self.mirror is not None, "pool not allocated yet"
        m = self.mirror
        return {"kind": "host", "name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).split(".")[-1]}

    def _open(self, h: dict) -> torch.Tensor:
        t = shm.attach(h["name"], h["shape"], getattr(torch, h["dtype"])).tensor
        _pin(t)
        return t

    def exchange(self) -> torch.Tensor:
        assert self.mirror is not None
        return self.mirror.tensor

    def stage_out(self, blocks: Sequence[int]) -> None:
        assert self.pool is not None and self.mirror is not None
        copy_blocks(self.pool, blocks, self.mirror.tensor, blocks, non_blocking=True)
        self.sync()

    def stage_in(self, blocks: Sequence[int]) -> None:
        assert self.pool is not None and self.mirror is not None
        copy_blocks(self.mirror.tensor, blocks, self.pool, blocks, non_blocking=True)
        self.sync()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        super().close()
        if self.mirror is not None:
            self.mirror.unlink()


def _pin(t: torch.Tensor) -> None:
    """Page-lock a shared host buffer in place so H2D/D2H copies run at DMA speed."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({err}): the host transport needs pinnable memory")
