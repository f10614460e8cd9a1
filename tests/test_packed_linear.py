"""pdlab.engine.packed_linear: where a linear goes through MKL's packed GEMM its output is F.linear's bit for
bit; steps of fewer than MIN_ROWS or more than MAX_ROWS rows, a weight replaced after packing, and
PDLAB_CPU_KERNEL=off keep F.linear; an engine with every linear packed gives transformers' greedy tokens."""

import json

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import engine, hf_greedy, prompts, reference, run
from pdlab.constants import CPU_KERNEL_ENV, PACKED_LINEAR
from pdlab.engine import packed_linear as pl

pytestmark = pytest.mark.skipif(not pl.available(), reason="this torch has no MKL packed GEMM")


@pytest.fixture(autouse=True)
def one_thread():
    """As a CPU worker runs (one torch thread per core); with more, MKL's F.linear splits differently."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def packed_calls(monkeypatch) -> list[int]:
    """PDLAB_CPU_KERNEL=on (packed wherever the bits agree, untimed); the row count of every packed GEMM."""
    monkeypatch.setenv(CPU_KERNEL_ENV, "on")
    calls: list[int] = []
    real = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(pl.torch.ops.mkl, "_mkl_linear", lambda *a: (calls.append(a[-1]), real(*a))[1],
                        raising=False)
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_packed_rows_are_f_linear_bit_for_bit_and_the_rest_is_f_linear(bias, packed_calls):
    calls = packed_calls
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    if not pl.check(w, b).use:
        pytest.skip("MKL's packed GEMM is not F.linear's bits on this machine")
    p = pl.Packed(w, b)
    calls.clear()  # the check's own
    for rows in (1, 3, 4, 9, 32, 128, 129, 500):
        x = torch.randn(1, rows, 64, generator=g)
        assert torch.equal(p(x, w, b), F.linear(x, w, b)), rows
    assert calls == [4, 9, 32, 128]  # only MIN_ROWS..MAX_ROWS rows went packed


def test_a_weight_replaced_after_packing_is_used_as_it_is_now(monkeypatch):
    monkeypatch.setenv(CPU_KERNEL_ENV, "on")
    m = torch.nn.Linear(64, 96)
    model = torch.nn.Sequential(m)
    assert pl.pack_linears(model).use
    x = torch.randn(8, 64)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    m.weight = torch.nn.Parameter(torch.randn(96, 64), requires_grad=False)  # as tensor-parallel sharding does
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_off_unpacks_a_model_packed_before(monkeypatch):
    m = torch.nn.Linear(64, 96)
    model = torch.nn.Sequential(m)
    monkeypatch.setenv(CPU_KERNEL_ENV, "on")
    assert pl.pack_linears(model).use and hasattr(m, "pdlab_packed")
    monkeypatch.setenv(CPU_KERNEL_ENV, "off")
    c = pl.pack_linears(model)
    assert not c.use and c.why.startswith("off") and not hasattr(m, "pdlab_packed") and "forward" not in m.__dict__


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_an_engine_with_packed_linears_gives_transformers_tokens(preset, packed_calls, monkeypatch):
    """Seven sequences decode together (7 rows a step, packed), one alone at the end (F.linear)."""
    calls = packed_calls
    reqs = prompts([5, 17, 40, 33, 64, 1, 90])
    eng = engine(preset, block_size=16, kv_blocks=128)
    if not eng.runner.kernels[PACKED_LINEAR].use:
        pytest.skip("MKL's packed GEMM is not F.linear's bits on this machine")
    outs, _ = run(eng, reqs, max_tokens=24)
    ref = reference(preset)
    assert outs == {str(i): hf_greedy(ref, p, 24) for i, p in enumerate(reqs)}
    assert calls and min(calls) >= pl.MIN_ROWS and max(calls) <= pl.MAX_ROWS
    monkeypatch.setenv(CPU_KERNEL_ENV, "off")
    pl.pack_linears(eng.model)  # the cached model back as the other tests expect it


def test_only_float32_linears_are_packed(monkeypatch):
    monkeypatch.setenv(CPU_KERNEL_ENV, "on")
    model = torch.nn.Sequential(torch.nn.Linear(64, 96).to(torch.bfloat16))
    c = pl.pack_linears(model)
    assert not c.use and c.why == "does not apply: no float32 CPU linear" and not hasattr(model[0], "pdlab_packed")


def test_the_timed_verdict_is_cached_on_disk_and_read_by_the_next_process(monkeypatch, tmp_path):
    """One process times the race and writes the verdict; a later one (its in-memory verdicts empty) reads it
    and does not time: on narrow linears the race is close, and workers of one run must choose alike."""
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(CPU_KERNEL_ENV, raising=False)
    monkeypatch.setattr(pl, "_verdicts", {})
    w, b = torch.randn(96, 64), torch.randn(96)
    first = pl.check(w, b)
    if first.why.startswith("does not apply"):
        pytest.skip("MKL's packed GEMM is not F.linear's bits on this machine")
    assert first.why in ("faster here", "slower here") and first.use == (first.kernel_ms <= first.torch_ms)
    (path,) = tmp_path.glob("packed-*.json")
    key = "64x96-bias-t1"  # in x out, with a bias, one torch thread
    assert [round(t, 4) for t in json.loads(path.read_text())[key]["packed_linear"]] == [first.kernel_ms,
                                                                                        first.torch_ms]

    def no_timing(*a):
        raise AssertionError("timed again")

    monkeypatch.setattr(pl, "_best", no_timing)
    for kernel_ms, torch_ms in ((1.0, 2.0), (2.0, 1.0)):  # whatever the file says is the choice
        path.write_text(json.dumps({key: {"packed_linear": [kernel_ms, torch_ms]}}))
        monkeypatch.setattr(pl, "_verdicts", {})
        again = pl.check(w, b)
        assert (again.use, again.kernel_ms, again.torch_ms) == (kernel_ms < torch_ms, kernel_ms, torch_ms)
