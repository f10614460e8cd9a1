"""The shared-memory all-reduce of CPU tensor-parallel ranks: every rank gets the same, exact sum (slots
added in rank order), over many calls of varying sizes (the two slot sets alternate safely); a tensor larger
than the slots is left to the caller; a dead peer is an error, not a hang."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pdlab.engine import shm_allreduce
from pdlab.engine.shm_allreduce import ShmAllReduce
from pdlab.kv import shm

pytestmark = pytest.mark.skipif(not shm_allreduce.available(), reason="x86-64 only (relies on its store order)")

RANK = textwrap.dedent("""
    import sys, torch
    from pdlab.engine.shm_allreduce import ShmAllReduce
    name, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ar = ShmAllReduce(name, rank, world, 4096 * 4, create=False, timeout_s=30)
    total = torch.zeros(())
    for i in range(300):
        g = torch.Generator().manual_seed(1000 * i + rank)
        t = torch.randn(1 + (i * 37) % 4096, generator=g)
        assert ar(t)
        total += t.double().sum()
    print(repr(float(total)))
""")


def expected(world: int) -> float:
    total = torch.zeros(())
    for i in range(300):
        n = 1 + (i * 37) % 4096
        s = torch.randn(n, generator=torch.Generator().manual_seed(1000 * i))
        for r in range(1, world):
            s = s + torch.randn(n, generator=torch.Generator().manual_seed(1000 * i + r))
        total += s.double().sum()
    return float(total)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_exact_sum(world):
    name = shm.new_name("test-allreduce")
    owner = ShmAllReduce(name, 0, world, 4096 * 4, create=True, timeout_s=30)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RANK, name, str(r), str(world)], stdout=subprocess.PIPE,
                                  text=True) for r in range(1, world)]
        total = torch.zeros(())
        for i in range(300):
            t = torch.randn(1 + (i * 37) % 4096, generator=torch.Generator().manual_seed(1000 * i))
            assert owner(t)
            total += t.double().sum()
        outs = [float(p.communicate(timeout=60)[0]) for p in procs]
        assert all(p.returncode == 0 for p in procs)
    finally:
        owner.close()
    assert outs == [float(total)] * (world - 1)  # bit-identical on every rank
    assert float(total) == pytest.approx(expected(world), rel=1e-9)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_too_large_is_left_to_the_caller_and_a_dead_peer_is_an_error():
    ar = ShmAllReduce(shm.new_name("test-allreduce"), 0, 2, 64, create=True, alive=lambda: False, timeout_s=5)
    try:
        assert ar(torch.zeros(17)) is False  # 68 bytes > 64: the caller falls back to its group
        with pytest.raises(RuntimeError, match="a rank of the group died"):
            ar(torch.zeros(4))  # rank 1 never arrives, and is reported dead
    finally:
        ar.close()
