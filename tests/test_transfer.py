import pytest
import torch

from pdlab.kv import copy, shm
from pdlab.kv.push import PushCopier, PushJob
from pdlab.recipe.nixl import nixl_module
from pdlab.kv.copy import block_bytes, block_runs, copy_blocks
from pdlab.kv.factory import make_transport

SHAPE = (3, 2, 16, 4, 2, 8)


def _pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g)


def test_block_runs():
    assert block_runs([0, 1, 2, 7, 8], [5, 6, 7, 1, 2]) == [(0, 5, 3), (7, 1, 2)]
    assert block_runs([3, 4], [9, 3]) == [(3, 9, 1), (4, 3, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


@pytest.mark.parametrize("torch_runs", [100, 0])  # CPU: torch copies per run, or the numpy path
@pytest.mark.parametrize("src,dst", [
    ([0, 1, 2, 3], [8, 9, 10, 11]),  # one run
    ([5, 2, 9], [0, 7, 3]),  # scattered
    (list(range(0, 16, 2)) + list(range(1, 16, 2)), list(reversed(range(16)))),  # 16 runs
])
def test_copy_blocks_moves_exactly_those_blocks(src, dst, torch_runs, monkeypatch):
    monkeypatch.setattr(copy, "_CPU_TORCH_RUNS", torch_runs)
    a, b = _pool(0), _pool(1)
    before = b.clone()
    n = copy_blocks(a, src, b, dst)
    assert n == len(src) * block_bytes(a)
    for s, d in zip(src, dst):
        assert torch.equal(b[:, :, d], a[:, :, s])
    untouched = [i for i in range(16) if i not in dst]
    assert torch.equal(b[:, :, untouched], before[:, :, untouched])


def test_copy_one_layer_at_a_time_equals_whole_copy():
    a = _pool(0)
    whole, layered = torch.zeros(SHAPE), torch.zeros(SHAPE)
    copy_blocks(a, [1, 2, 6], whole, [3, 4, 0])
    for layer in range(SHAPE[0]):
        copy_blocks(a, [1, 2, 6], layered, [3, 4, 0], layer=layer)
    assert torch.equal(whole, layered)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_half_dtypes_bit_exact(dtype, monkeypatch):
    monkeypatch.setattr(copy, "_CPU_TORCH_RUNS", 0)
    a, b = _pool(0).to(dtype), torch.zeros(SHAPE, dtype=dtype)
    copy_blocks(a, [3, 1], b, [0, 9], layer=1)
    assert torch.equal(b[1, :, [0, 9]], a[1, :, [3, 1]]) and not b[0].any()


def test_copy_rejects_mismatched_pools():
    with pytest.raises(ValueError, match="shapes"):
        copy_blocks(torch.zeros(2, 2, 4, 4, 2, 8), [0], torch.zeros(3, 2, 4, 4, 2, 8), [0])
    with pytest.raises(ValueError, match="dtypes"):
        copy_blocks(torch.zeros(SHAPE), [0], torch.zeros(SHAPE, dtype=torch.float16), [0])


def test_shm_transport_export_open_round_trip():
    prefix = shm.new_name("tt") + "-"
    p = make_transport("shm", "prefill0", prefix)
    d = make_transport("shm", "decode0", prefix)
    try:
        pool_p = p.kv_alloc(SHAPE, torch.float32)
        pool_d = d.kv_alloc(SHAPE, torch.float32)
        pool_p.copy_(_pool(3))
        h = p.export()
        assert h["kind"] == "shm" and h["name"].startswith(prefix)
        # pull: decode reads prefill's pool
        copy_blocks(d.open(h), [4, 5], pool_d, [0, 1])
        assert torch.equal(pool_d[:, :, :2], pool_p[:, :, 4:6])
        # push: prefill writes decode's pool
        peer = p.open(d.export())
        copy_blocks(pool_p, [7], peer, [9])
        assert torch.equal(pool_d[:, :, 9], pool_p[:, :, 7])
        assert d.open(h) is d.open(h)  # mapped once
    finally:
        p.close()
        d.close()
    assert shm.sweep(prefix) == []  # close unlinked both


def test_unknown_transport():
    with pytest.raises(ValueError, match="not available"):
        make_transport("carrier-pigeon", "x", "pdlab-x-")


def test_push_copier_copies_every_layer():
    src, dst = _pool(0), torch.zeros(SHAPE)
    cp = PushCopier(src)
    try:
        job = PushJob("r1", [2, 3, 4], dst, [10, 11, 12])
        cp.begin([job])
        for layer in range(SHAPE[0]):
            cp.on_layer(layer)
        (done,) = cp.finish(timeout=10)
        assert done.error is None and done.bytes == 3 * block_bytes(src)
        assert done.end >= done.start > 0
        assert torch.equal(dst[:, :, 10:13], src[:, :, 2:5])
        cp.begin([])  # a step with nothing to push
        cp.on_layer(0)
        assert cp.finish(timeout=1) == []
    finally:
        cp.close()


def test_push_copier_reports_a_step_that_never_ran():
    cp = PushCopier(_pool(0))
    try:
        cp.begin([PushJob("r1", [0], torch.zeros(SHAPE), [0])])
        (job,) = cp.finish(timeout=0.1)
        assert "did not finish" in job.error
    finally:
        cp.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_and_host_in_process():
    from pdlab.kv.cuda_ipc import CudaIpcTransport
    from pdlab.kv.host import HostTransport

    t = CudaIpcTransport("p", "cuda:0", [0])
    pool = t.kv_alloc(SHAPE, torch.float16)
    h = t.export()
    assert h["kind"] == "cuda-ipc" and isinstance(h["handle"], bytes)
    host = HostTransport("d", "cuda:0", shm.new_name("host"))
    try:
        hp = host.kv_alloc(SHAPE, torch.float16)
        pool.normal_()
        copy_blocks(pool, [1, 2], host.exchange(), [5, 6], non_blocking=True)
        torch.cuda.synchronize()
        host.stage_in([5, 6])
        assert torch.equal(hp[:, :, 5:7], pool[:, :, 1:3])
    finally:
        host.close()


def test_doctor_reports_every_transport():
    """`pdlab doctor --json --probe-mb 0.5` in a process of its own, as a user runs it: UCX reads its log file
    and level once per process, when it loads (pdlab.kv.ucx_log), so in a test process where an earlier test
    loaded UCX the lanes it selects may never reach the doctor's log (the note then said '(lanes not logged)',
    depending on which test files xdist gave that process first)."""
    import json
    import os
    import subprocess
    import sys

    from cli_helpers import DEADLINE_S  # against a hang, not a speed bound

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_LOG")}
    p = subprocess.run([sys.executable, "-m", "pdlab.cli", "doctor", "--json", "--probe-mb", "0.5"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    probes = {p["transport"]: p for p in report["probes"]}
    assert probes["shm"]["available"] and probes["shm"]["handover_gbps"] > 0 and probes["shm"]["baseline_gbps"] > 0
    nixl = probes["nixl"]
    if nixl_module() is None:
        assert nixl["available"] is False and "pip install" in nixl["note"]
    else:  # measured, with the UCX lanes it took; TCP loopback on one node is flagged, never silent
        assert nixl["available"] and nixl["handover_gbps"] > 0 and nixl["baseline_gbps"] > 0, nixl
        assert "rma" in nixl["note"] and "UCX_TLS=" in nixl["note"]
        from pdlab.kv.ucx_log import rma_over_tcp

        assert ("FALLBACK" in nixl["note"]) == rma_over_tcp(nixl["note"].split(";")[0])
    if not torch.cuda.is_available():
        assert "no CUDA" in probes["cuda-ipc"]["note"] and "no CUDA" in probes["host"]["note"]
    assert report["cpu"]["cores"] >= 1
    kernels = report["cpu"]["kernels"]  # what a cpu-demo worker would run here, and why
    assert set(kernels["choices"]) == {"decode_attention", "prefill_attention", "rotary", "swiglu", "rms_norm"}
    assert all(c["line"].startswith(("kernel: ", "torch: ")) for c in kernels["choices"].values())
