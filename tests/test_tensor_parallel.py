"""Tensor parallelism inside a worker (issue 9, item 1): a unified worker on `cpu:0-1` with `tp: 2` runs one
rank per core, each with half the heads, half the MLP and its half of the KV pool, and gives the tokens of
one unsharded engine (and of transformers' generate), for a preset and for a saved model directory; a worker
never computes silently on the first of several devices; KV handed between groups of other sizes (shm and
nixl) gives the same tokens; killing one rank ends the run like any worker death, with nothing left behind."""

import os
import signal
import time

import pytest

import engine_helpers as eh
from pdlab.engine.tensor_parallel import describe_step, read_step
from pdlab.engine.tp_plan import shard_heads, tp_error
from pdlab.recipe import RecipeError, parse_recipe
from pdlab.recipe.nixl import nixl_module
from pdlab.serve.cluster import RequestDone, TokenEvent, WorkerFailed
from proc_helpers import ours
from test_cluster import Cluster, _drain, _no_leftovers

ENGINE = {"block_size": 8, "kv_blocks": 48, "token_budget": 24, "max_running": 16, "chunked_prefill": True,
          "prefix_caching": True}
TP2 = {"unified": {"devices": ["cpu:0-1"], "tp": 2}}
BASE = {"model": {"preset": "tiny-llama"}, "rates": [1], "variants": {}}


def test_what_splits_over_tp_ranks():
    assert tp_error(heads=4, kv_heads=2, intermediate=128, tp=2) is None
    assert tp_error(heads=4, kv_heads=2, intermediate=128, tp=4) is None  # KV heads replicated, as vLLM
    assert len(shard_heads(2, 4, 0)) == 1 and len(shard_heads(8, 2, 1)) == 4
    assert tp_error(4, 2, 128, 3) == "4 attention heads do not split over tp 3"
    assert tp_error(8, 6, 128, 4) == "6 KV heads do not split over tp 4"
    assert tp_error(8, 3, 128, 8) == "3 KV heads cannot be replicated evenly over tp 8"
    assert tp_error(4, 4, 130, 4) == "MLP width 130 does not split over tp 4"


def test_a_step_description_round_trips_as_plain_data():
    class S:  # what the runner reads of a Sequence
        def __init__(self, computed, table, toks, out):
            self.num_computed, self.block_table, self.contiguous, self.output_ids = computed, table, True, out
            self._toks = toks
            self.num_tokens = len(toks) + len(out)

        def tokens(self, a, b):
            return self._toks[a:b]

    seqs = [S(0, [3, 4, 9], list(range(20)), []), S(20, [5, 6, 7], list(range(20)), [42])]
    views, ns, ds = read_step(describe_step(seqs, [10, 1], [False, True], block_size=8))
    assert (ns, ds) == ([10, 1], [False, True])
    assert views[0].tokens(0, 10) == list(range(10)) and views[0].block_table == [3, 4]  # what the chunk needs
    assert views[1].output_ids[-1] == 42 and views[1].num_computed == 20 and views[1].block_table == [5, 6, 7]


@pytest.mark.parametrize("dep,msg", [
    ({"unified": {"devices": ["cpu:0-1"]}}, "each worker has 2 device(s) (cpu:0-1) but tp is 1"),
    ({"unified": {"devices": ["cpu:0"], "tp": 2}}, "each worker has 1 device(s) (cpu:0) but tp is 2"),
    ({"unified": {"replicas": 2, "devices": ["cpu:0-3"], "tp": 4}}, "each worker has 2 device(s)"),
    ({"prefill": {"devices": ["cuda:0-1"], "tp": 2}, "decode": {"devices": ["cuda:2"]}},
     "prefill.tp: a hand-over between tensor-parallel workers is built not yet for cuda workers (not cuda-ipc)"),
])
def test_devices_per_worker_must_equal_tp(dep, msg):
    with pytest.raises(RecipeError, match="variants.v.deployment") as e:
        parse_recipe(dict(BASE, variants={"v": {"deployment": dep}}))
    assert msg in str(e.value)
    ok = parse_recipe(dict(BASE, variants={"v": {"deployment": TP2}})).resolved("v").deployment
    assert ok.workers[0].devices == ("cpu:0", "cpu:1") and ok.workers[0].tp == 2


def _followers() -> list[int]:
    """Live follower processes (ranks 1..) of any worker this test process started."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and ours(int(pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"pdlab.serve.tensor_group" in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def _rounds() -> tuple[dict, dict]:
    """Round 1 runs together (chunked: the budget of 24 is below the long prompts); round 2 shares a prefix
    with nothing of round 1 but with itself, so the prefix cache serves part of it."""
    prefix = eh.prompts([32], seed=7)[0]
    round1 = {f"a{i}": p for i, p in enumerate(eh.prompts([5, 23, 40, 17], seed=1))}
    round2 = {f"b{i}": prefix + p for i, p in enumerate(eh.prompts([4, 13], seed=5))}
    return round1, round2


def _one_engine(preset: str, reqs: dict) -> dict:
    """Each request's greedy tokens from one unsharded in-process engine."""
    ref = eh.engine(preset, **ENGINE)
    return {rid: eh.run(ref, [p], max_tokens=8)[0]["0"] for rid, p in reqs.items()}


def _serve_rounds(c, rounds: tuple[dict, ...], want: dict) -> list:
    """Serve each round to the end, check every request's tokens; returns the transfer events."""
    transfers = []
    for rnd in rounds:
        for rid, p in rnd.items():
            c.submit(rid, p, {"max_tokens": 8, "ignore_eos": True})
        done, _, other = _drain(c, list(rnd))
        transfers += [e for e in other if type(e).__name__ == "TransferEvent"]
        for rid, d in done.items():
            assert d.ok, d.error
            assert d.output_ids == want[rid], rid
    return transfers


@pytest.mark.slow
# qwen3: per-head q/k norms, replicated; saved: tiny-llama's weights written by save_pretrained and loaded
# from that directory by every rank (tiny-llama as a preset is the TP side of the a->b tests below)
@pytest.mark.parametrize("model", ["tiny-qwen3", "saved"])
def test_tp2_matches_one_engine_and_transformers(model, tmp_path):
    preset = "tiny-llama" if model == "saved" else model
    spec = {"preset": preset}
    if model == "saved":
        eh.reference(preset).save_pretrained(tmp_path)
        spec = {"path": str(tmp_path)}
    round1, round2 = _rounds()
    want = _one_engine(preset, {**round1, **round2})
    for rid in ("a1", "b0"):  # and the unsharded engine is transformers' greedy
        assert want[rid] == eh.hf_greedy(eh.reference(preset), {**round1, **round2}[rid], 8)
    c = Cluster(spec, ENGINE, TP2)
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        assert len(_followers()) == 1
        _serve_rounds(c, (round1, round2), want)
        stats = c.kv_stats()
    finally:
        c.stop()
    assert all(s.free_blocks == s.total_blocks for s in stats.values())  # no leaked blocks
    assert _followers() == []
    _no_leftovers(pids, c.run_prefix)


HETERO = [pytest.param({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:0-1"], "tp": 2},
                        "mode": mode, "share_devices": True}, id=f"1to2-{mode}") for mode in ("pull", "push")] + [
          pytest.param({"prefill": {"devices": ["cpu:0-1"], "tp": 2}, "decode": {"devices": ["cpu:1"]},
                        "mode": mode, "share_devices": True}, id=f"2to1-{mode}") for mode in ("pull", "push")]
NIXL = {"transport": "nixl", "nixl": {"ucx_tls": "tcp,sm,self"}}
needs_nixl = pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed: pip install -e '.[nixl]'")
# over NIXL: re-sliced through a staging buffer (1->2 pull, 2->1 push) and shard to shard (2->2)
HETERO += [pytest.param({**NIXL, "prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:0-1"], "tp": 2},
                         "mode": "pull", "share_devices": True}, id="nixl-1to2-pull", marks=needs_nixl),
           pytest.param({**NIXL, "prefill": {"devices": ["cpu:0-1"], "tp": 2}, "decode": {"devices": ["cpu:1"]},
                         "mode": "push", "share_devices": True}, id="nixl-2to1-push", marks=needs_nixl),
           pytest.param({**NIXL, "prefill": {"devices": ["cpu:0-1"], "tp": 2},
                         "decode": {"devices": ["cpu:0-1"], "tp": 2}, "mode": "push", "share_devices": True},
                        id="nixl-2to2-push", marks=needs_nixl)]


@pytest.mark.slow
@pytest.mark.parametrize("dep", HETERO)
def test_disaggregated_tp_a_to_b_matches_one_engine(dep):
    """KV handed from P with TP a to D with TP b (heads re-sliced in the copy) gives one engine's tokens,
    with chunked prefill and the prefix cache on (round 2 reuses blocks the decode side holds)."""
    round1, round2 = _rounds()
    want = _one_engine("tiny-llama", {**round1, **round2})
    c = Cluster({"preset": "tiny-llama"}, ENGINE, dep)
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        transfers = _serve_rounds(c, (round1, round2), want)
        stats = c.kv_stats()
    finally:
        c.stop()
    assert len(transfers) >= len(round1) + len(round2) - 1  # the KV moved (a 5-token prompt may be cached)
    assert all(t.record["transport"] == dep.get("transport", "shm") for t in transfers)
    assert all(s.free_blocks == s.total_blocks for s in stats.values())
    assert _followers() == []
    _no_leftovers(pids, c.run_prefix)


@pytest.mark.slow
def test_killing_one_rank_ends_the_run_cleanly():
    c = Cluster({"preset": "tiny-llama"}, ENGINE, TP2)
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        (follower,) = _followers()
        for i in range(3):
            c.submit(f"k{i}", eh.prompts([20], seed=i)[0], {"max_tokens": 2000, "ignore_eos": True})
        seen, deadline = set(), time.monotonic() + 120  # deadlines against a hang, not speed bounds
        while len(seen) < 3:
            assert time.monotonic() < deadline
            seen |= {e.req_id for e in c.poll(0.5) if isinstance(e, TokenEvent) and e.index >= 1}
        os.kill(follower, signal.SIGKILL)
        t0, failed, done = time.monotonic(), [], {}
        while len(done) < 3:
            assert time.monotonic() - t0 < 120, "a dead rank not detected"
            for e in c.poll(0.5):
                if isinstance(e, WorkerFailed):
                    failed.append(e)
                elif isinstance(e, RequestDone):
                    done[e.req_id] = e
        assert [f.worker for f in failed] == ["unified0"]
        assert all(not d.ok for d in done.values())
    finally:
        c.stop()
    assert _followers() == []
    _no_leftovers(pids + [follower], c.run_prefix)


def test_equal_devices_gpu_scale_settings_pass_validation():
    """recipes/equal-devices.yaml's GPU-scale deployments (its `# gpu-scale NAME: {...}` comment lines) are
    valid recipes: 1xTP8 and 2xTP4 on eight GPUs."""
    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "recipes", "equal-devices.yaml")
    text = open(path).read()
    raw = yaml.safe_load(text)
    lines = [x[len("# gpu-scale "):] for x in text.splitlines() if x.startswith("# gpu-scale ")]
    assert len(lines) == 2
    raw["variants"] = {name: {"deployment": yaml.safe_load(dep)} for name, dep in (x.split(": ", 1) for x in lines)}
    r = parse_recipe(raw)
    assert [(w.devices[0], len(w.devices), w.tp) for w in r.resolved("unified-1xTP8").deployment.workers] == \
        [("cuda:0", 8, 8)]
    assert [(w.devices[0], w.tp) for w in r.resolved("unified-2xTP4").deployment.workers] == \
        [("cuda:0", 4), ("cuda:4", 4)]
