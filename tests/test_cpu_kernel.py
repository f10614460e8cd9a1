"""pdlab's CPU kernels: built here; decode attention equal to SDPA on paged K/V, causal prefill attention
equal to SDPA, rotary equal to transformers bit for bit; the engine's torch paths where they cannot be
built."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import engine, hf_greedy, prompts, reference, run
from pdlab.engine import cpu_kernel
from pdlab.engine.cpu_kernel import DecodeBatch

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here")


def reference_attention(q, kv, rows, tables, lens, block_size, scale):
    out = {}
    heads, kv_heads = q.shape[1], kv.shape[3]
    for r, t, n in zip(rows, tables, lens):
        k = kv[0][t].reshape(-1, kv_heads, q.shape[2])[:n].transpose(0, 1)
        v = kv[1][t].reshape(-1, kv_heads, q.shape[2])[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r].view(kv_heads, heads // kv_heads, -1), k, v, scale=scale)
        out[r] = o.reshape(heads, -1)
    return out


@needs_cc
def test_the_kernel_builds_on_this_machine():
    assert cpu_kernel.status() == "built"


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 64), (16, 8, 128), (8, 1, 64),
                                                     (6, 2, 24), (12, 4, 40)])  # the last two: generic loops
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_sdpa_over_scattered_blocks(heads, kv_heads, head_dim, block_size):
    torch.manual_seed(heads * 1000 + head_dim + block_size)
    num_blocks = 400
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    lens = [1, 2, 7, 8, 9, 63, 64, 65, 300]  # one token, under and across eight-float vectors and blocks
    perm = torch.randperm(num_blocks).tolist()  # blocks in no order: the table is followed, not assumed
    tables, i = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(perm[i:i + k])
        i += k
    q_full = torch.randn(len(lens) + 5, heads, head_dim)
    q = q_full.transpose(0, 1).contiguous().transpose(0, 1)  # a strided view, as transformers hands it over
    rows = [0, 2, 3, 5, 6, 8, 9, 11, 13]
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    cpu_kernel.decode_attention(q, kv[0], kv[1], DecodeBatch(rows, tables, lens), scale, out)
    ref = reference_attention(q, kv, rows, tables, lens, block_size, scale)
    for r in rows:
        torch.testing.assert_close(out[r], ref[r], rtol=1e-5, atol=1e-5)
    others = [r for r in range(q.shape[0]) if r not in rows]
    assert torch.isnan(out[others]).all(), "rows that are not decode rows were written"


@needs_cc
def test_limits_are_refused_not_overrun():
    assert not cpu_kernel.usable(torch.float32, 8 * 64, 8, 64)  # 64 query heads per K/V head
    assert not cpu_kernel.usable(torch.float32, 8, 8, 512)
    assert not cpu_kernel.usable(torch.bfloat16, 8, 2, 64)  # float32 only: bf16 pools take the torch path
    assert cpu_kernel.usable(torch.float32, 8, 2, 64)


def _status_in_subprocess(env: dict) -> str:
    code = "from pdlab.engine import cpu_kernel; print(cpu_kernel.status())"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_switched_off_or_without_a_compiler_the_torch_path_is_used(tmp_path):
    assert _status_in_subprocess({"PDLAB_CPU_KERNEL": "0"}) == "off (PDLAB_CPU_KERNEL=0)"
    status = _status_in_subprocess({"CC": "/nonexistent/cc", "PDLAB_KERNEL_CACHE": str(tmp_path)})
    assert status.startswith("unavailable (no C compiler") and "torch" in status
    assert os.listdir(tmp_path) == []


@needs_cc
def test_a_cached_build_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernel.build()
    mtime = os.stat(first).st_mtime_ns
    assert cpu_kernel.build() == first and os.stat(first).st_mtime_ns == mtime
    assert os.listdir(tmp_path) == [os.path.basename(first)], "a temporary file was left behind"


@needs_cc
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("kernel", [True, False])
def test_engine_matches_transformers_with_and_without_the_kernel(preset, kernel, monkeypatch):
    """Both decode paths of a CPU engine give transformers' greedy tokens; the kernel path really ran."""
    calls, prefills = [], []
    real, real_prefill = cpu_kernel.decode_attention, cpu_kernel.prefill_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a: (calls.append(1), real(*a)))
    monkeypatch.setattr(cpu_kernel, "prefill_attention", lambda *a: (prefills.append(1), real_prefill(*a)))
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "usable", lambda *a: False)
        monkeypatch.setattr(cpu_kernel, "prefill_usable", lambda *a: False)
    reqs = prompts([5, 17, 40, 33, 64, 1, 90])
    eng = engine(preset, block_size=16, kv_blocks=128)
    outs, _ = run(eng, reqs, max_tokens=24)
    ref = reference(preset)
    assert outs == {str(i): hf_greedy(ref, p, 24) for i, p in enumerate(reqs)}
    assert bool(calls) == kernel and bool(prefills) == kernel
    eng.check_idle()


@needs_cc
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_rotary_is_transformers_bit_for_bit(preset):
    """The one-pass rotary kernel rounds exactly as transformers' five ops, for the layout the attention
    layers hand over (a transposed projection), and the engine's model uses it only inside a step."""
    import sys

    from engine_helpers import model
    from pdlab.engine import attention

    m = model(preset)
    attn = next(x for x in m.modules() if type(x).__name__.endswith("Attention"))
    mod = sys.modules[type(attn).__module__]
    original = mod.apply_rotary_pos_emb.__wrapped__
    torch.manual_seed(0)
    cfg = m.config
    tokens, heads, kv_heads = 37, cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, dim).transpose(1, 2)
    rope = type(m.get_decoder().rotary_emb)(m.config)
    cos, sin = rope(q, torch.arange(tokens).unsqueeze(0) * 7)
    want_q, want_k = original(q, k, cos, sin)
    got_q, got_k = cpu_kernel.rotary(q, cos, sin), cpu_kernel.rotary(k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == want_q.stride()
    calls = []
    real = cpu_kernel.rotary
    try:
        cpu_kernel.rotary = lambda *a: (calls.append(1), real(*a))[1]
        mod.apply_rotary_pos_emb(q, k, cos, sin)  # outside an engine step: transformers' own ops
        assert not calls
        attention.set_context(object())
        assert all(torch.equal(a, b) for a, b in zip(mod.apply_rotary_pos_emb(q, k, cos, sin), (want_q, want_k)))
        assert calls
    finally:
        attention.set_context(None)
        cpu_kernel.rotary = real


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (16, 8, 64), (8, 8, 128), (4, 1, 16), (16, 2, 32)])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 300])
def test_prefill_matches_causal_sdpa(heads, kv_heads, head_dim, n):
    """One chunk over itself, causally, for views with row strides as the packed batch has them (and a V whose
    rows are wider than its heads, as the fused q/k/v projection leaves them)."""
    if heads // kv_heads > cpu_kernel.PREFILL_ROWS:
        assert not cpu_kernel.prefill_usable(torch.float32, heads, kv_heads, head_dim)
        return
    torch.manual_seed(n * 7 + head_dim)
    rows = n + 5
    q = torch.randn(rows, heads, head_dim)[2:2 + n]
    k = torch.randn(rows, kv_heads, head_dim)[2:2 + n]
    v = torch.randn(rows, 3 * kv_heads, head_dim)[2:2 + n, kv_heads:2 * kv_heads]
    out = torch.full((n + 3, heads, head_dim), float("nan"))
    cpu_kernel.prefill_attention(q, k, v, head_dim ** -0.5, out[1:1 + n])
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out[1:1 + n], ref, rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1 + n:]).all()


@needs_cc
def test_prefill_limits():
    assert cpu_kernel.prefill_usable(torch.float32, 8, 2, 32)
    assert not cpu_kernel.prefill_usable(torch.float32, 8, 2, 24)  # head_dim not a multiple of 16
    assert not cpu_kernel.prefill_usable(torch.float32, 16, 1, 64)  # 16 query heads per K/V head
    assert not cpu_kernel.prefill_usable(torch.bfloat16, 8, 2, 32)


@needs_cc
@pytest.mark.parametrize("width", [768, 40, 7])  # whole vectors, a tail, a tail only
def test_swiglu_matches_silu_times_up(width):
    torch.manual_seed(width)
    gate_up = torch.randn(33, 2 * width + 5)[:, 5:] * 6  # strided rows, values into exp's tails
    got = cpu_kernel.swiglu(gate_up)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    big = torch.tensor([[-200.0, 200.0, 0.0, -0.0, 3.0, 3.0, 100.0, -100.0]])  # exp clamped, not inf / nan
    torch.testing.assert_close(cpu_kernel.swiglu(big), F.silu(big[:, :4]) * big[:, 4:], rtol=1e-6, atol=1e-6)


@needs_cc
def test_the_fused_mlp_is_transformers_mlp_to_float_rounding():
    import copy

    from pdlab.engine import load_model
    from pdlab.engine.fused_linear import fuse_projections

    plain = load_model("tiny-llama")
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    x = torch.randn(1, 40, plain.config.hidden_size)
    for a, b in zip(plain.get_decoder().layers, fused.get_decoder().layers):
        assert b.mlp.forward is not type(b.mlp).forward
        torch.testing.assert_close(b.mlp(x), a.mlp(x), rtol=1e-5, atol=1e-6)


@needs_cc
def test_exp_is_accurate_under_the_kernels_float_flags():
    """silu(g) * 1 = g * exp(g) / (1 + exp(g)) for g << 0 carries exp's relative error: the kernels are built
    with associative float math, which must not undo exp's two-part ln2 (that once cost 62 ulps)."""
    g = torch.linspace(-86.0, -8.0, 4096)
    gate_up = torch.cat([g[:, None], torch.ones(4096, 1)], dim=1).reshape(64, 128)  # rows of [gate 64 | up 64]
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    got = cpu_kernel.swiglu(gate_up).double().flatten()
    x = gate_up[:, :64].double().flatten()
    want = x / (1 + torch.exp(-x))
    assert ((got - want) / want).abs().max().item() < 4 * 2.0 ** -24  # within 4 ulps


@needs_cc
@pytest.mark.parametrize("width", [256, 40, 7])  # whole vectors, a tail, a tail only
def test_rms_norm_matches_torch(width):
    torch.manual_seed(width)
    w = torch.rand(width) + 0.5
    x = torch.randn(6, 9, width + 3)[:, :, 3:] * 4  # rows at a stride: read in place, not copied
    got = cpu_kernel.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(x, (width,), w, 1e-6), rtol=2e-6, atol=1e-6)
    assert cpu_kernel.rms_norm(torch.randn(4, 6, width)[:, ::2].transpose(0, 1), w, 1e-6) is None  # no one row stride
    assert cpu_kernel.rms_norm(x.bfloat16(), w, 1e-6) is None  # float32 only: the caller runs torch's op
    assert cpu_kernel.rms_norm(torch.randn(width, 3).t(), w, 1e-6) is None  # no unit stride over width
