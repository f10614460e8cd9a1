"""Block manager: reference counts, the prefix cache's hash chain, LRU eviction."""

from pdlab.engine.blocks import BlockManager, block_key, prefix_keys
from pdlab.engine.config import SamplingParams
from pdlab.engine.sequence import Sequence


def seq(tokens, name="s"):
    return Sequence(name, list(tokens), SamplingParams())


def computed(bm, s, n):
    bm.allocate(s, n)
    s.num_computed = n
    bm.register_full_blocks(s)


def test_keys_chain_over_the_whole_prefix():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert a[0] == block_key(None, [1, 2, 3, 4])
    assert prefix_keys([1, 2, 3], 4) == []  # partial blocks have no key


def test_allocate_and_release_return_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.blocks_needed(s, 10) == 3
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_used == 3
    bm.allocate(s, 12)
    assert len(s.block_table) == 3  # still fits
    bm.release(s)
    bm.check_idle()


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(8, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    computed(bm, a, 9)
    hits = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], 9)
    assert hits == a.block_table[:2]
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], "b")
    bm.take_prefix(b, hits)
    assert bm.ref[hits[0]] == 2
    bm.release(a)
    assert bm.ref[hits[0]] == 1
    bm.release(b)
    bm.check_idle()


def test_freed_cached_blocks_survive_until_evicted_lru_first():
    bm = BlockManager(4, 2)
    a, b = seq([1, 2, 3, 4], "a"), seq([5, 6, 7, 8], "b")
    computed(bm, a, 4)
    computed(bm, b, 4)
    a_blocks = list(a.block_table)
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 4 and len(bm.cached) == 4
    c = seq([9, 9], "c")
    bm.allocate(c, 2)  # evicts the least recently freed block: a's tail (tails are freed first)
    assert c.block_table == [a_blocks[1]]
    assert bm.match_prefix([1, 2, 3, 4], 4) == a_blocks[:1]
    assert len(bm.match_prefix([5, 6, 7, 8], 4)) == 2  # b untouched
    bm.release(c)
    bm.check_idle()


def test_match_respects_token_cap_and_caching_switch():
    bm = BlockManager(8, 4)
    a = seq(range(8), "a")
    computed(bm, a, 8)
    assert len(bm.match_prefix(list(range(8)), 7)) == 1  # the last token must be computed
    off = BlockManager(8, 4, prefix_caching=False)
    b = seq(range(8), "b")
    computed(off, b, 8)
    assert off.match_prefix(list(range(8)), 8) == []
    off.release(b)
    assert off.cached == {} and len(off.free) == 8


def test_duplicate_content_keeps_first_block_cached():
    bm = BlockManager(8, 4)
    a, b = seq([1, 2, 3, 4], "a"), seq([1, 2, 3, 4], "b")
    computed(bm, a, 4)
    computed(bm, b, 4)  # computed twice concurrently: only a's block is cached
    assert bm.cached[a.block_hashes[0]] == a.block_table[0]
    bm.release(b)
    assert len(bm.free) == 7  # b's duplicate went straight back to the free list
    bm.release(a)
    bm.check_idle()


def test_reset_prefix_cache_forgets_unreferenced_blocks():
    bm = BlockManager(4, 2)
    a = seq([1, 2], "a")
    computed(bm, a, 2)
    bm.release(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix([1, 2, 3], 2) == [] and len(bm.free) == 4


def test_growth_takes_the_next_block_and_new_runs_leave_room():
    bm = BlockManager(64, 4)
    a, b = seq(range(8), "a"), seq(range(100, 108), "b")
    bm.allocate(a, 8)  # a may grow to 8 + 16 (max_tokens) tokens: 6 blocks of headroom
    bm.allocate(b, 8)
    assert a.block_table == [0, 1] and b.block_table[0] > 1 + 4 - 1  # b starts after a's headroom
    bm.allocate(a, 12)
    assert a.block_table == [0, 1, 2] and a.contiguous
    full = BlockManager(4, 4)
    c, d = seq(range(4), "c"), seq(range(4), "d")
    full.allocate(c, 4)
    full.allocate(d, 4)
    full.allocate(c, 8)  # c's next block (1) belongs to d: it takes another, and is no longer one run
    assert not c.contiguous and full.num_free == 1


def test_contiguous_growth_never_evicts_a_cached_block_while_others_are_free():
    bm = BlockManager(8, 2)
    y, x = seq([5, 6, 7], "y"), seq([1, 2], "x")
    bm.allocate(y, 2)  # block 0
    computed(bm, x, 2)  # block 1, cached
    bm.release(x)  # block 1: unreferenced, still cached
    assert y.block_table == [0] and bm.match_prefix([1, 2, 3], 2) == [1]
    bm.allocate(y, 4)  # y's next block would be 1: it takes a free one instead
    assert y.block_table == [0, 2] and bm.match_prefix([1, 2, 3], 2) == [1]
