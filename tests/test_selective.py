"""Selective disaggregation: `route.remote_prefill_min_tokens` sends a request to a prefill worker only when
the part of its prompt that its decode worker does not hold in its prefix cache is at least that long; the
others are prefilled by the decode worker. The router knows what a decode worker holds from the cache
events it reports. Every route gives the very tokens a single engine gives."""


import pytest

import engine_helpers as eh
from pdlab.engine.blocks import BlockManager, prefix_keys
from pdlab.engine.config import EngineConfig, SamplingParams
from pdlab.engine.sequence import Sequence
from pdlab.recipe import Deployment, ModelSpec
from pdlab.serve.cluster import Cluster
from pdlab.serve.mirror import PrefixMirror
from test_cluster import _drain

BS = 8
ENGINE = {"block_size": BS, "kv_blocks": 64, "token_budget": 256, "max_running": 16, "prefix_caching": True}
MIN_TOKENS = 24
PREFIX = eh.prompts([40], seed=11)[0]  # five blocks
ROUND1 = {"long": PREFIX + eh.prompts([9], seed=12)[0],  # 49 tokens, nothing cached: remote
          "short": eh.prompts([15], seed=13)[0]}  # 15 < 24: local
ROUND2 = {"cached": PREFIX + eh.prompts([6], seed=14)[0],  # 46 tokens, 40 held by the decode worker: local
          "new-long": eh.prompts([30], seed=15)[0]}  # 30 uncached: remote
ROUTES = {"long": "remote", "short": "local", "cached": "local", "new-long": "remote"}
MAX_TOKENS = 7


def test_block_manager_reports_what_it_caches_and_drops():
    bm = BlockManager(4, BS, prefix_caching=True)
    bm.events = []
    seq = Sequence("a", list(range(100, 124)), SamplingParams())  # three full blocks
    bm.allocate(seq, 24)
    seq.num_computed = 24
    bm.register_full_blocks(seq)
    keys = prefix_keys(seq.prompt_ids, BS)
    assert bm.events == [(True, k) for k in keys]
    bm.release(seq)  # released blocks stay cached (evictable): nothing dropped yet
    assert len(bm.events) == 3
    other = Sequence("b", list(range(500, 532)), SamplingParams())
    bm.allocate(other, 32)  # needs all four blocks: three cached ones are evicted
    assert sorted(k for add, k in bm.events[3:] if not add) == sorted(keys)


def test_mirror_counts_the_held_prefix_and_always_leaves_the_last_token():
    m = PrefixMirror()
    prompt = list(range(10, 10 + 4 * BS))  # exactly four blocks
    keys = prefix_keys(prompt, BS)
    assert m.cached_tokens(prompt, BS) == 0
    m.apply(keys, [])
    assert m.cached_tokens(prompt, BS) == 3 * BS  # the last token is always computed: three blocks count
    assert m.cached_tokens(prompt + [1], BS) == 4 * BS
    m.apply([], keys[1:2])  # a hole in the chain ends the match
    assert m.cached_tokens(prompt + [1], BS) == BS
    assert m.cached_tokens([5] + prompt[1:] + [1], BS) == 0  # another first block: another chain


def test_the_local_prefill_goes_to_the_decode_worker_that_holds_the_prefix():
    """Of two decode workers, the one whose prefix cache holds the prompt prefills it locally, though the
    other has more room; one without room for the rest of the prompt is passed over."""
    from pdlab.serve.router import Router, WorkerState

    states = [WorkerState("prefill0", "prefill", ["cpu:0"]), WorkerState("decode0", "decode", ["cpu:1"]),
              WorkerState("decode1", "decode", ["cpu:1"])]
    for w in states:
        w.block_size, w.kv_blocks = BS, 64
    states[1].free_blocks, states[2].free_blocks = 20, 60  # decode1 has more room
    states[1].cache.apply(prefix_keys(PREFIX, BS), [])  # decode0 holds the 40-token prefix
    router = Router(None, states, mode="pull", first_token="decode", transfer_timeout_s=1, heartbeat_timeout_s=1,
                    step_timeout_s=1, remote_prefill_min_tokens=MIN_TOKENS)
    sent: list = []
    router.send = lambda worker, msg: sent.append((worker, type(msg).__name__))
    router.submit("cached", ROUND2["cached"], {"max_tokens": 2})
    assert sent[-1] == ("decode0", "Submit") and router.reqs["cached"].route == "local"
    router.submit("short", ROUND1["short"], {"max_tokens": 2})  # nothing cached anywhere: the most room
    assert sent[-1] == ("decode1", "Submit")
    states[1].free_blocks = 0  # decode0 full: its prefix does not help, decode1 computes the whole prompt
    router.submit("again", PREFIX + eh.prompts([5], seed=3)[0], {"max_tokens": 2})
    assert sent[-1][0] == "prefill0" and router.reqs["again"].route == "remote"  # 45 uncached >= 24


@pytest.fixture(scope="module")
def reference():
    out = {}
    for rid, p in {**ROUND1, **ROUND2}.items():
        got, _ = eh.run(eh.engine("tiny-llama", prefix_caching=False, kv_blocks=64, block_size=BS), [p],
                        max_tokens=MAX_TOKENS)
        out[rid] = got["0"]
    return out


def _serve(c, reqs):
    for rid, p in reqs.items():
        c.submit(rid, p, {"max_tokens": MAX_TOKENS, "ignore_eos": True})
    done, tokens, _ = _drain(c, list(reqs))
    return done, tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode,first_token", [("pull", "decode"), ("push", "prefill")])
def test_selective_routes_by_uncached_prompt_and_matches_a_single_engine(mode, first_token, reference):
    dep = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": mode,
           "first_token": first_token, "route": {"remote_prefill_min_tokens": MIN_TOKENS}}
    c = Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"), EngineConfig.from_raw(ENGINE, "engine"),
                Deployment.from_raw(dep, "deployment"))
    try:
        c.start()
        done, tokens = _serve(c, ROUND1)
        d2, t2 = _serve(c, ROUND2)  # after round 1 the decode worker holds PREFIX (handed over with "long")
        done.update(d2), tokens.update(t2)
        stats = c.kv_stats()
    finally:
        c.stop()
    for rid, d in done.items():
        assert d.ok, d.error
        assert d.route == ROUTES[rid], (rid, d.route)
        assert d.output_ids == reference[rid], rid
        assert [e.token_id for e in tokens[rid]] == reference[rid]
        assert [e.index for e in tokens[rid]] == list(range(MAX_TOKENS))
        assert d.decode_worker == "decode0"
        if d.route == "local":
            assert d.prefill_worker == "decode0" and {e.worker for e in tokens[rid]} == {"decode0"}
            assert d.phases["prefill_start"] <= d.phases["prefill_end"]
        else:
            assert d.prefill_worker == "prefill0"
    assert done["cached"].cached_tokens == len(PREFIX)  # the decode worker reused the prefix it held
    for name, s in stats.items():
        assert s.free_blocks == s.total_blocks and s.requests == 0 and not s.leak, (name, s)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_remote_hand_over_goes_where_the_prefix_is_cached(mode):
    """Without selective routing too, a long prompt's KV goes to the decode worker that already holds its
    prefix (fewer blocks to move), unless that worker has no room for the rest."""
    from pdlab.serve.router import Router, WorkerState

    states = [WorkerState("prefill0", "prefill", ["cpu:0"]), WorkerState("decode0", "decode", ["cpu:1"]),
              WorkerState("decode1", "decode", ["cpu:1"])]
    for w in states:
        w.block_size, w.kv_blocks = BS, 64
    states[1].free_blocks, states[2].free_blocks = 20, 60
    states[1].cache.apply(prefix_keys(PREFIX, BS), [])  # decode0 holds the 40-token prefix
    router = Router(None, states, mode=mode, first_token="decode", transfer_timeout_s=1, heartbeat_timeout_s=1,
                    step_timeout_s=1)
    sent: list = []
    router.send = lambda worker, msg: sent.append((worker, type(msg).__name__))
    long = PREFIX + eh.prompts([60], seed=4)[0]
    want = "Reserve"
    router.submit("long", long, {"max_tokens": 2})
    if mode == "pull":  # the decode worker is chosen when the prefill is done: ask the choice itself
        assert router.decode_for(router.reqs["long"]).worker.name == "decode0"
    else:
        assert sent[-1] == ("decode0", want)
    states[1].free_blocks = 2  # decode0 has no room for the 60 uncached tokens: decode1
    router.submit("long2", PREFIX + eh.prompts([60], seed=5)[0], {"max_tokens": 2})
    if mode == "pull":
        assert router.decode_for(router.reqs["long2"]).worker.name == "decode1"
    else:
        assert sent[-1] == ("decode1", want)
