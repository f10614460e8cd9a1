"""GPU inventory and placement, on a CPU box: CUDA_VISIBLE_DEVICES entries (indices, UUIDs, MIG), the device
of each tensor-parallel rank, the peer-access check for cuda-ipc, and what GPU workers share. NVML and the
machine's cores are replaced by fakes."""

import pytest

from pdlab import gpus
from pdlab.recipe.deployment import Deployment
from pdlab.serve import topology
from pdlab.serve.topology import ClusterError, place

UUID_A = "GPU-8f3c1a2b-0000-1111-2222-333344445555"
MIG_B = "MIG-1b2a3c4d-aaaa-bbbb-cccc-ddddeeeeffff"


def test_unset_means_every_gpu_by_index():
    assert gpus.visible_entries(None, 3) == ["0", "1", "2"]


def test_uuid_and_mig_entries_are_kept_as_given():
    env = f"2, {UUID_A},{MIG_B}"
    assert gpus.visible_entries(env, 4) == ["2", UUID_A, MIG_B]


def test_the_first_invalid_entry_ends_the_list_as_in_cuda():
    assert gpus.visible_entries("1,7,0", 4) == ["1"]  # 7 is out of range: 0 is not visible either
    assert gpus.visible_entries("0,bogus,1", 4) == ["0"]
    assert gpus.visible_entries("1,1", 4) == ["1"]
    assert gpus.visible_entries("", 4) == []  # empty: no GPU


def test_each_rank_computes_on_its_own_gpu():
    visible = ("3", UUID_A, "5")  # the worker's own GPUs first, in rank order, then a peer's
    assert [gpus.rank_device(visible, r) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert gpus.rank_device((), 0) == "cpu"
    with pytest.raises(ValueError, match="rank 3"):
        gpus.rank_device(visible, 3)


def _deployment(raw: dict) -> Deployment:
    return Deployment.from_raw(raw, "deployment")


@pytest.fixture
def machine(monkeypatch):
    """A node whose process sees four GPUs by UUID/index and has 9 cores."""
    entries = [UUID_A, "1", "2", "3"]
    monkeypatch.setattr(topology, "gpu_ids", lambda: list(entries))
    monkeypatch.setattr(topology, "cpu_cores", lambda: list(range(9)))
    return entries


def test_placement_passes_uuid_entries_and_own_gpus_first(machine):
    d = _deployment({"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:2"]}, "transport": "cuda-ipc"})
    p = {x.worker.name: x for x in place(d, peer_access=lambda a, b: True)}
    assert p["prefill0"].visible_gpus == (UUID_A, "2")  # the peer's GPU after its own: to open its pool
    assert p["decode0"].visible_gpus == ("2", UUID_A)
    tp = place(_deployment({"unified": {"devices": ["cuda:3,0"], "tp": 2}}))
    assert tp[0].visible_gpus == ("3", UUID_A)  # rank 0 on cuda:3 (visible 0), rank 1 on cuda:0 (visible 1)


def test_cuda_ipc_without_peer_access_is_refused(machine):
    d = _deployment({"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:1"]}, "transport": "cuda-ipc"})
    matrix = {frozenset((UUID_A, "1")): False}
    with pytest.raises(ClusterError, match="no peer access.*transport: host"):
        place(d, peer_access=lambda a, b: matrix.get(frozenset((a, b)), True))
    with pytest.raises(ClusterError, match="no peer access"):  # NVML cannot tell: refused too
        place(d, peer_access=lambda a, b: None)
    host = _deployment({"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:1"]}, "transport": "host"})
    assert len(place(host, peer_access=lambda a, b: False)) == 2  # the host transport needs no peer access


def test_one_gpu_shared_needs_no_peer_access_and_halves_memory(machine):
    d = _deployment({"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:0"]}, "transport": "cuda-ipc",
                     "share_devices": True})
    asked = []
    p = place(d, peer_access=lambda a, b: asked.append((a, b)) or False)
    assert asked == []  # same GPU: nothing to ask
    assert [x.memory_share for x in p] == [0.5, 0.5]
    assert [x.visible_gpus for x in p] == [(UUID_A,), (UUID_A,)]


def test_gpu_workers_get_disjoint_host_cores(machine):
    d = _deployment({"unified": {"replicas": 4, "devices": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}})
    p = place(d)
    assert [x.host_cores for x in p] == [(1, 2), (3, 4), (5, 6), (7, 8)]  # core 0 left to the main process
    assert [x.memory_share for x in p] == [1.0] * 4


def test_cpu_workers_are_placed_as_before(monkeypatch):
    monkeypatch.setattr(topology, "cpu_cores", lambda: [0, 1])
    p = place(_deployment({"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}))
    assert [(x.visible_gpus, x.host_cores, x.memory_share) for x in p] == [((), (), 1.0)] * 2


def test_worker_spec_carries_gpu_entries_shares_cores_and_peers_through_spawn():
    import json

    from pdlab.engine.config import EngineConfig
    from pdlab.recipe.model import ModelSpec
    from pdlab.serve.spec import WorkerSpec

    spec = WorkerSpec("decode0", "decode", ("cuda:1",), "ipc:///x", ModelSpec.from_raw({"preset": "tiny-llama"}, "m"),
                      EngineConfig(), 0, "cuda-ipc", "pull", "pdlab-x-", "decode", (MIG_B, UUID_A), 30.0,
                      memory_share=0.5, host_cores=(3, 4), peers=("prefill0", "prefill1"))
    back = WorkerSpec.from_raw(json.loads(json.dumps(spec.to_raw())))  # plain data, as spawned
    assert back == spec
    assert back.visible_gpus == (MIG_B, UUID_A) and back.host_cores == (3, 4) and back.memory_share == 0.5


def test_main_process_keeps_the_core_gpu_workers_leave_it(monkeypatch):
    from pdlab.harness import worker_cores
    from pdlab.recipe import parse_recipe

    monkeypatch.setattr(topology, "cpu_cores", lambda: list(range(8)))
    raw = {"name": "g", "model": {"preset": "tiny-llama"}, "rates": [1],
           "variants": {"d": {"deployment": {"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:0"]},
                                             "share_devices": True}}}}
    assert worker_cores(parse_recipe(raw)) == set(range(1, 8))  # core 0 is the main process's
