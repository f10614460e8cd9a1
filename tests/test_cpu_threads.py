"""pdlab.engine.cpu_threads: a kernel call is split into one part per torch thread where the work is big enough,
and into none where the process holds two OpenMP runtimes; the threaded kernels' builds share torch's runtime,
so a process that loaded them holds one. (That a split keeps one thread's bits: test_gemm_kernel and
test_cpu_kernel.)"""

import pytest
import torch

from pdlab.engine import cpu_threads, gemm_kernel


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_parts_follow_the_torch_threads_and_the_work(threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "one_runtime", lambda: True)
    threads(1)
    assert cpu_threads.parts(1e12, 8) == 1
    threads(3)
    assert cpu_threads.parts(1e12, 8) == 3
    assert cpu_threads.parts(1e12, 2) == 2  # no more parts than items
    assert cpu_threads.parts(cpu_threads.SPLIT_FLOPS / 2, 8) == 1  # too little work to split
    assert cpu_threads.parts(1e12, 0) == 1


def test_with_two_openmp_runtimes_nothing_is_split(threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "one_runtime", lambda: False)
    threads(3)
    assert cpu_threads.parts(1e12, 8) == 1


def test_the_runtimes_are_read_from_the_process_maps(tmp_path):
    gomp, iomp = tmp_path / "libgomp.so.1", tmp_path / "libiomp5.so"
    for f in (gomp, iomp):
        f.write_text("")
    lines = [f"7f00-7f10 r-xp 00000000 08:01 42 {gomp}", f"7f10-7f20 r--p 00010000 08:01 42 {gomp}",
             "7f20-7f30 r-xp 00000000 08:01 43 /usr/lib/libc.so.6", "7f30-7f40 rw-p 00000000 00:00 0",
             "7f40-7f50 rw-p 00000000 00:00 0 [heap]"]
    maps = tmp_path / "maps"
    maps.write_text("\n".join(lines) + "\n")
    assert cpu_threads.openmp_runtimes(str(maps)) == {str(gomp)}
    maps.write_text("\n".join(lines + [f"7f50-7f60 r-xp 00000000 08:01 44 {iomp}"]) + "\n")
    assert cpu_threads.openmp_runtimes(str(maps)) == {str(gomp), str(iomp)}


def test_an_unreadable_map_means_no_split(monkeypatch):
    def unreadable(maps="/proc/self/maps"):
        raise OSError("no /proc")

    monkeypatch.setattr(cpu_threads, "openmp_runtimes", unreadable)
    monkeypatch.setattr(cpu_threads, "_one_runtime", None)
    assert cpu_threads.one_runtime() is False


@pytest.mark.skipif(gemm_kernel.load() is None, reason="no gemm kernel built here")
def test_the_threaded_kernels_run_on_torchs_own_openmp_runtime():
    """After torch and the GEMM's build are loaded the process holds one OpenMP runtime (or none, for a build
    without OpenMP on a torch without it): the build did not bring a second one whose threads would spin
    against torch's."""
    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's threads started
    assert len(cpu_threads.openmp_runtimes()) <= 1, cpu_threads.openmp_runtimes()
