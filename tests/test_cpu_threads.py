"""pdlab.engine.cpu_threads: cuts make contiguous, non-empty runs of sizes within one; the helper pool is made
once and grown, not remade, as calls want more or fewer parts; parts follow the torch threads and the work; run
gives the first error code of its parts (the GEMM split over threads keeps one thread's bits: test_gemm_kernel)."""

import random

import pytest
import torch

from pdlab.engine import cpu_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_cuts_are_contiguous_non_empty_runs_of_sizes_within_one():
    assert cpu_threads.cuts(10, 2) == [0, 5, 10]
    assert cpu_threads.cuts(10, 3) == [0, 3, 6, 10]
    rng = random.Random(0)
    for _ in range(500):
        m = rng.randint(1, 300)
        n = rng.randint(1, min(m, 16))
        c = cpu_threads.cuts(m, n)
        sizes = [b - a for a, b in zip(c, c[1:])]
        assert len(c) == n + 1 and c[0] == 0 and c[-1] == m and min(sizes) >= 1, (m, n, c)
        assert max(sizes) - min(sizes) <= 1, (m, n, c)


def test_the_helper_pool_is_kept_for_fewer_parts_and_grown_for_more(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_pool", None)  # whatever an earlier test made
    two = cpu_threads.pool(2)
    assert cpu_threads.pool(1) is two and cpu_threads.pool(2) is two
    assert cpu_threads.pool(3) is not two


def test_parts_follow_the_torch_threads_and_the_work(threads):
    threads(1)
    assert cpu_threads.parts(1e12, 8) == 1
    threads(3)
    assert cpu_threads.parts(1e12, 8) == 3
    assert cpu_threads.parts(1e12, 2) == 2  # no more parts than items
    assert cpu_threads.parts(cpu_threads.SPLIT_FLOPS / 2, 8) == 1  # too little work to split


def test_run_gives_the_first_error_of_its_parts_after_all_ran():
    ran = []
    assert cpu_threads.run([lambda: ran.append(0), lambda: ran.append(1)]) == 0
    assert sorted(ran) == [0, 1]
    assert cpu_threads.run([lambda: 0, lambda: -1, lambda: 0]) == -1
    assert cpu_threads.run([lambda: None]) == 0
