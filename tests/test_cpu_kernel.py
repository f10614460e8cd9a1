"""pdlab's CPU kernels: built here as C11 without warnings, for this CPU and for the AVX2 and plain-C paths;
decode attention equal to SDPA on paged K/V, causal prefill attention equal to SDPA, rotary equal to
transformers bit for bit, SwiGLU and RMSNorm to float rounding, on every path; the engine's torch paths where
they cannot be built. (Which of them a runner uses is pdlab.engine.kernel_check's: tests/test_kernel_check.py.)"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import assert_split_keeps_bits, engine, hf_greedy, prompts, reference, run
from pdlab.constants import CPU_KERNEL_ENV
from pdlab.engine import cpu_kernel, kernel_build
from pdlab.engine.cpu_kernel import DecodeBatch
from pdlab.engine.kernel_check import Shape, applies

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here")
FLAGS = kernel_build.cpu_flags().split()
# every path vec_math.h has that this CPU can run: its own (-march=native), AVX2 with FMA (x86-64-v3) and plain
# C (x86-64: SSE2 only, libm's expf); AVX-512 is the native path on a box that has it
TARGETS = ["native"] + (["x86-64-v3"] if {"avx2", "fma"} <= set(FLAGS) else []) + (
    ["x86-64"] if "sse2" in FLAGS else [])


@pytest.fixture(scope="module", params=TARGETS)
def kernels(request):
    """One build of every kernel for a target, with -Werror: a warning fails the build, and so the test."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    k = cpu_kernel.Kernels(request.param, werror=True)
    assert not k.errors, k.errors
    return k


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
def test_the_kernels_build_on_this_machine():
    assert cpu_kernel.status() == "built"


def test_the_sources_use_no_compiler_builtins():
    """C11 and the x86 intrinsics headers only: GCC 11 (Ubuntu 22.04, RHEL 8/9) lacks __builtin_shufflevector,
    and one kernel that does not build used to take every other one down with it."""
    for name in sorted(os.listdir(kernel_build.CSRC)):
        with open(os.path.join(kernel_build.CSRC, name)) as f:
            code = re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read(), flags=re.S)  # comments may name them
        assert "__builtin" not in code, name


def distinct_paths(cc: str, targets: list[str]) -> list[str]:
    """One target per set of ISA macros the sources branch on: two targets that enable the same ones (native and
    x86-64-v3 on an AVX2-only CPU) compile the same code, so only the first is built."""
    seen, out = set(), []
    for t in targets:
        p = subprocess.run([cc, f"-march={t}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
        macros = frozenset(m for m in ISA_MACROS if f"#define {m} " in p.stdout) if p.returncode == 0 else t
        if macros not in seen:
            seen.add(macros)
            out.append(t)
    return out


ISA_MACROS = sorted({m for name in os.listdir(kernel_build.CSRC)
                     for m in re.findall(r"defined\((__[A-Z0-9_]+__)\)", open(os.path.join(kernel_build.CSRC, name)).read())})


def test_targets_that_compile_the_same_paths_are_built_once():
    assert {"__AVX512F__", "__AVX2__", "__FMA__"} <= set(ISA_MACROS)
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        pytest.skip("no compiler")
    assert distinct_paths(cc, ["x86-64-v3", "x86-64-v3", "x86-64"]) == ["x86-64-v3", "x86-64"]


@pytest.mark.slow
@pytest.mark.parametrize("cc", ["gcc-11", "clang-14", "clang"])
def test_other_compilers_build_every_target_without_warnings(cc, tmp_path, monkeypatch):
    """GCC 11 is what Ubuntu 22.04 and RHEL 8/9 ship (the old __builtin_shufflevector broke there); Clang too.
    Skipped where the compiler is not installed (`apt-get install gcc-11 clang-14` here)."""
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    for target in distinct_paths(cc, TARGETS):
        k = cpu_kernel.Kernels(target, werror=True)
        assert not k.errors, (cc, target, k.errors)
        kernel_build.open_kernel("gemm", target, werror=True)  # pdlab's GEMM (pdlab.engine.gemm_kernel), apart
        for name in kernel_build.THREADED:  # and the threaded kernels' builds without OpenMP (a compiler without it)
            kernel_build.build(name, target, werror=True, openmp=False)


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (8, 2, 32), (4, 4, 64), (4, 4, 128), (16, 8, 128), (8, 1, 64), (8, 1, 32), (14, 2, 64), (3, 3, 96),  # constant
    (6, 2, 24), (12, 4, 40),  # head_dim a multiple of 8 the source has no case for: run-time loop bounds
    (4, 2, 20)])  # head_dim not a multiple of 8: plain loops
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_sdpa_over_scattered_blocks(kernels, heads, kv_heads, head_dim, block_size):
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
    kernels.decode_attention(q, kv[0], kv[1], DecodeBatch(rows, tables, lens), scale, out)
    ref = reference_attention(q, kv, rows, tables, lens, block_size, scale)
    for r in rows:
        torch.testing.assert_close(out[r], ref[r], rtol=1e-5, atol=1e-5)
    others = [r for r in range(q.shape[0]) if r not in rows]
    assert torch.isnan(out[others]).all(), "rows that are not decode rows were written"


@needs_cc
def test_a_threaded_kernel_without_openmp_is_built_without_it(monkeypatch):
    """The threaded kernels build with -fopenmp, the others without; where the OpenMP build fails (a compiler
    without OpenMP), the kernel is built and loaded without it, and the others are not tried twice."""
    assert all("-fopenmp" in kernel_build.flags(n) for n in kernel_build.THREADED)
    assert "-fopenmp" not in kernel_build.flags("rotary")
    real, asked = kernel_build.build, []

    def build(name, march="native", werror=False, openmp=None):
        asked.append((name, openmp))
        if openmp:
            raise kernel_build.BuildError(f"cc failed on {name}.c: unsupported option '-fopenmp'")
        return real(name, march, werror, openmp)

    monkeypatch.setattr(kernel_build, "build", build)
    lib, path = kernel_build.open_kernel("decode_attention")
    assert path == real("decode_attention", openmp=False) and lib.pdlab_decode_attention
    assert asked == [("decode_attention", True), ("decode_attention", False)]
    kernel_build.open_kernel("rotary")
    assert asked[2:] == [("rotary", False)]


@needs_cc
def test_a_build_the_compiler_refuses_is_not_compiled_again(tmp_path, monkeypatch):
    """A compiler without OpenMP refuses the threaded kernels' OpenMP build: the refusal is cached beside the
    build, so the next worker start loads the plain build without running the compiler at all; another
    compiler (another --version) tries afresh."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    real = shutil.which(os.environ.get("CC") or "cc")
    cc.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\ncase \"$*\" in *-fopenmp*) echo \"cc: error: unsupported "
                  f"option '-fopenmp'\" >&2; exit 1;; esac\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path / "cache"))
    kernel_build.compiler_id.cache_clear()

    def compiles():
        return [x for x in log.read_text().splitlines() if "--version" not in x] if log.exists() else []

    lib, path = kernel_build.open_kernel("decode_attention")
    assert lib.pdlab_decode_attention and path == kernel_build.build("decode_attention", openmp=False)
    assert [("-fopenmp" in x) for x in compiles()] == [True, False]  # refused, then built without it
    refused = [f for f in os.listdir(tmp_path / "cache") if f.endswith(kernel_build.FAILED)]
    assert len(refused) == 1 and "unsupported option '-fopenmp'" in (tmp_path / "cache" / refused[0]).read_text()
    assert kernel_build.open_kernel("decode_attention")[1] == path and len(compiles()) == 2  # nothing compiled
    with pytest.raises(kernel_build.BuildError, match="unsupported option '-fopenmp' \\(cached: delete"):
        kernel_build.build("decode_attention", openmp=True)
    monkeypatch.setattr(kernel_build, "compiler_id", lambda cc: "another compiler 2.0")
    with pytest.raises(kernel_build.BuildError):
        kernel_build.build("decode_attention", openmp=True)
    assert len(compiles()) == 3  # a new compiler is asked again


@needs_cc
def test_decode_attention_split_over_threads_has_the_bits_of_one(monkeypatch):
    """Split by requests into parts of about equal context (one per torch thread), each part with its own
    scratch, every request computed as on one thread: the same bits with 2, 3 or 7 parts, more parts than
    requests included, and under the split the engine makes with three torch threads."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    kv = torch.randn(2, 300, block_size, kv_heads, head_dim)
    lens = [900, 3, 17, 400, 1, 250]  # uneven: the cut follows the context, not the request count
    perm, tables, i = torch.randperm(300).tolist(), [], 0
    for n in lens:
        tables.append(perm[i:i + -(-n // block_size)])
        i += -(-n // block_size)
    q = torch.randn(len(lens), heads, head_dim)
    batch = DecodeBatch(list(range(len(lens))), tables, lens)
    k = cpu_kernel.Kernels()

    def attend() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        k.decode_attention(q, kv[0], kv[1], batch, head_dim ** -0.5, out)
        return out

    assert_split_keeps_bits(monkeypatch, attend, (2, 3, 7))


def test_limits_are_refused_not_overrun():
    from pdlab.engine.kernel_check import Shape, applies

    assert applies("decode_attention", Shape(8 * 64, 8, 64, 64, 64), torch.float32)  # 64 query heads per K/V head
    assert applies("decode_attention", Shape(8, 8, 512, 64, 64), torch.float32)
    assert applies("decode_attention", Shape(8, 2, 64, 64, 64), torch.bfloat16)  # float32 only: bf16 takes torch
    assert applies("decode_attention", Shape(8, 2, 64, 64, 64), torch.float32) is None


def _status_in_subprocess(env: dict) -> str:
    code = "from pdlab.engine import cpu_kernel; print(cpu_kernel.status())"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_switched_off_or_without_a_compiler_the_torch_path_is_used(tmp_path):
    assert _status_in_subprocess({CPU_KERNEL_ENV: "0"}) == f"off ({CPU_KERNEL_ENV}=off)"
    status = _status_in_subprocess({"CC": "/nonexistent/cc", "PDLAB_KERNEL_CACHE": str(tmp_path)})
    assert status.startswith("unavailable (no C compiler") and "torch" in status
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@needs_cc
@pytest.mark.skipif("sse2" not in FLAGS, reason="x86-64 targets only")
def test_the_process_build_takes_its_target_from_the_environment(tmp_path, monkeypatch):
    """$PDLAB_KERNEL_MARCH=x86-64 (SSE2, plain C: runnable on any x86-64): the engine's build is that target's,
    the same files a build for it makes, and the status says which target it is."""
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    code = ("import json; from pdlab.engine import cpu_kernel as c; k = c.load(); "
            "print(json.dumps([k.march, sorted(k.paths.values()), c.status()]))")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PDLAB_KERNEL_MARCH": "x86-64"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    march, paths, status = json.loads(p.stdout)
    assert march == "x86-64" and status == "built (-march=x86-64, PDLAB_KERNEL_MARCH)"
    # a build's file is keyed by its flags, -march included: that process built the x86-64 files, and only those
    assert paths == sorted(kernel_build.build(n, "x86-64") for n in cpu_kernel.SIGNATURES)
    assert sorted(os.listdir(tmp_path)) == sorted([".lock", *map(os.path.basename, paths)])


@needs_cc
def test_a_cached_build_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    first = kernel_build.build("decode_attention")
    mtime = os.stat(first).st_mtime_ns
    assert kernel_build.build("decode_attention") == first and os.stat(first).st_mtime_ns == mtime
    assert sorted(os.listdir(tmp_path)) == [".lock", os.path.basename(first)], "a temporary file was left behind"


@needs_cc
def test_workers_starting_together_compile_once_and_ask_the_compiler_once(tmp_path):
    """Three processes build kernels into one empty cache at the same time: each kernel is compiled once
    (a file lock), each process asks `cc --version` once, and a temporary file left by a killed build is
    swept."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho \"$$ $*\" >> {log}\nexec {shutil.which(os.environ.get('CC') or 'cc')} \"$@\"\n")
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"rotary-0000000000000000.so{kernel_build.TMP_MARK}4242").write_text("half-written")
    env = {**os.environ, "CC": str(cc), "PDLAB_KERNEL_CACHE": str(cache)}
    kernels = ("swiglu", "rms_norm")  # the two smallest: two builds a process, one `cc --version`
    code = f"from pdlab.engine import kernel_build as b; print(all(b.build(n) for n in {kernels!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["True"] * 3
    calls = log.read_text().splitlines()
    compiles = [c for c in calls if "--version" not in c]
    assert len(compiles) == len(kernels), compiles
    versions = [c.split()[0] for c in calls if "--version" in c]
    assert len(versions) == len(set(versions)) <= 3, calls  # once per process at most (none on a cache hit)
    assert not [f for f in os.listdir(cache) if kernel_build.TMP_MARK in f]


@needs_cc
def test_one_kernel_that_fails_to_build_leaves_the_others(monkeypatch):
    """Loading is per kernel: a build error costs that kernel only, and says why."""
    real = kernel_build.open_kernel  # the usual cache: the other kernels are built already

    def open_kernel(name, *a, **kw):
        if name == "swiglu":
            raise kernel_build.BuildError("cc failed on swiglu.c: an error")
        return real(name, *a, **kw)

    monkeypatch.setattr(cpu_kernel, "open_kernel", open_kernel)
    k = cpu_kernel.Kernels()
    assert set(k.fns) == set(cpu_kernel.SIGNATURES) - {"swiglu"}
    assert k.status() == "built except swiglu (cc failed on swiglu.c: an error)"


@needs_cc
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("kernel", [True, False])
def test_engine_matches_transformers_with_and_without_the_kernel(preset, kernel, monkeypatch):
    """Both decode paths of a CPU engine give transformers' greedy tokens; the kernel path really ran."""
    calls, prefills = [], []
    real, real_prefill = cpu_kernel.decode_attention, cpu_kernel.prefill_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a: (calls.append(1), real(*a)))
    monkeypatch.setattr(cpu_kernel, "prefill_attention", lambda *a: (prefills.append(1), real_prefill(*a)))
    monkeypatch.setenv(CPU_KERNEL_ENV, "on" if kernel else "off")  # untimed: the path under test, whatever is faster
    reqs = prompts([5, 17, 40, 33, 64, 1, 90])
    eng = engine(preset, block_size=16, kv_blocks=128)
    outs, _ = run(eng, reqs, max_tokens=24)
    ref = reference(preset)
    assert outs == {str(i): hf_greedy(ref, p, 24) for i, p in enumerate(reqs)}
    assert bool(calls) == kernel and bool(prefills) == kernel
    eng.check_idle()


@needs_cc
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_rotary_is_transformers_bit_for_bit(kernels, preset, monkeypatch):
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
    got_q, got_k = kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == want_q.stride()
    calls = []
    real = cpu_kernel.rotary
    monkeypatch.setattr(cpu_kernel, "_off", {})
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
def test_prefill_matches_causal_sdpa(kernels, heads, kv_heads, head_dim, n):
    """One chunk over itself, causally, for views with row strides as the packed batch has them (and a V whose
    rows are wider than its heads, as the fused q/k/v projection leaves them)."""
    if heads // kv_heads > cpu_kernel.PREFILL_ROWS:
        assert applies("prefill_attention", Shape(heads, kv_heads, head_dim, 64, 64), torch.float32)
        return
    torch.manual_seed(n * 7 + head_dim)
    rows = n + 5
    q = torch.randn(rows, heads, head_dim)[2:2 + n]
    k = torch.randn(rows, kv_heads, head_dim)[2:2 + n]
    v = torch.randn(rows, 3 * kv_heads, head_dim)[2:2 + n, kv_heads:2 * kv_heads]
    out = torch.full((n + 3, heads, head_dim), float("nan"))
    kernels.prefill_attention(q, k, v, head_dim ** -0.5, out[1:1 + n])
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out[1:1 + n], ref, rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1 + n:]).all()


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (8, 1, 32)])
def test_prefill_split_over_threads_has_the_bits_of_one(heads, kv_heads, head_dim, monkeypatch):
    """Blocks of positions dealt round the parts (one per torch thread), each part scoring into its own
    scratch: the same bits with 2, 3 or 5 parts, a last block part-filled, and under the engine's own split with
    three torch threads."""
    torch.manual_seed(heads + head_dim)
    n = 203
    q, k, v = torch.randn(n, heads, head_dim), torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
    kernels = cpu_kernel.Kernels()

    def attend() -> torch.Tensor:
        out = torch.full((n, heads, head_dim), float("nan"))
        kernels.prefill_attention(q, k, v, head_dim ** -0.5, out)
        return out

    assert_split_keeps_bits(monkeypatch, attend, (2, 3, 5))


def test_prefill_limits():
    def ok(*shape, dtype=torch.float32):
        return applies("prefill_attention", Shape(*shape, 64, 64), dtype) is None

    assert ok(8, 2, 32)
    assert not ok(8, 2, 24)  # head_dim not a multiple of 16
    assert not ok(16, 1, 64)  # 16 query heads per K/V head
    assert not ok(8, 2, 32, dtype=torch.bfloat16)


@needs_cc
@pytest.mark.parametrize("width", [768, 40, 7])  # whole vectors, a tail, a tail only
def test_swiglu_matches_silu_times_up(kernels, width):
    torch.manual_seed(width)
    gate_up = torch.randn(33, 2 * width + 5)[:, 5:] * 6  # strided rows, values into exp's tails
    got = kernels.swiglu(gate_up)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    big = torch.tensor([[-200.0, 200.0, 0.0, -0.0, 3.0, 3.0, 100.0, -100.0]])  # exp clamped, not inf / nan
    torch.testing.assert_close(kernels.swiglu(big), F.silu(big[:, :4]) * big[:, 4:], rtol=1e-6, atol=1e-6)


@needs_cc
def test_the_fused_mlp_is_transformers_mlp_to_float_rounding(monkeypatch):
    import copy

    from pdlab.engine import load_model
    from pdlab.engine.fused_linear import fuse_projections

    monkeypatch.setattr(cpu_kernel, "_off", {})  # the kernel, whatever an earlier runner here chose
    plain = load_model("tiny-llama")
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    x = torch.randn(1, 40, plain.config.hidden_size)
    for a, b in zip(plain.get_decoder().layers, fused.get_decoder().layers):
        assert b.mlp.forward is not type(b.mlp).forward
        torch.testing.assert_close(b.mlp(x), a.mlp(x), rtol=1e-5, atol=1e-6)


@needs_cc
def test_exp_is_accurate_under_the_kernels_float_flags(kernels):
    """silu(g) * 1 = g * exp(g) / (1 + exp(g)) for g << 0 carries exp's relative error: the kernels are built
    with associative float math, which must not undo exp's two-part ln2 (that once cost 62 ulps)."""
    g = torch.linspace(-86.0, -8.0, 4096)
    gate_up = torch.cat([g[:, None], torch.ones(4096, 1)], dim=1).reshape(64, 128)  # rows of [gate 64 | up 64]
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    got = kernels.swiglu(gate_up).double().flatten()
    x = gate_up[:, :64].double().flatten()
    want = x / (1 + torch.exp(-x))
    assert ((got - want) / want).abs().max().item() < 4 * 2.0 ** -24  # within 4 ulps


@needs_cc
@pytest.mark.parametrize("width", [256, 40, 7])  # whole vectors, a tail, a tail only
def test_rms_norm_matches_torch(kernels, width):
    torch.manual_seed(width)
    w = torch.rand(width) + 0.5
    x = torch.randn(6, 9, width + 3)[:, :, 3:] * 4  # rows at a stride: read in place, not copied
    got = kernels.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(x, (width,), w, 1e-6), rtol=2e-6, atol=1e-6)
    assert kernels.rms_norm(torch.randn(4, 6, width)[:, ::2].transpose(0, 1), w, 1e-6) is None  # no one row stride
    assert kernels.rms_norm(x.bfloat16(), w, 1e-6) is None  # float32 only: the caller runs torch's op
    assert kernels.rms_norm(torch.randn(width, 3).t(), w, 1e-6) is None  # no unit stride over width
