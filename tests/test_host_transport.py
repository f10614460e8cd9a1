"""The `host` transport between CPU workers: private pools beside shared mirrors, the same stage-out (pull,
prefill side) and stage-in (push, decode side) code the GPU path runs. Pull and push give the tokens of one
in-process engine; a push whose stage-in is skipped decodes from stale blocks and does not (the regression
of 3bc3b94, where admission moved to serve/intake.py and lost the stage-in)."""

import os
import time

import pytest
import torch

import engine_helpers as eh
from proc_helpers import segments_with
from pdlab.engine.config import EngineConfig
from pdlab.kv import shm
from pdlab.kv.host import HostTransport
from pdlab.kv.copy import copy_blocks
from pdlab.recipe import Deployment, ModelSpec, RecipeError
from pdlab.serve.cluster import Cluster, RequestDone, TransferEvent

ENGINE = {"block_size": 8, "kv_blocks": 64, "token_budget": 256, "max_running": 16}
PREFIX = eh.prompts([24], seed=11)[0]
PROMPTS = {"a": eh.prompts([5], seed=1)[0], "b": eh.prompts([37], seed=2)[0], "c": PREFIX + eh.prompts([9], seed=3)[0],
           "d": PREFIX + eh.prompts([14], seed=4)[0]}  # d follows c: the decode side holds 3 of its blocks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    out = {}
    for rid, p in PROMPTS.items():
        eng = eh.engine("tiny-llama", prefix_caching=False, kv_blocks=64, block_size=8)
        got, _ = eh.run(eng, [p], max_tokens=MAX_TOKENS)
        out[rid] = got["0"]
    return out


def test_the_mirror_is_private_pool_plus_shared_copy():
    shape = (2, 2, 6, 4, 2, 8)
    t = HostTransport("d", "cpu", shm.new_name("hosttest"))
    try:
        pool = t.kv_alloc(shape, torch.float32)
        assert pool.data_ptr() != t.exchange().data_ptr()
        peer = t.open(t.export())  # what a peer maps: the mirror, not the pool
        src = torch.randn(shape)
        copy_blocks(src, [1, 2], peer, [4, 5])
        assert not torch.equal(pool[:, :, 4:6], src[:, :, 1:3]), "a peer wrote the private pool"
        t.stage_in([4, 5])
        assert torch.equal(pool[:, :, 4:6], src[:, :, 1:3])
        pool[:, :, 0].fill_(7.0)
        t.stage_out([0])
        assert torch.equal(peer[:, :, 0], pool[:, :, 0])
    finally:
        t.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, t.segment_name))


def test_a_recipe_may_ask_for_host_on_cpu_but_not_cuda_ipc():
    raw = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}}
    assert Deployment.from_raw({**raw, "transport": "host"}, "deployment").transport == "host"
    with pytest.raises(RecipeError, match="cuda-ipc does not move cpu pools; use shm or host or nixl"):
        Deployment.from_raw({**raw, "transport": "cuda-ipc"}, "deployment")


def serve(mode: str, monkeypatch=None) -> dict:
    dep = Deployment.from_raw({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                               "transport": "host", "mode": mode}, "deployment")
    c = Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"), EngineConfig.from_raw(ENGINE, "engine"), dep)
    done, transfers = {}, []
    try:
        c.start()
        for group in (("a", "b", "c"), ("d",)):
            for rid in group:
                c.submit(rid, PROMPTS[rid], {"max_tokens": MAX_TOKENS, "ignore_eos": True})
            deadline = time.monotonic() + 120
            while not set(group) <= set(done):
                assert time.monotonic() < deadline, f"not done: {set(group) - set(done)}"
                for e in c.poll(0.5):
                    if isinstance(e, RequestDone):
                        done[e.req_id] = e
                    elif isinstance(e, TransferEvent):
                        transfers.append(e.record)
        stats = c.kv_stats()
    finally:
        c.stop()
    assert all(s.free_blocks == s.total_blocks and not s.leak for s in stats.values())
    assert not segments_with([c.run_prefix])
    assert {r["transport"] for r in transfers} == {"host"} and {r["mode"] for r in transfers} == {mode}
    return done


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_host_pull_and_push_between_cpu_workers_match_the_engine(mode, reference):
    done = serve(mode)
    for rid, d in done.items():
        assert d.ok, d.error
        assert d.output_ids == reference[rid], rid


@pytest.mark.slow
def test_push_without_the_stage_in_decodes_stale_blocks(reference, tmp_path, monkeypatch):
    """The check can fail: with HostTransport.stage_in a no-op in the workers (what main did), push decodes
    from a pool nobody wrote and the tokens differ."""
    hook = tmp_path / "sitecustomize.py"
    hook.write_text("from pdlab.kv.host import HostTransport\nHostTransport.stage_in = lambda self, blocks: None\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PDLAB_WORKER_START", "spawn")  # a fork of the fork server would not run sitecustomize
    done = serve("push")
    assert any(d.output_ids != reference[rid] for rid, d in done.items() if d.ok)
