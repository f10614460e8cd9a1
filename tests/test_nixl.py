"""The nixl transport: two NIXL agents over UCX moving KV blocks between private (non-shared) pools.

Skipped where NIXL is not installed (`pip install -e '.[nixl]'`); CI installs the extra, so they run there.
"""

import os

import msgpack
import pytest
import torch

from pdlab.fields import RecipeError
from pdlab.kv import shm
from pdlab.kv.pull import PullCopier
from pdlab.kv.push import PushCopier, PushJob
from pdlab.recipe import Deployment
from pdlab.recipe.nixl import NixlConfig, nixl_module, resolve_ucx_tls

needs_nixl = pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed: pip install -e '.[nixl]'")
SHAPE = (3, 2, 16, 4, 2, 8)
DISAGG = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "nixl"}


@pytest.fixture(scope="module")
def pair():
    """A prefill-side and a decode-side transport, each with its own pool, peers opened from msgpack'd handles."""
    from pdlab.kv.factory import make_transport

    before = set(shm.created_names())
    a = make_transport("nixl", "prefill0", "pdlab-test-", options={"ucx_tls": "tcp,sm,self"})
    b = make_transport("nixl", "decode0", "pdlab-test-", options={"ucx_tls": "tcp,sm,self"})
    pa, pb = a.kv_alloc(SHAPE, torch.float32), b.kv_alloc(SHAPE, torch.float32)
    pa.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    assert set(shm.created_names()) == before  # nothing in /dev/shm: the sides share no memory
    wire = lambda t: msgpack.unpackb(msgpack.packb(t.export(), use_bin_type=True), raw=False)  # noqa: E731
    yield a, b, b.open(wire(a)), a.open(wire(b))
    a.close()
    b.close()


@needs_nixl
def test_pull_reads_exactly_the_requested_blocks(pair):
    a, b, a_from_b, _ = pair
    b.pool.zero_()
    n = b.copy(a_from_b, [1, 2, 7], b.pool, [4, 5, 0])
    assert n == 3 * b.pool[:, :, 0].numel() * 4
    for s, d in zip([1, 2, 7], [4, 5, 0]):
        assert torch.equal(b.pool[:, :, d], a.pool[:, :, s])
    assert not b.pool[:, :, [i for i in range(16) if i not in (4, 5, 0)]].any()


@needs_nixl
def test_push_writes_layer_by_layer_into_reserved_blocks(pair):
    a, b, _, b_from_a = pair
    b.pool.zero_()
    for layer in range(SHAPE[0]):
        a.copy(a.pool, [3, 9], b_from_a, [10, 11], layer=layer)
    assert torch.equal(b.pool[:, :, [10, 11]], a.pool[:, :, [3, 9]])
    assert not b.pool[:, :, :10].any()


@needs_nixl
def test_copiers_run_nixl_on_their_threads(pair):
    a, b, a_from_b, b_from_a = pair
    b.pool.zero_()
    puller = PullCopier(b.pool, b.copy)
    assert not puller.cuda  # host-driven: the copy thread, never the loop
    job = puller.submit("r1", a_from_b, [0, 1], [2, 3])
    assert job.done.wait(10) and job.error is None and puller.poll() == [job]
    assert torch.equal(b.pool[:, :, [2, 3]], a.pool[:, :, [0, 1]])
    puller.close()
    pusher = PushCopier(a.pool, a.copy)
    pusher.begin([PushJob("r2", [5, 6], b_from_a, [12, 13])])
    for layer in range(SHAPE[0]):
        pusher.on_layer(layer)
    [done] = pusher.finish(10)
    assert done.error is None and done.bytes == 2 * b.pool[:, :, 0].numel() * 4
    assert torch.equal(b.pool[:, :, [12, 13]], a.pool[:, :, [5, 6]])
    pusher.close()


@needs_nixl
def test_path_names_the_ucx_lanes_actually_selected(pair):
    a, b, _, _ = pair
    path = b.path(a.agent_name)
    assert path.startswith("UCX intra-node ") and "rma" in path and "tcp/" in path, path
    assert b.path("nobody") == "nixl"


@needs_nixl
def test_a_peer_with_another_block_layout_is_refused(pair):
    a, b, _, _ = pair
    h = {**a.export(), "shape": [3, 2, 16, 8, 2, 8], "name": "odd"}
    with pytest.raises(ValueError, match="block layouts differ"):
        b.open(h)


@needs_nixl
def test_recipe_nixl_section_defaults_and_errors():
    d = Deployment.from_raw(DISAGG, "deployment")
    assert d.transport == "nixl" and d.nixl == NixlConfig()
    assert d.to_raw()["nixl"] == {"backends": ["UCX"], "ucx_tls": "auto"}
    d = Deployment.from_raw({**DISAGG, "nixl": {"ucx_tls": "tcp,self"}}, "deployment")
    assert d.nixl.ucx_tls == "tcp,self" and d.nixl.backends == ("UCX",)
    with pytest.raises(RecipeError, match=r"deployment\.nixl\.ucx_tls: expected"):
        Deployment.from_raw({**DISAGG, "nixl": {"ucx_tls": 3}}, "deployment")
    with pytest.raises(RecipeError, match=r"deployment\.nixl\.backend: unknown key \(did you mean 'backends'"):
        Deployment.from_raw({**DISAGG, "nixl": {"backend": ["UCX"]}}, "deployment")
    with pytest.raises(RecipeError, match=r"deployment\.nixl: only for transport: nixl"):
        Deployment.from_raw({**DISAGG, "transport": "shm", "nixl": {}}, "deployment")
    assert "nixl" not in Deployment.from_raw({**DISAGG, "transport": "shm"}, "deployment").to_raw()


def test_nixl_without_the_extra_is_one_recipe_error(monkeypatch):
    import pdlab.recipe.deployment as dep

    monkeypatch.setattr(dep, "nixl_module", lambda: None)
    with pytest.raises(RecipeError, match=r"^deployment\.transport: nixl needs the optional extra.*\[nixl\]"):
        Deployment.from_raw(DISAGG, "deployment")


def test_auto_ucx_tls_is_what_works_here(monkeypatch):
    import pdlab.recipe.nixl as n

    monkeypatch.setattr(n, "rdma_devices", lambda: [])
    assert resolve_ucx_tls("auto", cuda=False) == "tcp,sm,self"
    assert resolve_ucx_tls("auto", cuda=True) == "tcp,sm,self,cuda_copy,cuda_ipc"
    monkeypatch.setattr(n, "rdma_devices", lambda: ["mlx5_0"])
    assert resolve_ucx_tls("auto", cuda=False) == "tcp,sm,self,rc,ud"
    assert resolve_ucx_tls("tcp,self", cuda=True) == "tcp,self"  # explicit: as given
    assert os.environ.get("UCX_TLS") != "auto"


LOG = """[1796024156.49] [vm:3473 :0] ucp_worker.c:1997 UCX  INFO    pdlab-x-decode0 self cfg#0 rma_am(tcp/lo)  am(tcp/lo)
[1796024156.72] [vm:3473 :0] ucp_worker.c:1997 UCX  INFO    pdlab-x-decode0 intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796024156.76] [vm:3473 :1] ucp_worker.c:1997 UCX  INFO    pdlab-x-prefill0 inter-node cfg#1 rma(rc_mlx5/mlx5_0:1)  am(rc_mlx5/mlx5_0:1)
"""


@pytest.mark.parametrize("lanes,tcp", [
    ("intra-node rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)", False),  # bulk by cma
    ("intra-node rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo tcp/eth0) ka(tcp/lo)", True),
    ("inter-node rma(rc_mlx5/mlx5_0:1) am(rc_mlx5/mlx5_0:1)", False),
    ("inter-node rma(tcp/eth0) am(tcp/eth0)", True),
    ("", False),
])
def test_tcp_only_data_lanes_are_the_slow_path(lanes, tcp, monkeypatch):
    from pdlab.kv import nixl_probe
    from pdlab.kv.ucx_log import rma_over_tcp

    assert rma_over_tcp(lanes) is tcp
    monkeypatch.setattr(nixl_probe, "rdma_devices", lambda: [])
    assert nixl_probe.path_warning(lanes).startswith("FALLBACK") is tcp
    assert nixl_probe.path_warning(lanes, same_host=False) == ""  # across nodes without RDMA: TCP is all there is
    monkeypatch.setattr(nixl_probe, "rdma_devices", lambda: ["mlx5_0"])
    assert ("RDMA devices exist (mlx5_0)" in nixl_probe.path_warning(lanes, same_host=False)) is tcp


def test_lanes_are_read_per_agent_from_the_ucx_log(tmp_path):
    from pdlab.kv.ucx_log import read_lanes

    log = tmp_path / "ucx.log"
    log.write_text(LOG)
    assert read_lanes("pdlab-x-decode0", str(log)) == \
        "intra-node rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)"
    assert read_lanes("pdlab-x-prefill0", str(log)) == "inter-node rma(rc_mlx5/mlx5_0:1) am(rc_mlx5/mlx5_0:1)"
    assert read_lanes("pdlab-x-decode", str(log)) is None  # names match whole
    assert read_lanes("x", str(tmp_path / "missing.log")) is None


def test_a_worker_leaves_no_ucx_log_folder_behind(tmp_path):
    """A forked worker ends with os._exit, which runs no atexit hook: the folder its UCX log went to is removed
    on its way out (pdlab.serve.worker calls remove_log_dir), or every run would leave one per worker."""
    import subprocess
    import sys

    from cli_helpers import DEADLINE_S  # against a hang, not a speed bound

    code = ("import os; from pdlab.kv import ucx_log; f = ucx_log.ucx_log_file(); print(os.path.dirname(f)); "
            "ucx_log.remove_log_dir(); ucx_log.remove_log_dir(); os._exit(0)")
    env = {k: v for k, v in os.environ.items() if k != "UCX_LOG_FILE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S,
                       env={**env, "TMPDIR": str(tmp_path)})
    made = r.stdout.strip()
    assert r.returncode == 0 and made.startswith(str(tmp_path)), r.stderr
    assert not os.path.exists(made) and os.listdir(tmp_path) == []


def test_cli_without_nixl_says_how_to_install_it_and_starts_nothing(tmp_path):
    """`pdlab run` where NIXL cannot be found: one line, exit 2, no run directory."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hide = ("import sys, pdlab.recipe.deployment as d; d.nixl_module = lambda: None; "
            "sys.argv = ['pdlab'] + sys.argv[1:]; from pdlab.cli import app; app()")
    out = str(tmp_path / "never")
    r = subprocess.run([sys.executable, "-c", hide, "run", os.path.join(root, "tests", "data", "nixl-recipe.yaml"),
                        "--out", out], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "variants.nixl-pull.deployment.transport: nixl needs the optional extra" in lines[0] \
        and "pip install -e '.[nixl]'" in lines[0], r.stderr
    assert not os.path.exists(out)


@needs_nixl
@pytest.mark.parametrize("a,b", [(1, 2), (2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_groups_of_other_sizes_reslice_heads(a, b, mode):
    """Tensor-parallel groups over NIXL: every destination shard gets exactly its heads of the requested
    blocks, shard to shard where the groups line up and through a staging buffer where they do not."""
    from pdlab.kv.sharded import ShardedPool, shard_heads
    from pdlab.kv.factory import make_transport

    heads, shape = 4, (2, 2, 12, 4, 4, 8)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(a * 10 + b))
    wire = lambda h: msgpack.unpackb(msgpack.packb(h, use_bin_type=True), raw=False)  # noqa: E731

    def group(t, tp, fill):
        per = (*shape[:4], heads // tp, shape[5])
        shards = [t.kv_alloc(per, torch.float32)] + [torch.zeros(per) for _ in range(tp - 1)]
        for r, x in enumerate(shards):
            x.copy_(full[:, :, :, :, shard_heads(heads, tp, r)] if fill else 0)
        for x in shards[1:]:
            t.adopt(x)
        handle = {"kind": "sharded", "name": f"{t.worker}-group", "kv_heads": heads,
                  "shards": [t.export()] + [t.export_shard(x, f"{t.worker}-r{r}") for r, x in enumerate(shards[1:], 1)]}
        return ShardedPool(shards, heads), wire(handle)

    p = make_transport("nixl", f"tp-p{a}{b}{mode}", "pdlab-test-", options={"ucx_tls": "tcp,sm,self"})
    d = make_transport("nixl", f"tp-d{a}{b}{mode}", "pdlab-test-", options={"ucx_tls": "tcp,sm,self"})
    try:
        src, src_handle = group(p, a, True)
        dst, dst_handle = group(d, b, False)
        blocks, into = [1, 2, 7, 8], [4, 5, 0, 11]
        if mode == "pull":
            n = d.copy(d.open(src_handle), blocks, dst, into)
        else:
            peer = p.open(dst_handle)
            n = sum(p.copy(src, blocks, peer, into, layer=layer) for layer in range(shape[0]))
        assert n == len(blocks) * full[:, :, 0].numel() * 4  # every head of every block once
        for r, x in enumerate(dst.shards):
            mine = shard_heads(heads, b, r)
            assert torch.equal(x[:, :, into], full[:, :, blocks][:, :, :, :, mine])
            assert not x[:, :, [i for i in range(shape[2]) if i not in into]].any()
    finally:
        p.close()
        d.close()


@needs_nixl
def test_lanes_ucx_logs_late_are_read_again_after_the_transfers(monkeypatch):
    """On a busy box UCX may log an endpoint's lanes after the connection's deadline: the peer's path says
    they were not logged then, and `path` reads them again once the transfers ran (the doctor's note names
    them; it once said '(lanes not logged)' under a parallel test run)."""
    from pdlab.kv import nixl
    from pdlab.kv.nixl_probe import nixl_pair

    monkeypatch.setattr(nixl, "read_lanes", lambda agent, log_file=None: None)
    with nixl_pair((1, 2, 4, 2, 8, 8), 4, "tcp,sm,self") as (a, b, prefill_pool, _):
        assert nixl.NOT_LOGGED in prefill_pool.path
        b.copy(prefill_pool, [0, 1], b.pool, [2, 3])
        monkeypatch.setattr(nixl, "read_lanes", lambda agent, log_file=None: "intra-node rma_am(tcp/lo) am(sm)")
        path = b.path(prefill_pool.name)
        assert "rma_am(tcp/lo)" in path and nixl.NOT_LOGGED not in path and "UCX_TLS=" in path
        assert prefill_pool.path == path  # kept: read once
