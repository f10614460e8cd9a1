"""A modelled timing (model.timing): it parses like every other section (inline, a profile file, a shipped
profile), and an engine given one does not run the model: each step takes at least its modelled time,
tokens are deterministic (and agree across a hand-over only when it moved the KV: tests/test_timed_kv.py),
the pool is sized as the modelled device's, and KV hand-overs take at least the modelled transfer time."""

import math
import time

import pytest
import torch
import yaml

from engine_helpers import model, prompts, run
from pdlab.engine import Engine, EngineConfig
from pdlab.engine.model import load_stand_in
from pdlab.engine.timed import step_counts, wait_until
from pdlab.kv.modelled import modelled_copy
from pdlab.recipe import (ModelSpec, RecipeError, StepTiming, TimingProfile, TransferTiming, dump_recipe,
                          load_profile, parse_recipe)
from pdlab.serve.spec import WorkerSpec

def model_err(timing) -> str:
    with pytest.raises(RecipeError) as e:
        ModelSpec.from_raw({"preset": "tiny-llama", "timing": timing}, "model")
    msg = str(e.value)
    assert "\n" not in msg, "errors are one line"
    return msg


def inline(**terms) -> TimingProfile:
    return TimingProfile(step=StepTiming(**terms))


# ---- the section ----

def test_step_terms_and_defaults():
    t = StepTiming.from_raw({"fixed_ms": 5, "prefill_token_ms": 0.5}, "model.timing")
    assert t == StepTiming(fixed_ms=5.0, prefill_token_ms=0.5)
    assert t.step_s(40, 0, 0) == pytest.approx(0.025)
    full = StepTiming(fixed_ms=1, decode_seq_ms=2, context_token_ms=0.01, prefill_attention_ms=0.5)
    assert full.step_s(3, 4, 100, 2000) == pytest.approx((1 + 8 + 1 + 0.5 * 2) / 1000)


def test_model_timing_is_optional_and_inline_terms_are_a_profile():
    m = ModelSpec.from_raw({"preset": "tiny-llama"}, "model")
    assert m.timing is None and not m.modelled
    assert ModelSpec.from_raw({"preset": "tiny-llama", "timing": None}, "model").timing is None
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"decode_seq_ms": 1}}, "model")
    assert m.timing == inline(decode_seq_ms=1.0) and m.modelled
    assert m.timing.describe() == "modelled timing: inline step model"


@pytest.mark.parametrize("key", ["fixed_ms", "prefill_token_ms", "decode_seq_ms", "context_token_ms"])
@pytest.mark.parametrize("bad", [-1, -0.001, "5", True, math.inf, math.nan, None, [1]])
def test_bad_terms_name_the_key(key, bad):
    msg = model_err({"fixed_ms": 1, key: bad})
    assert msg.startswith(f"model.timing.{key}: expected a number of milliseconds >= 0"), msg
    assert msg.endswith(f"got {bad!r}")


def test_unknown_key_and_bad_shape():
    assert model_err({"fixed": 1}) == "model.timing.fixed: unknown key (did you mean 'fixed_ms'?)"
    assert model_err({"fixed_ms": 1, "zzz": 2}).startswith("model.timing.zzz: unknown key; expected one of fixed_ms,")
    assert model_err(5).startswith("model.timing: expected a profile name or path, or step terms")
    # every term 0 would claim "modelled" for nothing
    assert model_err({}).startswith("model.timing: every term is 0")
    assert model_err({"no-such-profile": 1}).startswith("model.timing.no-such-profile: unknown key")
    assert model_err("no-such-profile").startswith("model.timing: no profile 'no-such-profile'")


def test_round_trips_through_plain_data():
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"fixed_ms": 5, "context_token_ms": 0.002}}, "model")
    raw = m.to_raw()
    assert raw["timing"]["step"]["fixed_ms"] == 5.0 and raw["timing"]["source"] == "inline"
    assert ModelSpec.from_raw(raw, "model") == m
    m.timing.validate("model.timing")  # built in Python: the same rules


def test_worker_spec_carries_the_timing():
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"fixed_ms": 3}}, "model")
    spec = WorkerSpec("unified0", "unified", ("cpu:0",), "ipc://x", m, EngineConfig(), 0, None, "pull", "p",
                      "decode", (), 10.0)
    assert WorkerSpec.from_raw(spec.to_raw()).model.timing == inline(fixed_ms=3.0)


PROFILE = {"name": "test-gpu", "source": "analytic", "device": "a pretend GPU", "date": "2026-11-30",
           "model": "tiny-llama", "step": {"fixed_ms": 4, "prefill_token_ms": 0.01, "decode_seq_ms": 0.1},
           "kv_bytes_per_token": 4096, "kv_memory_gb": 0.01,
           "transfer": {"shm": {"gbps": 2.0, "latency_ms": 1.0}}, "fit": {"mape": 0.05}}


def test_a_profile_file_and_its_errors(tmp_path):
    p = tmp_path / "gpu.yaml"
    p.write_text(yaml.safe_dump(PROFILE))
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": str(p)}, "model")
    t = m.timing
    assert (t.name, t.source, t.kv_memory_gb, t.step.fixed_ms) == ("test-gpu", "analytic", 0.01, 4.0)
    assert t.transfer_of("shm") == TransferTiming(gbps=2.0, latency_ms=1.0) and t.transfer_of("host") is None
    assert t.describe() == "modelled timing: profile test-gpu (analytic, a pretend GPU, 2026-11-30)"
    assert ModelSpec.from_raw(m.to_raw(), "model") == m  # recipe.yaml carries the whole profile
    bad = dict(PROFILE, step={"fixed_ms": 1}, transfer={"carrier-pigeon": {"gbps": 1}})
    p.write_text(yaml.safe_dump(bad))
    assert model_err(str(p)) .startswith(f"model.timing ({p}).transfer.carrier-pigeon: unknown transport")
    p.write_text(yaml.safe_dump({k: v for k, v in PROFILE.items() if k != "step"}))
    assert model_err(str(p)) == f"model.timing ({p}).step: missing; expected the step-time terms"


def test_shipped_profiles_load():
    from pdlab.recipe.timing import shipped_profiles

    for name in shipped_profiles():
        t = load_profile(name)
        assert t.source in ("measured", "analytic") and t.kv_bytes_per_token and t.step.fixed_ms >= 0


# ---- in a recipe ----

RECIPE = {
    "model": {"preset": "tiny-llama", "timing": {"fixed_ms": 2}},
    "rates": [1],
    "deployment": {"unified": {"devices": ["cpu:0"]}},
}


def test_recipe_resolves_a_modelled_variant():
    v = parse_recipe(RECIPE).resolved("default")
    assert v.model.timing.step.fixed_ms == 2.0 and v.model.modelled
    again = parse_recipe(yaml.safe_load(dump_recipe(parse_recipe(RECIPE))))
    assert again.resolved("default").model == v.model


def test_variants_merge_and_drop_the_timing():
    raw = dict(RECIPE, variants={"more": {"model": {"timing": {"decode_seq_ms": 1}}},
                                 "real": {"model": {"timing": None}},
                                 "other": {"model": {"preset": "tiny-qwen3"}}})
    r = parse_recipe(raw)
    assert r.resolved("more").model.timing == inline(fixed_ms=2.0, decode_seq_ms=1.0)
    assert r.resolved("real").model.timing is None and not r.resolved("real").model.modelled
    assert r.resolved("other").model.timing == inline(fixed_ms=2.0)  # another model keeps the timing
    assert parse_recipe(RECIPE, sets=["model.timing.fixed_ms=3"]).resolved("default").model.timing.step.fixed_ms == 3
    with pytest.raises(RecipeError, match=r"^variants\.default\.model\.timing\.fixed_ms: expected"):
        parse_recipe(RECIPE, sets=["model.timing.fixed_ms=-3"])


# ---- in the engine ----

TIMING = inline(fixed_ms=5, prefill_token_ms=0.5, decode_seq_ms=1)


def cfg(**kw) -> EngineConfig:
    return EngineConfig(block_size=16, kv_blocks=64, **kw)


def stand_in():
    return load_stand_in("tiny-llama")


def test_a_timed_engine_runs_no_model_and_keeps_its_modelled_time():
    """Every step lasts at least its modelled time (how much later a loaded box wakes it is not a property
    of the engine: benchmarks/bench_harness_timing.py measures that overshoot)."""
    eng = Engine(stand_in(), cfg(), step_timing=TIMING)
    outs, records = run(eng, prompts([40, 40], seed=11), max_tokens=8)
    eng.check_idle()
    want = [TIMING.step_s(r.prefill_tokens, r.decode_seqs, 0) for r in records]
    took = [r.end - r.start for r in records]
    assert all(t >= w for t, w in zip(took, want)), (took, want)  # never before the model
    assert [r.prefill_tokens for r in records[:1]] == [80] and want[0] == pytest.approx(0.045)
    assert all(r.decode_seqs == 2 for r in records[1:]) and len(records) == 8
    assert all(len(v) == 8 and all(10 <= t < 512 for t in v) for v in outs.values())
    again, _ = run(Engine(stand_in(), cfg(), step_timing=TIMING), prompts([40, 40], seed=11), max_tokens=8)
    assert again == outs  # deterministic


def test_layer_hooks_fire_as_the_modelled_step_progresses():
    eng = Engine(stand_in(), cfg(), step_timing=inline(fixed_ms=20))
    seen = []
    eng.layer_hook = lambda layer: seen.append((layer, time.monotonic()))
    eng.add("a", prompts([10], seed=1)[0])
    rec = eng.step().record
    assert [layer for layer, _ in seen] == [0, 1]  # tiny-llama has 2 layers
    assert seen[0][1] - rec.start >= 0.010 and seen[1][1] - rec.start >= 0.020  # at 1/2 and 2/2 of the step


def test_the_pool_is_sized_as_the_modelled_device_and_holds_no_real_kv():
    t = TimingProfile(step=StepTiming(fixed_ms=1), kv_memory_gb=0.001)
    eng = Engine(stand_in(), EngineConfig(block_size=16, kv_blocks="auto", kv_memory_fraction=1.0), step_timing=t)
    # tiny-llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes = 512 bytes a token, 8 KiB a block
    assert eng.block_bytes == 8192 and eng.blocks.num_blocks == 1_000_000 // 8192
    assert eng.kv.shape[-2:] == (1, 1)


def test_step_counts_are_what_a_step_computes():
    class S:
        def __init__(self, computed):
            self.num_computed = computed

    # a 30-token prefill chunk after 10 computed tokens; two decodes holding 11 and 21 tokens
    trio = [(S(10), 30, False), (S(11), 1, True), (S(21), 1, True)]
    pre, dec, ctx, pairs = step_counts(trio)
    assert (pre, dec, ctx) == (30, 2, 12 + 22)
    assert pairs == 30 * 10 + 30 * 31 // 2  # each new token attends what was computed before it and itself


def test_a_timing_must_have_step_s():
    with pytest.raises(TypeError, match="step_s"):
        Engine(stand_in(), cfg(), step_timing=5)


def test_wait_until_never_returns_early():
    """It returns at or after the deadline (its overshoot on a busy box: benchmarks/bench_harness_timing.py)."""
    for wait in (0.0005, 0.003, 0.012):
        for spin in (0.0, 0.0005):
            deadline = time.monotonic() + wait
            seen = wait_until(deadline, spin_s=spin)
            assert deadline <= seen <= time.monotonic()
    assert wait_until(time.monotonic() - 1) <= time.monotonic()  # past: returns at once


def test_a_modelled_hand_over_takes_the_modelled_time():
    src, dst = torch.zeros(2, 2, 8, 16, 1, 1), torch.zeros(2, 2, 8, 16, 1, 1)
    src[:, :, 1] = 7
    copy = modelled_copy(block_bytes=1_000_000, layers=2, timing=TransferTiming(gbps=1.0, latency_ms=2.0))
    t0 = time.monotonic()
    n = copy(src, [1, 2], dst, [3, 4])
    took = time.monotonic() - t0
    assert n == 2_000_000 and took >= 0.002 + 0.002  # 2 ms latency + 2 MB at 1 GB/s
    assert (dst[:, :, 3] == 7).all()  # the tiny pools are still copied: bookkeeping stays honest
    t0 = time.monotonic()
    assert copy(src, [1, 2], dst, [3, 4], layer=0) == 1_000_000 and time.monotonic() - t0 >= 0.002  # half
    assert modelled_copy(1000, 2, None)(src, [1], dst, [2]) == 1000  # no figures: no wait
