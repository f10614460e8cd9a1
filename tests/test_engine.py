"""The engine generates exactly what transformers' greedy generate does, whatever the batching."""

import functools

import pytest
import torch

from engine_helpers import engine, hf_greedy, model, prompts, reference, run
from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model
from pdlab.engine.model import load_stand_in
from pdlab.recipe import StepTiming, TimingProfile

MIXED = [5, 17, 40, 33, 64, 1, 90]


@functools.lru_cache(maxsize=None)
def _greedy(preset: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(hf_greedy(reference(preset), list(prompt), n))


def expect(preset: str, reqs: list[list[int]], n: int) -> dict:
    """transformers' greedy tokens, by request index (once per prompt and length: tests share them)."""
    return {str(i): list(_greedy(preset, tuple(p), n)) for i, p in enumerate(reqs)}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_lengths_match_transformers(preset, prefix_caching):
    reqs = prompts(MIXED)
    eng = engine(preset, block_size=16, kv_blocks=128, prefix_caching=prefix_caching)
    outs, records = run(eng, reqs, max_tokens=24)
    assert outs == expect(preset, reqs, 24)
    assert sum(r.prefill_tokens for r in records) == sum(MIXED)  # every prompt token computed once
    assert sum(r.decode_seqs for r in records) == len(MIXED) * 23  # the other 23 tokens each: one decode
    eng.check_idle()


@pytest.mark.parametrize("chunk", [16, 32, 7, 24])  # on and off block boundaries
def test_chunked_prefill_matches(chunk):
    reqs = prompts(MIXED)
    eng = engine(block_size=16, kv_blocks=128, chunked_prefill=True, long_prefill_token_threshold=chunk, token_budget=max(chunk, 40))
    outs, records = run(eng, reqs, max_tokens=16)
    assert outs == expect("tiny-llama", reqs, 16)
    assert max(r.prefill_tokens for r in records) <= max(chunk, 40)
    eng.check_idle()


def test_decode_and_prefill_share_a_step():
    eng = engine(block_size=16, kv_blocks=64, chunked_prefill=True, long_prefill_token_threshold=8, token_budget=16)
    reqs = prompts([4, 60])
    outs, records = run(eng, reqs, max_tokens=12)
    assert outs == expect("tiny-llama", reqs, 12)
    assert any(r.prefill_tokens > 0 and r.decode_seqs > 0 for r in records)


def test_token_budget_bounds_every_step():
    eng = engine(block_size=8, kv_blocks=128, token_budget=48)
    reqs = prompts([30, 30, 30, 30])
    outs, records = run(eng, reqs, max_tokens=8)
    assert outs == expect("tiny-llama", reqs, 8)
    assert all(r.prefill_tokens + r.decode_seqs <= 48 for r in records)


def test_max_running_caps_the_batch():
    eng = engine(block_size=16, kv_blocks=128, max_running=2)
    reqs = prompts([10, 10, 10, 10, 10])
    outs, records = run(eng, reqs, max_tokens=6)
    assert outs == expect("tiny-llama", reqs, 6)
    assert max(r.running for r in records) <= 2


@pytest.mark.parametrize("chunked", [False, True])
def test_preemption_by_recompute_keeps_outputs_exact(chunked):
    # 12 blocks of 4 tokens cannot hold four 20-token prompts growing by 16 tokens each.
    eng = engine(block_size=4, kv_blocks=12, chunked_prefill=chunked, long_prefill_token_threshold=8, token_budget=64)
    reqs = prompts([20, 18, 22, 9])
    outs, records = run(eng, reqs, max_tokens=16)
    assert sum(r.preempted for r in records) > 0, "the tiny pool should force preemption"
    assert outs == expect("tiny-llama", reqs, 16)
    eng.check_idle()


def test_shared_prefix_hits_cache_and_skips_compute():
    prefix = prompts([48], seed=7)[0]
    reqs = prompts([5, 9, 20], seed=3, prefix=prefix)
    ref = expect("tiny-llama", reqs, 10)

    def served(prefix_caching: bool):
        eng = engine(block_size=16, kv_blocks=64, prefix_caching=prefix_caching)
        outs, cached, prefill = {}, {}, 0
        for i, p in enumerate(reqs):  # one after another, so later ones can hit earlier blocks
            eng.add(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
            outs[str(i)] = []
            while eng.has_work():
                step = eng.step()
                prefill += step.record.prefill_tokens if step.record else 0
                for t in step.tokens:
                    outs[t.req_id].append(t.token_id)
                    cached[t.req_id] = t.cached_tokens
        eng.check_idle()
        return outs, cached, prefill

    outs_on, cached_on, prefill_on = served(True)
    outs_off, cached_off, prefill_off = served(False)
    assert outs_on == ref and outs_off == ref
    assert cached_on["0"] == 0 and cached_on["1"] == 48 and cached_on["2"] == 48
    assert set(cached_off.values()) == {0}
    assert prefill_off - prefill_on == 2 * 48


def test_whole_prompt_cached_still_computes_last_token():
    p = prompts([32])[0]  # exactly two blocks
    eng = engine(block_size=16, kv_blocks=16)
    first, _ = run(eng, [p], max_tokens=5)
    eng.add("again", p, SamplingParams(max_tokens=5, ignore_eos=True))
    out, cached = [], 0
    while eng.has_work():
        for t in eng.step().tokens:
            out.append(t.token_id)
            cached = t.cached_tokens
    assert out == first["0"] and cached == 16
    eng.check_idle()


def test_locally_saved_model_directory(tmp_path):
    ref = reference("tiny-llama")
    ref.save_pretrained(tmp_path)
    m = load_model(str(tmp_path))
    reqs = prompts([12, 40])
    outs, _ = run(Engine(m, EngineConfig(kv_blocks=32)), reqs, max_tokens=10)
    assert outs == expect("tiny-llama", reqs, 10)


def test_synthetic_weights_do_not_collapse():
    for preset in ("tiny-llama", "tiny-qwen3"):
        outs, _ = run(engine(preset, kv_blocks=64), prompts([20, 30, 40], seed=11), max_tokens=32)
        for toks in outs.values():
            assert len(set(toks)) >= 4, f"{preset} collapsed into {toks}"


def test_prefill_and_decode_roles_hand_over_kv():
    """Prefill stops after the first token and holds its blocks; decode takes the KV in and continues."""
    reqs = prompts([20, 37, 16])
    want = expect("tiny-llama", reqs, 12)
    pre = engine(role="prefill", block_size=16, kv_blocks=32)
    dec = engine(role="decode", block_size=16, kv_blocks=32)
    for i, p in enumerate(reqs):
        pre.add(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while pre.has_work():
        for t in pre.step().tokens:
            assert t.finished and t.finish_reason == "handoff"
            outs[t.req_id] = [t.token_id]
            h = pre.handoff(t.req_id)
            r = dec.reserve(t.req_id, h.prompt_ids, h.first_token, SamplingParams(max_tokens=12, ignore_eos=True))
            assert r is not None and r.cached_blocks == 0
            for src, dst in zip(h.block_ids, r.block_ids):
                dec.kv[:, :, dst] = pre.kv[:, :, src]
            pre.release(t.req_id)
            dec.admit(t.req_id)
    pre.check_idle()
    while dec.has_work():
        for t in dec.step().tokens:
            outs[t.req_id].append(t.token_id)
    assert outs == want
    dec.check_idle()


def test_decode_reservation_reuses_prefix_it_holds():
    prefix = prompts([32], seed=5)[0]
    a, b = prompts([8, 8], seed=6, prefix=prefix)
    dec = engine(role="decode", block_size=16, kv_blocks=32)
    r = dec.reserve("a", a, 1)
    dec.admit("a")  # pretend the KV arrived
    r2 = dec.reserve("b", b, 1)
    assert r2.cached_blocks == 2 and r2.block_ids[:2] == r.block_ids[:2]
    dec.cancel_reservation("b")
    dec.abort("a")
    dec.check_idle()


def test_decode_reservation_refused_when_full():
    dec = engine(role="decode", block_size=16, kv_blocks=4)
    assert dec.reserve("a", prompts([40])[0], 1) is not None
    assert dec.reserve("b", prompts([40], seed=1)[0], 1) is None
    assert "b" not in dec.seqs


def test_seeded_sampling_is_reproducible():
    p = prompts([20])[0]
    runs = [run(engine(kv_blocks=16), [p], max_tokens=20, temperature=1.0, seed=42)[0]["0"] for _ in range(2)]
    other = run(engine(kv_blocks=16), [p], max_tokens=20, temperature=1.0, seed=43)[0]["0"]
    assert runs[0] == runs[1] and runs[0] != other
    tiny_p = run(engine(kv_blocks=16), [p], max_tokens=12, temperature=1.0, top_p=1e-6, seed=1)[0]["0"]
    assert tiny_p == expect("tiny-llama", [p], 12)["0"]


def test_stops_at_eos_unless_ignored():
    p = prompts([20])[0]
    greedy = expect("tiny-llama", [p], 10)["0"]
    eng = engine(kv_blocks=16)
    eng.eos_ids = {greedy[3]}
    stop_at = greedy.index(greedy[3]) + 1
    eng.add("x", p, SamplingParams(max_tokens=10))
    toks = []
    while eng.has_work():
        for t in eng.step().tokens:
            toks.append(t.token_id)
            last = t
    assert toks == greedy[:stop_at] and last.finish_reason == "stop"
    eng.add("y", p, SamplingParams(max_tokens=10, ignore_eos=True))
    n = 0
    while eng.has_work():
        n += len(eng.step().tokens)
    assert n == 10
    eng.check_idle()


def test_abort_frees_blocks():
    eng = engine(kv_blocks=16)
    eng.add("a", prompts([30])[0], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.blocks.num_used > 0
    assert eng.abort("a") and not eng.abort("a")
    eng.check_idle()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_in_place_decode_attention_matches(preset, monkeypatch):
    """Without the C kernel (pdlab.engine.cpu_kernel), long contexts in contiguous blocks are read in place
    rather than gathered: same tokens."""
    import pdlab.engine.runner as runner

    import pdlab.engine.attention as attention
    from pdlab.constants import CPU_KERNEL_ENV

    monkeypatch.setenv(CPU_KERNEL_ENV, "off")
    monkeypatch.setattr(runner, "VIEW_MIN_CONTEXT", 24)
    in_place = []
    real = attention._attend_in_place
    monkeypatch.setattr(attention, "_attend_in_place",
                        lambda q, out, k, v, views, scaling: (in_place.append(len(views)), real(q, out, k, v, views,
                                                                                                 scaling)))
    reqs = prompts(MIXED)
    eng = engine(preset, block_size=16, kv_blocks=128)
    outs, _ = run(eng, reqs, max_tokens=24)
    assert outs == expect(preset, reqs, 24)
    assert sum(in_place) > 0, "no decode row was read in place: the path under test never ran"
    eng.check_idle()


def test_blocks_of_growing_requests_stay_contiguous():
    eng = engine(block_size=4, kv_blocks=256)
    for i, p in enumerate(prompts([10, 13, 7, 30])):
        eng.add(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True))
    seen = {}
    while eng.has_work():
        eng.step()
        for s in eng.seqs.values():
            seen[s.req_id] = (s.contiguous, len(s.block_table))
    assert all(c for c, _ in seen.values()), seen


def test_a_reservation_leaves_a_block_per_held_request():
    """Decode role: reserved blocks cannot be preempted while their KV is in transit, so a reservation that
    took the last free blocks could leave the running requests no block to grow into."""
    eng = engine(role="decode", block_size=16, kv_blocks=7)
    p = prompts([48, 48], seed=3)  # 3 blocks each
    assert eng.reserve("a", p[0], 5, SamplingParams(max_tokens=4)) is not None  # 4 free after, for 1 request
    assert eng.reserve("b", p[1], 5, SamplingParams(max_tokens=4)) is None  # 1 free after, for 2: no
    assert eng.blocks.num_free == 4
    eng.cancel_reservation("a")
    eng.check_idle()


def test_a_cpu_step_records_its_own_cpu_time_and_a_timed_one_does_not():
    """cpu_s: the stepping thread's CPU time over the step, at most its wall time (what the core gave it, beside
    what other processes took), on one torch thread as a worker on one core runs; with more threads one thread's
    time is not the step's, and a timed engine waits its model out: neither reports it."""
    def records(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            eng = engine(block_size=16, kv_blocks=64)
            eng.add("a", prompts([40], seed=1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
            recs = []
            while eng.has_work():
                recs.append(eng.step().record)
            return recs
        finally:
            torch.set_num_threads(before)

    recs = records(1)
    # a property of each step's own two readings, whatever the box's speed: its CPU time is read within its wall
    # span (the 1 ms is the two clocks' grain, not a bound on how long a step takes)
    assert recs and all(r.cpu_s is not None and 0 < r.cpu_s <= (r.end - r.start) + 1e-3 for r in recs)
    assert all(r.cpu_s is None for r in records(2))
    timed = Engine(load_stand_in("tiny-llama"), EngineConfig(block_size=16, kv_blocks=64),
                   step_timing=TimingProfile(step=StepTiming(fixed_ms=0.1)))
    timed.add("a", prompts([40], seed=1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    assert timed.step().record.cpu_s is None

