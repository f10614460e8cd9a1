"""Measured KV hand-over bandwidth per transport, next to a plain copy of the same bytes in the same run.

A probe builds two pools of a KV-sized shape, does the hand-over the way a worker does (`copy_blocks`
from one pool's blocks into the other's reserved blocks, through the transport's memory), and times it
against the baseline a reader would compare with: a contiguous memcpy (CPU) or device copy (GPU) of the
same number of bytes. Used by `pdlab doctor` and benchmarks/bench_transfer.py.

cuda-ipc is timed in one process: a process cannot open its own IPC handle, and once a peer has
opened it the copy is the same device/peer copy measured here.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdlab.constants import cdiv
from pdlab.engine.model import PRESETS
from pdlab.kv import shm
from pdlab.kv.copy import copy_blocks
from pdlab.kv.host import pin
from pdlab.kv.nixl_probe import probe_nixl
from pdlab.kv.probe_result import ProbeResult, best_of


def kv_shape(preset: str = "cpu-demo", tokens: int = 2048, block_size: int = 16) -> tuple[int, ...]:
    """Pool shape [layers, 2, blocks, block_size, kv_heads, head_dim] holding `tokens` of a preset."""

    p = PRESETS[preset]
    return (p.layers, 2, cdiv(tokens, block_size), block_size, p.kv_heads, p.hidden_size // p.heads)


def shape_for_mb(mb: float, like: tuple[int, ...], itemsize: int = 4) -> tuple[int, ...]:
    per_block = itemsize * like[0] * like[1] * like[3] * like[4] * like[5]
    return like[:2] + (max(1, int(mb * 1e6 / per_block)),) + like[3:]


def _measure(name: str, src: torch.Tensor, dst: torch.Tensor, sync: Callable[[], None], baseline: str,
             scattered: bool, repeats: int, note: str = "") -> ProbeResult:
    n = src.shape[2]
    src_blocks = list(range(n))
    # scattered: reserved blocks interleaved with others, as a pool looks after some churn
    dst_blocks = [2 * i for i in range(n)] if scattered else list(range(n))
    nbytes = src.numel() * src.element_size()
    flat_a = torch.empty(nbytes // src.element_size(), dtype=src.dtype, device=src.device)
    flat_b = torch.empty_like(flat_a)
    flat_a.fill_(1)
    base = best_of(lambda: flat_b.copy_(flat_a), sync, repeats)
    hand = best_of(lambda: copy_blocks(src, src_blocks, dst, dst_blocks, non_blocking=True), sync, repeats)
    return ProbeResult(name, True, note, nbytes, n, nbytes / hand / 1e9, nbytes / base / 1e9, baseline)


def probe_shm(shape: tuple[int, ...], repeats: int = 20, scattered: bool = False) -> ProbeResult:
    """Prefill pool -> decode pool, both in /dev/shm, the destination mapped a second time as a peer maps it."""
    dst_shape = shape[:2] + (2 * shape[2],) + shape[3:]
    a = shm.create(shape, torch.float32, tag="probe")
    b = shm.create(dst_shape, torch.float32, tag="probe")
    try:
        a.tensor.normal_()
        peer = shm.attach(b.name, dst_shape, torch.float32).tensor
        return _measure("shm", a.tensor, peer, lambda: None, "memcpy (torch copy, same bytes)", scattered, repeats)
    finally:
        a.unlink()
        b.unlink()


def probe_cuda(shape: tuple[int, ...], repeats: int = 20, scattered: bool = False,
               dtype: torch.dtype = torch.bfloat16) -> list[ProbeResult]:
    """cuda-ipc on one GPU and across GPU 0 -> 1 (peer), and host staging, when CUDA is there."""
    if not torch.cuda.is_available():
        why = "no CUDA device visible (torch.cuda.is_available() is False)"
        return [ProbeResult("cuda-ipc", False, why), ProbeResult("host", False, why)]
    out = []
    dst_shape = shape[:2] + (2 * shape[2],) + shape[3:]
    sync = torch.cuda.synchronize
    src = torch.randn(shape, device="cuda:0").to(dtype)
    same = torch.zeros(dst_shape, dtype=dtype, device="cuda:0")
    out.append(_measure("cuda-ipc", src, same, sync, "device copy cuda:0", scattered, repeats,
                        "one GPU: device copy"))
    if torch.cuda.device_count() > 1:
        peer_ok = torch.cuda.can_device_access_peer(0, 1)
        other = torch.zeros(dst_shape, dtype=dtype, device="cuda:1")
        note = "cuda:0 -> cuda:1 peer copy" if peer_ok else \
            "cuda:0 -> cuda:1 has NO peer access: the copy is staged through host memory by the driver; use host"
        out.append(_measure("cuda-ipc (peer)", src, other, sync, "device copy cuda:0", scattered, repeats, note))
    out.append(_probe_host(src, dst_shape, dtype, scattered, repeats))
    return out


def _probe_host(src: torch.Tensor, dst_shape: tuple[int, ...], dtype: torch.dtype, scattered: bool,
                repeats: int) -> ProbeResult:
    mirror = shm.create(dst_shape, dtype, tag="probe-host")
    try:
        try:
            pin(mirror.tensor)
            note = "D2H into pinned shared memory, then H2D"
        except RuntimeError as e:
            note = f"FALLBACK: pageable memory, slower ({e})"
        dst = torch.zeros(dst_shape, dtype=dtype, device=src.device)
        n = src.shape[2]
        blocks = [2 * i for i in range(n)] if scattered else list(range(n))

        def handover() -> None:
            copy_blocks(src, list(range(n)), mirror.tensor, blocks, non_blocking=True)
            torch.cuda.synchronize()
            copy_blocks(mirror.tensor, blocks, dst, blocks, non_blocking=True)

        r = _measure("host", src, dst, torch.cuda.synchronize, "device copy cuda:0", scattered, repeats, note)
        t = best_of(handover, torch.cuda.synchronize, repeats)
        r.handover_gbps = r.bytes / t / 1e9
        return r
    finally:
        mirror.unlink()


def probe_all(shape: tuple[int, ...], repeats: int = 20, scattered: bool = False) -> list[ProbeResult]:
    return [probe_shm(shape, repeats, scattered)] + probe_cuda(shape, repeats, scattered) + \
        [probe_nixl(shape, repeats, scattered)]
