"""The GPU transport `cuda-ipc`: pools shared through CUDA IPC handles (`host`, pinned shared mirrors that
work between any two workers, is pdlab.kv.host).

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
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.multiprocessing import reductions

from pdlab.kv.transfer import Transport


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
        _, a = reductions.reduce_tensor(self.pool)  # a fresh IPC sent-data (own ref-count slot) on every call
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
        h = own_handle(h, self.worker)
        if h["gpu"] not in self.visible and self.visible:
            raise RuntimeError(f"{self.worker}: GPU {h['gpu']} of {h['name']} is not visible here ({self.visible})")
        local = self.visible.index(h["gpu"]) if self.visible else int(h["gpu"])
        return reductions.rebuild_cuda_tensor(
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
