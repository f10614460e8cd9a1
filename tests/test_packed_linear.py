"""pdlab.engine.packed_linear: where a linear goes through MKL's packed GEMM its output is F.linear's bit for
bit; steps of fewer than MIN_ROWS or more than MAX_ROWS rows, a weight replaced after packing, and
PDLAB_CPU_KERNEL=off keep F.linear; where it goes through oneDNN's or pdlab's own GEMM, a row's bits do not
depend on the rows beside it and stay near F.linear's; an engine with every linear packed any of these ways
gives transformers' greedy tokens; the cached verdict is the fastest of what applies."""

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
    and does not time: on narrow linears the race is close, and workers of one run must choose alike. The
    verdict is the fastest of the packings that apply and F.linear."""
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(CPU_KERNEL_ENV, raising=False)
    monkeypatch.setattr(pl, "_verdicts", {})
    w, b = torch.randn(96, 64), torch.randn(96)
    first = pl.check(w, b)
    if first.why.startswith("does not apply"):
        pytest.skip("neither packed GEMM applies on this machine")
    assert first.why.startswith("faster here (") or first.why == "slower here"
    assert first.use == (first.kernel_ms <= first.torch_ms)
    (path,) = tmp_path.glob("packed-*.json")
    key = "64x96-bias-t1"  # in x out, with a bias, one torch thread
    written = json.loads(path.read_text())[key]
    assert set(written) <= set(pl.NAME_OF.values()) and written
    assert min(round(t[0], 4) for t in written.values()) == first.kernel_ms

    def no_timing(*a):
        raise AssertionError("timed again")

    monkeypatch.setattr(pl, "_best", no_timing)
    names = sorted(written)
    # whatever the file says is the choice, torch at 2.0: each packing fastest in turn, then all slower
    cases = [[1.0 if i == j else 3.0 + i for i in range(len(names))] for j in range(len(names))]
    for times in cases + [[4.0 + i for i in range(len(names))]]:
        path.write_text(json.dumps({key: {n: [t, 2.0] for n, t in zip(names, times)}}))
        monkeypatch.setattr(pl, "_verdicts", {})
        again = pl.check(w, b)
        best = min(range(len(names)), key=lambda i: times[i])
        assert (again.use, again.kernel_ms, again.torch_ms) == (times[best] < 2.0, times[best], 2.0)
        if again.use:
            assert again.why == f"faster here ({pl.LABEL[pl.KIND_OF[names[best]]]})"


ANY_ROWS = [pytest.param("dnnl", marks=pytest.mark.skipif(not pl.dnnl_available(), reason="no oneDNN linear")),
            pytest.param("gemm", marks=pytest.mark.skipif(not pl.gemm_available(), reason="no pdlab GEMM"))]


@pytest.mark.parametrize("kind", ANY_ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_row_does_not_depend_on_the_rows_beside_it_and_stays_near_f_linear(kind, bias):
    """What lets oneDNN's or pdlab's GEMM serve a weight: a request's logits do not change with how many were
    batched with it (alone, in a decode batch, in a prefill), and stay within ANY_ROWS_RTOL of F.linear's."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    if (why := pl._fits(kind, w, b, g)) is not None:
        assert kind != "gemm", why  # pdlab's own is batch-independent by construction
        pytest.skip(f"{kind} does not fit here: {why}")
    p = pl.Packed(w, b, kind)
    x = torch.randn(600, 96, generator=g)
    alone = p(x[:1], w, b)
    for rows in (1, 3, 4, 9, 32, 128, 129, 600):
        y, ref = p(x[:rows], w, b), F.linear(x[:rows], w, b)
        assert torch.equal(y[:1], alone), rows
        assert float((y - ref).abs().max()) <= pl.ANY_ROWS_RTOL * float(ref.abs().max()), rows
    strided = torch.randn(96, 8, generator=g).t()  # a view that is not contiguous gets the same bits
    assert torch.equal(p(strided, w, b), p(strided.contiguous(), w, b))
    other = torch.randn(160, 96)  # a weight replaced after packing: F.linear on the new one
    assert torch.equal(p(x[:8], other, b), F.linear(x[:8], other, b))


@pytest.mark.parametrize("kind", ANY_ROWS)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_an_engine_with_any_rows_linears_gives_transformers_tokens(kind, preset, monkeypatch):
    """Every linear on oneDNN or on pdlab's GEMM (their bits, not F.linear's): seven sequences decoding
    together, then one of them again alone, greedy tokens equal to transformers' and to each other."""
    monkeypatch.setattr(pl, "verdict", lambda w, b: (pl.Choice(True, f"faster here ({pl.LABEL[kind]})", 1.0, 2.0),
                                                     kind))
    calls: list[int] = []
    if kind == "dnnl":
        real = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(pl.torch.ops.mkldnn, "_linear_pointwise",
                            lambda x, *a: (calls.append(x.shape[0]), real(x, *a))[1], raising=False)
    else:
        real_call = pl.gemm_kernel.Panels.__call__
        monkeypatch.setattr(pl.gemm_kernel.Panels, "__call__",
                            lambda self, x, *a: (calls.append(x.shape[0]), real_call(self, x, *a))[1])
    reqs = prompts([5, 17, 40, 33, 64, 1, 90])
    eng = engine(preset, block_size=16, kv_blocks=128)
    pl.pack_linears(eng.model)
    try:
        outs, _ = run(eng, reqs, max_tokens=24)
        alone, _ = run(eng, reqs[2:3], max_tokens=24)
    finally:
        monkeypatch.setenv(CPU_KERNEL_ENV, "off")
        pl.pack_linears(eng.model)  # the cached model back as the other tests expect it
    ref = reference(preset)
    assert outs == {str(i): hf_greedy(ref, p, 24) for i, p in enumerate(reqs)}
    assert alone["0"] == outs["2"]
    assert 1 in calls and 7 in calls and max(calls) > pl.MAX_ROWS  # alone, the batch of seven, a prefill
