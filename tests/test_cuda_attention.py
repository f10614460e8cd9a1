"""The CUDA attention paths, run on CPU: the same engine must give transformers' tokens whichever kernel the
runner picked. flash-attn is replaced by a reference of its varlen contract (bottom-right causal, GQA, paged
or packed K/V), so the runner's bookkeeping (offsets, block tables, gather index) is what is tested here;
the real kernels run in tests/test_cuda.py on a GPU."""

import time

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import hf_greedy, model, prompts, reference, run
from pdlab.constants import cdiv
from pdlab.engine import Engine, EngineConfig
from pdlab.engine import cuda_attention as ca
from pdlab.engine.runner import ModelRunner


class FakeFlash:
    """flash_attn_varlen_func's contract, computed per request with SDPA."""

    __version__ = "fake"
    calls = 0

    @classmethod
    def flash_attn_varlen_func(cls, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                               block_table=None):
        assert causal and q.dtype == k.dtype and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        cls.calls += 1
        out = torch.empty_like(q)
        for s in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            n, m = q1 - q0, k1 - k0
            assert n <= max_q and m <= max_k
            if block_table is None:
                ks, vs = k[k0:k1], v[k0:k1]
            else:
                blocks = block_table[s, :cdiv(m, k.shape[1])].long()
                ks, vs = k[blocks].flatten(0, 1)[:m], v[blocks].flatten(0, 1)[:m]
            ks, vs = ca.expand_kv(ks, vs, q.shape[1], 1)
            mask = torch.arange(m).unsqueeze(0) <= torch.arange(m - n, m).unsqueeze(1)  # bottom-right causal
            o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               attn_mask=mask, scale=softmax_scale)
            out[q0:q1] = o.transpose(0, 1)
        return out


def _engine(kernel: str, paged: bool = False, **cfg) -> Engine:
    eng = Engine(model("tiny-llama"), EngineConfig(**cfg))  # 4 query heads, 2 K/V heads: GQA
    eng.runner.kernel, eng.runner.paged, eng.runner.in_place = kernel, paged, False  # as a CUDA runner
    return eng


@pytest.mark.parametrize("kernel,paged", [("sdpa-expanded", False), ("flash-attn", False), ("flash-attn", True)])
@pytest.mark.parametrize("chunked", [False, True])
def test_cuda_kernels_match_transformers(monkeypatch, kernel, paged, chunked):
    monkeypatch.setattr(ca, "flash_module", lambda: FakeFlash)
    FakeFlash.calls = 0
    reqs = prompts([5, 17, 40], prefix=list(range(10, 26)))  # a shared prefix: prefix-cache hits too
    eng = _engine(kernel, paged, block_size=4, kv_blocks=96, chunked_prefill=chunked,
                  long_prefill_token_threshold=8, token_budget=32)
    outs, _ = run(eng, reqs, max_tokens=8)
    ref = reference("tiny-llama")
    assert outs == {str(i): hf_greedy(ref, p, 8) for i, p in enumerate(reqs)}
    assert (FakeFlash.calls > 0) == (kernel == "flash-attn")
    eng.check_idle()


def test_gather_index_lists_each_context_token_slot_in_order():
    bs = 4
    tables = [[7, 2], [5], [1, 3, 0]]  # contexts of 6, 3 and 9 tokens
    lens = [6, 3, 9]
    blocks = torch.tensor([b for t in tables for b in t])
    starts = torch.tensor([0, 2, 3])
    cu_k = torch.tensor([0, 6, 9, 18], dtype=torch.int32)
    idx = ca.gather_index(blocks, starts, torch.tensor(lens), cu_k, 18, bs)
    want = [t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n)]
    assert idx.tolist() == want


def test_kernel_choice():
    flash = FakeFlash
    assert ca.kernel_for("cpu", torch.float32, 64, flash) == "sdpa"  # CPU stays as it was
    assert ca.kernel_for("cuda", torch.bfloat16, 128, flash) == "flash-attn"
    assert ca.kernel_for("cuda", torch.bfloat16, 128, None) == "sdpa-expanded"
    assert ca.kernel_for("cuda", torch.float32, 128, flash) == "sdpa-expanded"  # flash-attn: fp16/bf16 only
    assert ca.kernel_for("cuda", torch.float16, 512, flash) == "sdpa-expanded"  # head_dim <= 256 only
    assert ca.supports_paged(flash, 256) and not ca.supports_paged(flash, 16)


def test_cpu_runner_keeps_sdpa_and_never_synchronizes(monkeypatch):
    def boom(*a):
        raise AssertionError("a CPU step must not call CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    eng = Engine(model("tiny-llama"), EngineConfig(kv_blocks=32))
    assert eng.runner.kernel == "sdpa" and not eng.runner.paged
    run(eng, prompts([6]), max_tokens=2)


def test_cuda_runner_sync_waits_for_its_compute_stream_only(monkeypatch):
    """Not the whole device: KV copies on the pull/push side streams keep overlapping the next step."""
    seen = []

    class Stream:
        def __init__(self, dev):
            self.dev = dev

        def synchronize(self):
            seen.append(self.dev)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("whole device"))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cuda", 1)
    runner.sync()
    assert seen == [torch.device("cuda", 1)]


def test_step_times_include_the_device_wait():
    """forward_s and the prefill-end time are read after runner.sync(): a slow device shows in them."""
    eng = Engine(model("tiny-llama"), EngineConfig(kv_blocks=32))
    eng.runner.sync = lambda: time.sleep(0.05)  # a GPU still busy when forward() returned
    eng.add("a", prompts([6])[0])
    t0 = time.monotonic()
    rec = eng.step().record
    assert rec.forward_s >= 0.05
    assert eng.sequence("a").t_prefill_end - t0 >= 0.05


def test_the_kernel_in_use_is_recorded(monkeypatch):
    assert ca.describe("cpu", torch.float32, 64, 16) == {"kernel": "sdpa", "paged": False, "flash_attn": None}
    monkeypatch.setattr(ca, "flash_module", lambda: FakeFlash)
    assert ca.describe("cuda", torch.bfloat16, 128, 256) == {"kernel": "flash-attn", "paged": True,
                                                              "flash_attn": "fake"}
    assert ca.env_summary()["cuda_fp16_bf16"] == "flash-attn"
    monkeypatch.setattr(ca, "flash_module", lambda: None)
    assert ca.env_summary() == {"cuda_fp16_bf16": "sdpa-expanded", "cuda_fp32": "sdpa-expanded",
                                "flash_attn": None}
