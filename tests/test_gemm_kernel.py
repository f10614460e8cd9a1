"""pdlab.engine.gemm_kernel (csrc/gemm.c): x W^T + bias within float rounding of a float64 product, for any
row count, width and depth; a row's bits do not depend on the rows computed with it, where it lands in a tile
or row block, or the row stride; the generic C path (no AVX2) gives the AVX2 path's bits."""

import ctypes
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from pdlab.engine import cpu_threads, gemm_kernel
from pdlab.engine.kernel_build import build, cpu_flags, open_kernel

pytestmark = pytest.mark.skipif(gemm_kernel.load() is None, reason=f"no gemm kernel: {gemm_kernel.error()}")

ROW_BLOCK = 120  # csrc/gemm.c's rows packed at a time: the tests cross it


def weights(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), (torch.randn(n, generator=g) if bias else None), g


@pytest.mark.parametrize("n,k", [(96, 64), (100, 37), (16, 1), (5, 300), (1, 8), (530, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_it_is_the_product_to_float_rounding(n, k, bias):
    w, b, g = weights(n, k, bias)
    p = gemm_kernel.Panels(w, b)
    for rows in (1, 2, 5, 6, 7, 13, ROW_BLOCK + 1, 250):
        x = torch.randn(rows, k, generator=g)
        y = p(x)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert y.shape == (rows, n) and y.is_contiguous()
        scale = float(ref.abs().max())
        assert float((y.double() - ref).abs().max()) <= 1e-6 * max(k, 16) ** 0.5 * scale, rows


def test_a_row_has_the_same_bits_alone_in_a_batch_or_a_prefill_and_at_any_stride():
    w, b, g = weights(200, 96, True)
    p = gemm_kernel.Panels(w, b)
    x = torch.randn(300, 96, generator=g)
    everything = p(x)
    for start, rows in [(0, 1), (3, 1), (5, 2), (7, 32), (119, 3), (100, 150), (0, 300)]:
        assert torch.equal(p(x[start:start + rows]), everything[start:start + rows]), (start, rows)
    wide = torch.randn(300, 160, generator=g)
    wide[:, 20:116] = x
    strided = wide[:, 20:116]  # rows 160 floats apart
    assert strided.stride(0) == 160 and torch.equal(p(strided), everything)


def test_no_rows_give_no_rows_and_a_wrong_width_is_refused():
    w, b, _ = weights(48, 32, True)
    p = gemm_kernel.Panels(w, b)
    assert p(torch.empty(0, 32)).shape == (0, 48)
    with pytest.raises(ValueError, match="does not fit"):
        p(torch.randn(4, 31))
    with pytest.raises(ValueError, match="does not fit"):
        p(torch.randn(4, 32, dtype=torch.float64))


def test_every_target_builds_without_warnings(tmp_path, monkeypatch):
    """Its own CPU's path, AVX2 with FMA and plain C, with -Werror, with OpenMP where the compiler has it and
    without (the other compilers: test_cpu_kernel)."""
    monkeypatch.setenv("PDLAB_KERNEL_CACHE", str(tmp_path))
    flags = set(cpu_flags().split())
    targets = ["native"] + (["x86-64-v3"] if {"avx2", "fma"} <= flags else []) + (["x86-64"] if "sse2" in flags else [])
    for target in targets:
        assert gemm_kernel.function(open_kernel("gemm", target, werror=True)[0]), target
        assert gemm_kernel.function(ctypes.CDLL(build("gemm", target, werror=True, openmp=False))), target


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="the generic build is tested on x86-64 with a C compiler")
def test_the_generic_path_has_the_vector_paths_bits():
    """Built for plain x86-64 (no AVX2, no FMA) the kernel runs its C loops with fmaf: each term one fused
    multiply-add in the same order, so the same bits as the AVX2 tiles, only slower."""
    generic = gemm_kernel.function(open_kernel("gemm", "x86-64")[0])
    w, b, g = weights(70, 45, True)
    p = gemm_kernel.Panels(w, b)
    for rows in (1, 19):  # one row (four panels at a time on AVX2) and tiles of six with one over
        x = torch.randn(rows, 45, generator=g)
        assert torch.equal(p(x, generic), p(x)), rows


def test_a_product_split_over_threads_has_the_bits_of_one_thread(monkeypatch):
    """With more torch threads a big product is split by panels over torch's OpenMP threads; every panel is
    computed as it would be on one, so the bits do not change with the number of parts, at one row (four panels
    at a time), in tiles and across row blocks, with the last panel part-filled and parts of no panel."""
    w, b, g = weights(1000, 256, True)  # 63 panels, the last of 8 columns
    p = gemm_kernel.Panels(w, b)
    for rows in (1, 40, ROW_BLOCK + 7):
        x = torch.randn(rows, 256, generator=g)
        monkeypatch.setattr(cpu_threads, "parts", lambda flops, most: 1)
        one = p(x)
        for n in (2, 3, 5, 64, 70):  # more parts than panels: the extra ones have nothing to do
            monkeypatch.setattr(cpu_threads, "parts", lambda flops, most, n=n: n)
            assert torch.equal(p(x), one), (rows, n)
        monkeypatch.undo()
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(3)  # the split the engine makes
            split = cpu_threads.parts(2.0 * rows * 256 * 1000, 63)
            assert split > 1 or rows == 1 or not cpu_threads.one_runtime(), split
            assert torch.equal(p(x), one), rows
        finally:
            torch.set_num_threads(before)
