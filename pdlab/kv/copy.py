"""Copying KV blocks between pools: the one primitive every transport and the simulator build on.

A pool is a tensor [layers, 2, blocks, block_size, kv_heads, head_dim]; a copy moves blocks (all layers or
one) from one pool to another, on one device or across (D2H / H2D / peer), in runs contiguous on both sides.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


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
