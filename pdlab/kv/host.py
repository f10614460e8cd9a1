"""The `host` transport: each worker's pool is private, beside a mirror of the same shape in shared host memory
(/dev/shm); peers read and write only mirrors, and the owner stages its own blocks between pool and mirror.

Pull: the prefill worker copies a finished prompt's blocks pool -> mirror (`stage_out`) before it reports
PrefillDone; the decode worker copies them from that mirror into its pool. Push: the prefill worker writes
the decode worker's mirror, layer by layer; the decode worker copies the written blocks mirror -> pool
(`stage_in`) when the Admit lands (pdlab.serve.intake), before the request decodes.

On GPUs the pool is device memory, the mirror is pinned (cudaHostRegister) and a stage is a D2H or H2D copy in
pieces contiguous on both sides (a DMA each, pdlab.kv.copy.host_device_pieces): it works between GPUs
without peer access and costs host memory equal to the pool (a bounded staging area would need mirror slots
in the hand-over messages: not done). On CPU the same code runs with a stage that is a plain copy, so every
step of the GPU path, push's stage-in included, runs in the CPU suite with token parity
(tests/test_host_transport.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pdlab.kv import shm
from pdlab.kv.copy import copy_blocks
from pdlab.kv.transfer import Transport


class HostTransport(Transport):
    name = "host"

    def __init__(self, worker: str, device: str, segment_name: str):
        super().__init__(worker)
        self.device = torch.device(device)
        self.segment_name = segment_name
        self.mirror: Optional[shm.ShmTensor] = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def kv_alloc(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        self.mirror = shm.create(shape, dtype, name=self.segment_name)
        if self.cuda:
            pin(self.mirror.tensor)
        return self.pool

    def export(self) -> dict:
        assert self.mirror is not None, "pool not allocated yet"
        m = self.mirror
        return {"kind": "host", "name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).split(".")[-1]}

    def _open(self, h: dict) -> torch.Tensor:
        t = shm.attach(h["name"], h["shape"], getattr(torch, h["dtype"])).tensor
        if self.cuda:
            pin(t)
        return t

    def exchange(self) -> torch.Tensor:
        assert self.mirror is not None
        return self.mirror.tensor

    def stage_out(self, blocks: Sequence[int]) -> None:
        assert self.pool is not None and self.mirror is not None
        copy_blocks(self.pool, blocks, self.mirror.tensor, blocks, non_blocking=self.cuda)
        self.sync()

    def stage_in(self, blocks: Sequence[int]) -> None:
        assert self.pool is not None and self.mirror is not None
        copy_blocks(self.mirror.tensor, blocks, self.pool, blocks, non_blocking=self.cuda)
        self.sync()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        super().close()
        if self.mirror is not None:
            self.mirror.unlink()


def pin(t: torch.Tensor) -> None:
    """Page-lock a shared host buffer in place so H2D/D2H copies run at DMA speed."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({err}): the host transport needs pinnable memory")
