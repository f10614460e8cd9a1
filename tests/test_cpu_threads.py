"""pdlab.engine.cpu_threads: cuts make contiguous, non-empty runs of about equal weight; parts follow the
torch threads and the work; run gives the first error code of its parts (the GEMM split over threads keeps one
thread's bits: test_gemm_kernel)."""

import random

import pytest
import torch

from pdlab.engine import cpu_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_cuts_are_contiguous_non_empty_runs_of_about_equal_weight():
    assert cpu_threads.cuts([1] * 10, 2) == [0, 5, 10]
    assert cpu_threads.cuts([100, 1, 1, 1], 2) == [0, 1, 4]  # one heavy item is a run of its own
    assert cpu_threads.cuts([0, 0, 0], 2) in ([0, 1, 3], [0, 2, 3])
    rng = random.Random(0)
    for _ in range(500):
        m = rng.randint(1, 30)
        n = rng.randint(1, m)
        w = [rng.randint(0, 50) for _ in range(m)]
        c = cpu_threads.cuts(w, n)
        assert len(c) == n + 1 and c[0] == 0 and c[-1] == m and all(a < b for a, b in zip(c, c[1:])), (w, n, c)
        heaviest = max(w) if w else 0
        assert all(sum(w[a:b]) <= sum(w) / n + heaviest for a, b in zip(c, c[1:])), (w, n, c)


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
