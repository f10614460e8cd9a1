"""Loading models and refusing bad input with one clear line."""

import pytest

from engine_helpers import engine, prompts
from pdlab.engine import EngineConfig, ModelLoadError, RequestError, SamplingParams, load_model
from pdlab.engine.model import PRESETS


def test_presets_load_with_the_requested_dtype():
    import torch

    m = load_model({"preset": "tiny-qwen3", "dtype": "bfloat16"})
    assert next(m.parameters()).dtype == torch.bfloat16
    assert {"tiny-llama", "tiny-qwen3", "cpu-demo"} <= set(PRESETS)


def test_same_seed_same_weights():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    assert all((x == y).all() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("spec,msg", [
    ("no-such-preset", "neither a local directory nor in the local HF cache"),
    ("/does/not/exist", "does not exist"),
    ({"preset": "nope"}, "unknown model preset 'nope'"),
])
def test_bad_model_specs(spec, msg):
    with pytest.raises(ModelLoadError, match=msg):
        load_model(spec)


def test_directory_without_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="holds no model"):
        load_model(str(tmp_path))


def test_a_stand_in_only_preset_gives_dims_but_never_weights():
    from pdlab.engine.model import load_stand_in, model_dims

    assert PRESETS["qwen3-235b-a22b"].stand_in_only
    for spec in ("qwen3-235b-a22b", {"preset": "qwen3-235b-a22b", "dtype": "bfloat16"}):
        with pytest.raises(ModelLoadError) as e:
            load_model(spec)
        assert str(e.value) == ("preset qwen3-235b-a22b has the dimensions of a 235B model only: use it with "
                                "model.timing (a timed engine or the simulator)")
    d = model_dims(load_stand_in({"preset": "qwen3-235b-a22b", "dtype": "bfloat16"}))
    assert (d["layers"], d["kv_heads"], d["head_dim"], d["vocab_size"]) == (94, 4, 128, 151936)  # head_dim != 4096/64
    assert model_dims(load_stand_in("gpu-0.6b"))["head_dim"] == 64  # the others keep hidden // heads


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model({"preset": "tiny-llama", "dtype": "int3"})


@pytest.mark.parametrize("prompt,params,msg", [
    ([], SamplingParams(), "empty prompt"),
    ([5] * 3000, SamplingParams(), "does not fit the model's context of 2048"),
    ([5] * 600, SamplingParams(), "needs 38 KV blocks; the whole pool has 32"),
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    ([5, 99999], SamplingParams(), "outside the vocabulary"),
])
def test_bad_requests_fail_alone(prompt, params, msg):
    eng = engine(kv_blocks=32, block_size=16)
    eng.add("good", prompts([10])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError, match=msg):
        eng.add("bad", prompt, params)
    n = 0
    while eng.has_work():
        n += len(eng.step().tokens)
    assert n == 4  # the good request was served in full
    eng.check_idle()


def test_duplicate_request_id():
    eng = engine(kv_blocks=8)
    eng.add("a", [5, 6], SamplingParams())
    with pytest.raises(RequestError, match="already exists"):
        eng.add("a", [5, 6], SamplingParams())


def test_bad_engine_config():
    with pytest.raises(ValueError, match="long_prefill_token_threshold .* must be <= engine.token_budget"):
        engine(chunked_prefill=True, long_prefill_token_threshold=64, token_budget=32)
    with pytest.raises(ValueError, match="role must be one of"):
        engine(role="both")


def test_auto_pool_is_sized_from_max_running():
    eng = engine(kv_blocks="auto", max_running=4, block_size=16)
    assert eng.blocks.num_blocks == 4 * 2048 // 16
    assert eng.kv.shape == (2, 2, eng.blocks.num_blocks, 16, 2, 16)
