"""KV hand-over between tensor-parallel groups of different sizes: every head of every destination shard
comes from the source shard holding it, for 1->2, 2->1, 2->4, 4->2 and replicated heads (tp > kv_heads)."""

import pytest
import torch

from pdlab.kv.sharded import ShardedPool, copy_sharded, plan, shard_heads
from pdlab.kv.copy import copy_blocks

L, B, BS, H, D = 2, 8, 4, 4, 3


def shards(full: torch.Tensor, tp: int) -> ShardedPool:
    return ShardedPool([full[..., shard_heads(H, tp, r).start:shard_heads(H, tp, r).stop, :].clone()
                        for r in range(tp)], H)


def test_which_heads_a_rank_holds():
    assert [list(shard_heads(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(shard_heads(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated, as vLLM
    assert plan(shards(torch.zeros(L, 2, B, BS, H, D), 2), shards(torch.zeros(L, 2, B, BS, H, D), 1)) == \
        [(0, 0, slice(0, 2), slice(0, 2)), (1, 0, slice(0, 2), slice(2, 4))]


@pytest.mark.parametrize("a,b", [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 8), (8, 2)])
@pytest.mark.parametrize("layer", [None, 1])
def test_copy_between_groups_reslices_heads(a, b, layer):
    src_full = torch.randn(L, 2, B, BS, H, D)
    src, dst = shards(src_full, a), shards(torch.zeros(L, 2, B, BS, H, D), b)
    n = copy_sharded(src, [1, 2, 5], dst, [0, 3, 4], copy_blocks, layer=layer)
    layers = range(L) if layer is None else [layer]
    for r, shard in enumerate(dst.shards):
        h = shard_heads(H, b, r)
        want = torch.zeros_like(shard)
        for li in layers:
            want[li, :, [0, 3, 4]] = src_full[li, :, [1, 2, 5]][..., h.start:h.stop, :]
        assert torch.equal(shard, want), (a, b, r)
    per_head = len(layers) * 2 * 3 * BS * D * 4
    assert n == per_head * sum(len(shard_heads(H, b, r)) for r in range(b))


def test_pools_of_different_models_are_refused():
    with pytest.raises(ValueError, match="different models: 4 vs 2 KV heads"):
        plan(ShardedPool([torch.zeros(1)], 4), ShardedPool([torch.zeros(1)], 2))
