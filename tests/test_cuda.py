"""The CUDA subset: the same parity checks on a GPU (skipped without CUDA)."""

import pytest

from engine_helpers import hf_greedy, prompts, reference, run
from pdlab.engine import Engine, EngineConfig, load_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("chunked", [False, True])
def test_cuda_engine_matches_transformers(chunked):
    m = load_model({"preset": "tiny-qwen3", "device": "cuda"})
    reqs = prompts([5, 17, 40, 64])
    eng = Engine(m, EngineConfig(kv_blocks=64, chunked_prefill=chunked, long_prefill_token_threshold=16, token_budget=64))
    outs, _ = run(eng, reqs, max_tokens=16)
    ref = reference("tiny-qwen3")
    assert outs == {str(i): hf_greedy(ref, p, 16) for i, p in enumerate(reqs)}
    eng.check_idle()


def test_cuda_bf16_runs_and_preempts_cleanly():
    m = load_model({"preset": "tiny-llama", "device": "cuda", "dtype": "bfloat16"})
    eng = Engine(m, EngineConfig(block_size=4, kv_blocks=12, token_budget=64))
    outs, records = run(eng, prompts([20, 18, 22, 9]), max_tokens=16)
    assert all(len(v) == 16 for v in outs.values())
    assert sum(r.preempted for r in records) > 0
    eng.check_idle()
