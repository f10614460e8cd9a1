"""KV hand-over between tensor-parallel groups of different sizes: re-slicing KV heads in the copy.

A worker with `tp: t` keeps its paged pool as t shards, one per rank, each [layers, 2, blocks, block_size,
local_heads, head_dim] holding a slice of the model's KV heads (pdlab.engine.tensor_parallel): ranks hold
contiguous slices when kv_heads >= t, else one head each, replicated on t / kv_heads ranks. All ranks of a
group share one block table (the scheduler runs on rank 0), so block i of every shard belongs to the same
request. A hand-over from a group of a ranks to one of b ranks copies, for every destination shard, each
of its heads from a source shard that holds it; when a == b and the heads line up, each shard pair is one
ordinary block copy (pdlab.kv.copy.copy_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pdlab.engine.tp_plan import shard_heads
from pdlab.kv.copy import block_runs


@dataclass
class ShardedPool:
    """A group's pool: its shards in rank order and the model's KV head count."""

    shards: list[torch.Tensor]
    kv_heads: int

    @property
    def tp(self) -> int:
        return len(self.shards)

    @property
    def shape(self) -> torch.Size:
        return self.shards[0].shape

    @property
    def device(self) -> torch.device:
        return self.shards[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    def heads(self, rank: int) -> range:
        return shard_heads(self.kv_heads, self.tp, rank)


def as_sharded(pool: object, kv_heads: int) -> ShardedPool:
    return pool if isinstance(pool, ShardedPool) else ShardedPool([pool], kv_heads)  # type: ignore[list-item]


def plan(src: ShardedPool, dst: ShardedPool) -> list[tuple[int, int, slice, slice]]:
    """(src rank, dst rank, src head slice, dst head slice): every head of every destination shard once."""
    if src.kv_heads != dst.kv_heads:
        raise ValueError(f"pools hold different models: {src.kv_heads} vs {dst.kv_heads} KV heads")
    out = []
    for j in range(dst.tp):
        dh = dst.heads(j)
        h = dh.start
        while h < dh.stop:
            i = next(r for r in range(src.tp) if h in src.heads(r))
            sh = src.heads(i)
            hi = min(dh.stop, sh.stop)
            out.append((i, j, slice(h - sh.start, hi - sh.start), slice(h - dh.start, hi - dh.start)))
            h = hi
    return out


def whole(sl: slice, heads: int) -> bool:
    """A head slice that is the whole shard."""
    return sl.start == 0 and sl.stop == heads


def copy_heads(src: torch.Tensor, src_blocks: Sequence[int], sh: slice, dst: torch.Tensor, dst_blocks: Sequence[int],
               dh: slice, layer: int | None = None, non_blocking: bool = False,
               runs: list[tuple[int, int, int]] | None = None) -> int:
    """dst[..., dst_blocks, :, dh, :] = src[..., src_blocks, :, sh, :], all layers or one, between tensors this
    process holds; returns the bytes written. `runs`: block_runs of the two lists, when the caller has them."""
    sa = src if layer is None else src[layer:layer + 1]
    db = dst if layer is None else dst[layer:layer + 1]
    total = 0
    for s0, d0, n in runs if runs is not None else block_runs(src_blocks, dst_blocks):
        part = sa[:, :, s0:s0 + n, :, sh]
        db[:, :, d0:d0 + n, :, dh].copy_(part, non_blocking=non_blocking)
        total += part.numel() * part.element_size()
    return total


def copy_sharded(src: ShardedPool, src_blocks: Sequence[int], dst: ShardedPool, dst_blocks: Sequence[int],
                 inner: Callable[..., int], layer: int | None = None, non_blocking: bool = False) -> int:
    """Copy blocks between two groups' pools, re-slicing heads; returns the bytes written."""
    if not src_blocks:
        return 0
    total = 0
    runs = None
    for i, j, s, d in plan(src, dst):
        a, b = src.shards[i], dst.shards[j]
        if whole(s, a.shape[4]) and whole(d, b.shape[4]):  # whole shards line up: a plain copy
            total += inner(a, src_blocks, b, dst_blocks, layer=layer, non_blocking=non_blocking)
            continue
        runs = runs or block_runs(src_blocks, dst_blocks)
        total += copy_heads(a, src_blocks, s, b, dst_blocks, d, layer, non_blocking, runs)
    return total
