"""Scheduler decisions, without a model: budget, chunks, admission order, preemption."""

from pdlab.engine.blocks import BlockManager
from pdlab.engine.config import EngineConfig, SamplingParams
from pdlab.engine.scheduler import Scheduler
from pdlab.engine.sequence import Sequence


def make(num_blocks=64, block_size=4, **cfg):
    config = EngineConfig(block_size=block_size, kv_blocks=num_blocks, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.prefix_caching))


_next = [100]


def add(s, name, n, base=None):
    """A request of n tokens, distinct from every other request unless `base` is given."""
    if base is None:
        base, _next[0] = _next[0], _next[0] + n
    seq = Sequence(name, list(range(base, base + n)), SamplingParams())
    s.add(seq)
    return seq


def advance(s, batch, token=7):
    """What the engine does after a step: count computed tokens, sample where a request completes."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed += n
        s.blocks.register_full_blocks(seq)
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(token)


def test_whole_prompts_until_the_budget_is_spent():
    s = make(token_budget=20)
    a, b, c = add(s, "a", 8), add(s, "b", 10), add(s, "c", 5)
    batch = s.schedule()
    assert [x.req_id for x in batch.seqs] == ["a", "b"] and batch.num_tokens == [8, 10]
    advance(s, batch)
    batch = s.schedule()  # decodes first, then the waiting prompt
    assert [x.req_id for x in batch.seqs] == ["a", "b", "c"] and batch.num_tokens == [1, 1, 5]


def prefill_pieces(s, seq):
    """The token counts `seq`'s prompt is scheduled in, step by step."""
    sizes = []
    while seq.num_computed < seq.prompt_len:
        batch = s.schedule()
        sizes.append(batch.num_tokens[0])
        advance(s, batch)
    return sizes


def test_chunked_prefill_splits_by_chunk_and_budget():
    s = make(token_budget=10, chunked_prefill=True, long_prefill_token_threshold=6)
    assert prefill_pieces(s, add(s, "a", 15)) == [6, 6, 3]


def test_without_a_cap_chunks_fill_what_the_budget_leaves():
    """vLLM's default: no per-request cap (long_prefill_token_threshold 0), the step budget bounds the chunk."""
    s = make(token_budget=10, chunked_prefill=True)
    assert prefill_pieces(s, add(s, "a", 25)) == [10, 10, 5]


def test_no_step_prefills_more_than_the_budget_less_its_decodes():
    """The bound that makes chunked prefill bound the ITL spike: under load a step packs chunks of several
    waiting prompts, but never more prefill tokens than the budget leaves after the decodes."""
    for cap in (0, 4, 7):
        s = make(num_blocks=256, token_budget=12, chunked_prefill=True, long_prefill_token_threshold=cap,
                 max_running=16)
        for i in range(6):
            add(s, f"r{i}", 9 + 5 * i)
        steps = 0
        while s.has_work() and steps < 200:
            batch = s.schedule()
            decodes = sum(batch.decode)
            prefill = sum(n for n, d in zip(batch.num_tokens, batch.decode) if not d)
            assert prefill <= 12 - decodes, (cap, batch.num_tokens, batch.decode)
            if cap:
                assert all(n <= cap for n, d in zip(batch.num_tokens, batch.decode) if not d)
            advance(s, batch)
            for seq in [x for x in batch.seqs if len(x.output_ids) >= 3]:
                s.finish(seq)
                s.blocks.release(seq)
            steps += 1
        assert steps > 10 and not s.has_work()


def test_decode_rides_along_with_a_chunk():
    s = make(token_budget=8, chunked_prefill=True, long_prefill_token_threshold=8)
    a = add(s, "a", 4)
    advance(s, s.schedule())
    add(s, "b", 20)
    batch = s.schedule()
    assert batch.num_tokens == [1, 7]  # a's decode token, then 7 of b's prompt


def test_unchunked_prompt_waits_for_a_step_with_room():
    s = make(token_budget=12)
    add(s, "a", 4)
    advance(s, s.schedule())
    add(s, "b", 12)
    batch = s.schedule()  # a's decode leaves 11 < 12: b waits
    assert [x.req_id for x in batch.seqs] == ["a"]


def test_prompt_longer_than_the_budget_runs_in_pieces():
    s = make(token_budget=8)
    assert prefill_pieces(s, add(s, "a", 20)) == [8, 8, 4]


def test_max_running_holds_back_admission():
    s = make(max_running=2)
    for name in "abc":
        add(s, name, 3)
    batch = s.schedule()
    assert len(batch.seqs) == 2 and len(s.waiting) == 1


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4, token_budget=64)
    a, b = add(s, "a", 8), add(s, "b", 7)
    advance(s, s.schedule())  # a: 2 blocks, b: 2 blocks, pool full
    add(s, "c", 3)
    batch = s.schedule()  # a needs a third block for its decode token: b is preempted
    assert [x.req_id for x in batch.preempted] == ["b"]
    assert [x.req_id for x in batch.seqs] == ["a"]
    assert [x.req_id for x in s.waiting] == ["b", "c"]
    assert b.num_computed == 0 and b.block_table == [] and b.preemptions == 1


def test_request_larger_than_the_pool_fails_instead_of_waiting_forever():
    s = make(num_blocks=2, block_size=4)
    a = add(s, "a", 7)
    advance(s, s.schedule())
    a.output_ids.extend([1, 1])  # grew to 10 tokens: needs 3 blocks, the pool has 2
    a.num_computed = a.num_tokens - 1
    batch = s.schedule()
    assert batch.failed == [a] and not s.running and not s.waiting
    s.blocks.check_idle()


def test_prefix_hit_is_counted_and_skipped():
    s = make(token_budget=64)
    add(s, "a", 12, base=0)
    advance(s, s.schedule())
    b = add(s, "b", 14, base=0)  # same first 12 tokens
    batch = s.schedule()
    assert batch.num_tokens[-1] == 2 and b.num_cached == 12


def test_admitted_requests_run_past_a_head_that_needs_more_blocks_than_are_free():
    """Decode role: requests admitted after a hand-over wait holding their KV blocks. A preempted request at the
    head of the queue needing a full recompute must not stop them: they need a block at most."""
    s = make(num_blocks=6, block_size=4, token_budget=64)
    head = add(s, "head", 12)  # needs 3 blocks: only 2 will be free
    held = []
    for i in range(2):
        seq = Sequence(f"held{i}", list(range(200 + 10 * i, 205 + 10 * i)), SamplingParams())  # 5 tokens
        s.blocks.allocate(seq, 5)
        seq.num_computed = 5
        seq.output_ids.append(7)  # admitted with its first token: decodes next
        s.add(seq)
        held.append(seq)
    assert s.blocks.num_free == 2 and list(s.waiting)[0] is head
    batch = s.schedule()
    assert [x.req_id for x in batch.seqs] == ["held0", "held1"] and batch.decode == [True, True]
    assert list(s.waiting) == [head]
