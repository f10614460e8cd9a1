"""A modelled step time (model.timing): the section parses like every other, and an engine given one takes
exactly its modelled time per step (when its real work is shorter) without changing a single token."""

import math
import time

import pytest
import yaml

from engine_helpers import model, prompts, run
from pdlab.engine import Engine, EngineConfig
from pdlab.engine.engine import wait_until
from pdlab.recipe import ModelSpec, RecipeError, StepTiming, dump_recipe, parse_recipe
from pdlab.serve.worker import WorkerSpec

TOL_S = 0.005  # a step ends no earlier than its model and less than this after it (a busy 2-core CI box)


def model_err(timing) -> str:
    with pytest.raises(RecipeError) as e:
        ModelSpec.from_raw({"preset": "tiny-llama", "timing": timing}, "model")
    msg = str(e.value)
    assert "\n" not in msg, "errors are one line"
    return msg


# ---- the section ----

def test_timing_parses_with_defaults():
    t = StepTiming.from_raw({"fixed_ms": 5, "prefill_token_ms": 0.5}, "model.timing")
    assert t == StepTiming(fixed_ms=5.0, prefill_token_ms=0.5, decode_seq_ms=0.0, context_token_ms=0.0)
    assert isinstance(t.fixed_ms, float)
    assert t.step_s(40, 0, 0) == pytest.approx(0.025)
    assert StepTiming(fixed_ms=1, decode_seq_ms=2, context_token_ms=0.01).step_s(3, 4, 100) == pytest.approx(0.010)


def test_model_timing_is_optional():
    m = ModelSpec.from_raw({"preset": "tiny-llama"}, "model")
    assert m.timing is None and not m.modelled
    assert ModelSpec.from_raw({"preset": "tiny-llama", "timing": None}, "model").timing is None
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"decode_seq_ms": 1}}, "model")
    assert m.timing == StepTiming(decode_seq_ms=1.0) and m.modelled


@pytest.mark.parametrize("key", ["fixed_ms", "prefill_token_ms", "decode_seq_ms", "context_token_ms"])
@pytest.mark.parametrize("bad", [-1, -0.001, "5", True, math.inf, math.nan, None, [1]])
def test_bad_terms_name_the_key(key, bad):
    msg = model_err({"fixed_ms": 1, key: bad})
    assert msg.startswith(f"model.timing.{key}: expected a number of milliseconds >= 0"), msg
    assert msg.endswith(f"got {bad!r}")


def test_unknown_key_and_bad_shape():
    assert model_err({"fixed": 1}) == "model.timing.fixed: unknown key (did you mean 'fixed_ms'?)"
    assert model_err({"fixed_ms": 1, "zzz": 2}).startswith("model.timing.zzz: unknown key; expected one of fixed_ms,")
    assert model_err(5).startswith("model.timing: expected a mapping with keys fixed_ms, prefill_token_ms,")
    # every term 0 would claim "modelled" for real step times
    assert model_err({}).startswith("model.timing: every term is 0")
    assert model_err({"fixed_ms": 0, "decode_seq_ms": 0}).startswith("model.timing: every term is 0")


def test_round_trips_through_plain_data():
    t = StepTiming(fixed_ms=5.0, prefill_token_ms=0.5, decode_seq_ms=1.0, context_token_ms=0.002)
    assert StepTiming.from_raw(t.to_raw(), "model.timing") == t
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": t.to_raw()}, "model")
    raw = m.to_raw()
    assert raw["timing"] == {"fixed_ms": 5.0, "prefill_token_ms": 0.5, "decode_seq_ms": 1.0,
                             "context_token_ms": 0.002}
    assert ModelSpec.from_raw(raw, "model") == m
    plain = ModelSpec.from_raw({"preset": "tiny-llama"}, "model")
    assert ModelSpec.from_raw(plain.to_raw(), "model") == plain
    t.validate("model.timing")  # built in Python: the same rules


def test_worker_spec_carries_the_timing():
    m = ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"fixed_ms": 3}}, "model")
    spec = WorkerSpec("unified0", "unified", ("cpu:0",), "ipc://x", m, EngineConfig(), 0, None, "pull", "p",
                      "decode", (), 10.0)
    assert WorkerSpec.from_raw(spec.to_raw()).model.timing == StepTiming(fixed_ms=3.0)


# ---- in a recipe ----

RECIPE = {
    "model": {"preset": "tiny-llama", "timing": {"fixed_ms": 2}},
    "rates": [1],
    "deployment": {"unified": {"devices": ["cpu:0"]}},
}


def test_recipe_resolves_a_modelled_variant():
    v = parse_recipe(RECIPE).resolved("default")
    assert v.model.timing.fixed_ms == 2.0 and v.model.modelled
    assert v.model.timing == StepTiming(fixed_ms=2.0)
    again = parse_recipe(yaml.safe_load(dump_recipe(parse_recipe(RECIPE))))
    assert again.resolved("default").model == v.model


def test_variants_merge_and_drop_the_timing():
    raw = dict(RECIPE, variants={"more": {"model": {"timing": {"decode_seq_ms": 1}}},
                                 "real": {"model": {"timing": None}},
                                 "other": {"model": {"preset": "tiny-qwen3"}}})
    r = parse_recipe(raw)
    assert r.resolved("more").model.timing == StepTiming(fixed_ms=2.0, decode_seq_ms=1.0)
    assert r.resolved("real").model.timing is None and not r.resolved("real").model.modelled
    assert r.resolved("other").model.timing == StepTiming(fixed_ms=2.0)  # another model keeps the timing
    assert parse_recipe(RECIPE, sets=["model.timing.fixed_ms=3"]).resolved("default").model.timing.fixed_ms == 3.0
    with pytest.raises(RecipeError, match=r"^variants\.default\.model\.timing\.fixed_ms: expected"):
        parse_recipe(RECIPE, sets=["model.timing.fixed_ms=-3"])


# ---- in the engine ----

TIMING = StepTiming(fixed_ms=5, prefill_token_ms=0.5, decode_seq_ms=1)


@pytest.fixture(autouse=True)
def one_thread():
    """The real forward must fit in the modelled time: on a small busy box torch's threads wait for each other
    at every op (a 40-token prefill of the tiny model went from 2 to 50 ms); one thread stays at a few ms."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cfg() -> EngineConfig:
    return EngineConfig(block_size=16, kv_blocks=64)


def late_steps(records, timing) -> list:
    """Steps that ended more than TOL_S after their model, when the median step did too (a loaded box delays
    a wake-up now and then; a wait that is wrong makes every step late). None may end before its model."""
    late, over = [], []
    for r in records:
        want = timing.step_s(r.prefill_tokens, r.decode_seqs, 0)
        assert r.end - r.start >= want, (r, want)  # the wait guarantees this, however busy the box
        assert r.forward_s <= r.end - r.start  # the wait counts as (modelled) forward time
        over.append(r.end - r.start - want)
        if r.end - r.start >= want + TOL_S:
            late.append((r, want))
    return late if sorted(over)[len(over) // 2] >= TOL_S else []


def timed_run(reqs, max_tokens, expected, tries=5):
    """Run with TIMING; outputs must equal `expected`. A step can end late only when the box stalls us (a busy
    or virtual machine, a few ms, rarely): try again then, up to `tries` times."""
    for _ in range(tries):
        eng = Engine(model("tiny-llama"), cfg(), step_timing=TIMING)
        outs, records = run(eng, reqs, max_tokens=max_tokens)
        assert outs == expected  # timing never changes outputs
        eng.check_idle()
        late = late_steps(records, TIMING)
        if not late:
            return records
    raise AssertionError(f"steps ended over {TOL_S * 1e3:.0f} ms after their model in {tries} runs: {late}")


def test_modelled_steps_take_their_modelled_time():
    reqs = prompts([40, 40], seed=11)
    untimed, _ = run(Engine(model("tiny-llama"), cfg()), reqs, max_tokens=8)  # also warms the model up
    one, _ = run(Engine(model("tiny-llama"), cfg()), reqs[:1], max_tokens=1)
    records = timed_run(reqs[:1], 1, one)
    assert [r.prefill_tokens for r in records] == [40]
    assert 0.025 <= records[0].end - records[0].start  # 5 + 40 * 0.5 ms; late only as late_steps allows

    records = timed_run(reqs, 8, untimed)
    decodes = [r for r in records if r.decode_seqs == 2 and r.prefill_tokens == 0]
    assert len(decodes) == 7
    assert all(r.end - r.start >= 0.007 for r in decodes)  # 5 + 2 * 1 ms
    assert sorted(r.end - r.start for r in decodes)[3] < 0.007 + TOL_S  # the median decode step


def test_prefill_ends_when_the_modelled_step_ends():
    eng = Engine(model("tiny-llama"), cfg(), step_timing=StepTiming(fixed_ms=10))
    eng.add("a", prompts([20], seed=2)[0])
    seq = eng.sequence("a")
    rec = eng.step().record
    assert seq.t_prefill_end == rec.end and rec.end - rec.start >= 0.010  # even when the real work took longer


class Recorder:
    """Any object with step_s will do: the engine does not know the recipe."""

    def __init__(self):
        self.calls = []

    def step_s(self, prefill_tokens, decode_seqs, context_tokens):
        self.calls.append((prefill_tokens, decode_seqs, context_tokens))
        return 0.0


def test_context_tokens_are_what_decode_sequences_attend():
    rec = Recorder()
    eng = Engine(model("tiny-llama"), cfg(), step_timing=rec)
    run(eng, prompts([10, 20], seed=4), max_tokens=3)
    # one prefill step, then two decode steps: each sequence attends its prompt, its earlier outputs and
    # the token it computes now
    assert rec.calls == [(30, 0, 0), (0, 2, 11 + 21), (0, 2, 12 + 22)]


def test_step_timing_must_have_step_s():
    with pytest.raises(TypeError, match="step_s"):
        Engine(model("tiny-llama"), cfg(), step_timing=5)


def test_wait_until_is_precise():
    for wait in (0.0005, 0.003, 0.012):
        over = []
        for _ in range(15):
            deadline = time.monotonic() + wait
            seen = wait_until(deadline)
            assert deadline <= seen <= time.monotonic()
            over.append(seen - deadline)
        assert sorted(over)[len(over) // 2] < 0.002, over  # rare stalls of the box aside
    assert wait_until(time.monotonic() - 1) <= time.monotonic()  # past: returns at once
