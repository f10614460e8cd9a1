"""What GPU workers share, split up front: memory of a shared GPU and host cores (pdlab.serve.sharing), and
the pool budget a worker derives from its share (pdlab.engine.pool_size)."""

import pytest

from pdlab.engine.pool_size import gpu_kv_budget
from pdlab.serve.sharing import host_cores, memory_shares

GiB = 1 << 30


def test_memory_share_is_one_over_the_workers_on_the_most_crowded_gpu():
    assert memory_shares([["0"], ["1"]]) == [1.0, 1.0]
    assert memory_shares([["0"], ["0"]]) == [0.5, 0.5]
    assert memory_shares([["0"], ["0"], ["0", "1"], ["1"]]) == [1 / 3, 1 / 3, 1 / 3, 0.5]
    assert memory_shares([[], []]) == [1.0, 1.0]  # CPU workers


def test_shared_gpu_budgets_add_up_to_the_fraction_whatever_each_saw_free():
    total, fraction, weights = 140 * GiB, 0.9, 2 * GiB
    # both started together and saw the same free memory: each still takes only its half
    a = gpu_kv_budget(free=137 * GiB, total=total, fraction=fraction, share=0.5, weight_bytes=weights)
    b = gpu_kv_budget(free=137 * GiB, total=total, fraction=fraction, share=0.5, weight_bytes=weights)
    assert a == b == int(total * fraction * 0.5) - weights
    assert a + b + 2 * weights <= total * fraction


def test_a_worker_alone_keeps_the_free_memory_rule():
    assert gpu_kv_budget(free=100 * GiB, total=140 * GiB, fraction=0.5, share=1.0, weight_bytes=2 * GiB) == 50 * GiB


def test_budget_never_negative_and_share_checked():
    assert gpu_kv_budget(free=0, total=GiB, fraction=0.1, share=0.25, weight_bytes=GiB) == 0
    with pytest.raises(ValueError, match="share"):
        gpu_kv_budget(free=GiB, total=GiB, fraction=0.5, share=0.0, weight_bytes=0)


def test_host_cores_split_evenly_keeping_the_first_for_the_main_process():
    assert host_cores(range(16), 2) == [tuple(range(1, 9)), tuple(range(9, 16))]
    assert host_cores([0, 1, 2], 2) == [(1,), (2,)]


def test_host_cores_with_too_few_cores_share_them():
    assert host_cores([0, 1], 2) == [(0,), (1,)]  # no core to spare for the main process
    assert host_cores([0, 1], 3) == [(0,), (1,), (0,)]
    assert host_cores([], 2) == [(), ()]
    assert host_cores([0, 1], 0) == []
