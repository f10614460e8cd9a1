"""End-to-end: worker processes behind the router, unified and disaggregated, on the tiny-llama preset.

Every disaggregated topology must give the very tokens a single in-process engine gives (greedy), leave
no block held on either side, and clean up processes and /dev/shm segments, also after SIGKILL and Ctrl-C.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from pdlab.engine.config import EngineConfig
from pdlab.recipe import Deployment, ModelSpec, RecipeError
from pdlab.serve.cluster import (RequestDone, StepEvent, TokenEvent, TransferEvent,
                                 WorkerFailed)
from pdlab.serve.cluster import Cluster as _Cluster
from pdlab.serve.cluster import ClusterError
import engine_helpers as eh
from proc_helpers import segments_with


def Cluster(model, engine, deployment, **kw):
    """A cluster from recipe-shaped sections, parsed the way a recipe's are."""
    return _Cluster(ModelSpec.from_raw(model, "model"), EngineConfig.from_raw(engine, "engine"),
                    Deployment.from_raw(deployment, "deployment"), **kw)

MODEL = {"preset": "tiny-llama"}
ENGINE = {"block_size": 8, "kv_blocks": 48, "token_budget": 256, "max_running": 16}
PREFIX = eh.prompts([32], seed=7)[0]
# round 1 runs together; round 2 shares PREFIX with r1-2, so a decode worker already holds 4 of its blocks
ROUND1 = {"r1-0": eh.prompts([5], seed=1)[0], "r1-1": eh.prompts([23], seed=2)[0],
          "r1-2": PREFIX + eh.prompts([9], seed=3)[0], "r1-3": eh.prompts([16], seed=4)[0]}
ROUND2 = {"r2-0": PREFIX + eh.prompts([4], seed=5)[0], "r2-1": PREFIX + eh.prompts([13], seed=6)[0]}
MAX_TOKENS = {"r1-3": 1}  # finishes at its first token: no hand-over at all
PARAMS = {"max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    out = {}
    for rid, p in {**ROUND1, **ROUND2}.items():
        eng = eh.engine("tiny-llama", prefix_caching=False, kv_blocks=48, block_size=8)
        got, _ = eh.run(eng, [p], max_tokens=MAX_TOKENS.get(rid, 8))
        out[rid] = got["0"]
    return out


def _params(rid):
    return {**PARAMS, "max_tokens": MAX_TOKENS.get(rid, 8)}


def _drain(c, ids, timeout=300):  # a deadline against a hang, not a speed bound
    """Poll until every request in `ids` is done; returns (done by id, tokens by id, other events)."""
    done, tokens, other = {}, {i: [] for i in ids}, []
    deadline = time.monotonic() + timeout
    while set(ids) - set(done):
        assert time.monotonic() < deadline, f"requests not done: {set(ids) - set(done)}"
        for e in c.poll(0.5):
            if isinstance(e, TokenEvent):
                tokens[e.req_id].append(e)
            elif isinstance(e, RequestDone):
                done[e.req_id] = e
            else:
                other.append(e)
    return done, tokens, other


def _no_leftovers(pids, prefix):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not segments_with([prefix])
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)], "a worker's folder left"


DISAGG = [
    pytest.param({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"},
                 True, id="1P1D-pull-prefix-first_decode"),
    pytest.param({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "push",
                  "first_token": "prefill"}, False, id="1P1D-push-noprefix-first_prefill"),
    pytest.param({"prefill": {"replicas": 2, "devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                  "share_devices": True, "mode": "push"}, True, id="2P1D-push-prefix-first_decode"),
    pytest.param({"prefill": {"replicas": 2, "devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                  "share_devices": True, "mode": "pull", "first_token": "prefill"}, False,
                 id="2P1D-pull-noprefix-first_prefill"),
]


@pytest.mark.slow
@pytest.mark.parametrize("deployment,prefix_caching", DISAGG)
def test_disaggregated_matches_unified_engine(deployment, prefix_caching, reference):
    c = Cluster(MODEL, {**ENGINE, "prefix_caching": prefix_caching}, deployment)
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        for rid, p in ROUND1.items():
            c.submit(rid, p, _params(rid))
        done, tokens, other = _drain(c, list(ROUND1))
        for rid, p in ROUND2.items():
            c.submit(rid, p, _params(rid))
        d2, t2, o2 = _drain(c, list(ROUND2))
        done.update(d2), tokens.update(t2), other.extend(o2)
        stats = c.kv_stats()
    finally:
        c.stop()
    for rid, d in done.items():
        assert d.ok, d.error
        assert d.output_ids == reference[rid], rid
        assert [e.token_id for e in tokens[rid]] == reference[rid]
        assert [e.index for e in tokens[rid]] == list(range(len(reference[rid])))
        assert tokens[rid][-1].finished and all(a.t <= b.t for a, b in zip(tokens[rid], tokens[rid][1:]))
        first = tokens[rid][0].worker
        if rid in MAX_TOKENS:
            assert first.startswith("prefill")
            continue
        assert first.startswith(deployment.get("first_token", "decode"))
        assert d.prefill_worker.startswith("prefill") and d.decode_worker == "decode0"
        ph = d.phases
        assert ph["queued"] <= ph["prefill_start"] <= ph["prefill_end"] <= ph["admitted"]
        assert ph["transfer_start"] <= ph["transfer_end"] <= ph["admitted"] + 1e-3
    transfers = {e.record["request"]: e.record for e in other if isinstance(e, TransferEvent)}
    assert set(transfers) == set(done) - set(MAX_TOKENS)
    for rid, r in transfers.items():
        assert r["mode"] == deployment["mode"] and r["transport"] == "shm" and r["dst"] == "decode0"
        assert r["bytes"] == r["blocks"] * 2 * 2 * 8 * 2 * 16 * 4  # layers, k/v, block, kv heads, head dim, fp32
        assert r["src"] == done[rid].prefill_worker
        block_bytes = 2 * 2 * 8 * 2 * 16 * 4
        assert r["blocks"] + r["saved_bytes"] // block_bytes == -(-len({**ROUND1, **ROUND2}[rid]) // 8)
        if prefix_caching and rid.startswith("r2"):
            assert r["saved_bytes"] > 0, f"{rid}: decode did not reuse the prefix it holds"
        if not prefix_caching:
            assert r["saved_bytes"] == 0
    assert any(isinstance(e, StepEvent) and e.role == "decode" for e in other)
    for name, s in stats.items():
        assert s.free_blocks == s.total_blocks and s.requests == 0 and not s.leak, (name, s)
    _no_leftovers(pids, c.run_prefix)


@pytest.mark.slow
def test_unified_replicas_and_a_hung_worker(reference):
    c = Cluster(MODEL, ENGINE, {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}},
                heartbeat_timeout_s=6)  # more than a loaded box's worst pause of a worker at start-up (2 s was not)
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        assert [(w.name, w.devices) for w in c.workers] == [("unified0", ["cpu:0"]), ("unified1", ["cpu:1"])]
        for rid, p in ROUND1.items():
            c.submit(rid, p, _params(rid))
        done, _, _ = _drain(c, list(ROUND1))
        assert {d.prefill_worker for d in done.values()} == {"unified0", "unified1"}  # least load spreads them
        assert all(d.ok and d.output_ids == reference[rid] for rid, d in done.items())
        assert all(s.free_blocks == s.total_blocks for s in c.kv_stats().values())
        # a worker that stops answering (SIGSTOP) is found by its missing heartbeats, and killed
        c.submit("slow", ROUND2["r2-0"], {"max_tokens": 400, "ignore_eos": True})
        c.submit("other", ROUND2["r2-1"], {"max_tokens": 4, "ignore_eos": True})
        hung, deadline = None, time.monotonic() + 120
        while hung is None:
            assert time.monotonic() < deadline
            hung = next((e.worker for e in c.poll(1) if isinstance(e, TokenEvent) and e.req_id == "slow"), None)
        os.kill(next(w.pid for w in c.workers if w.name == hung), signal.SIGSTOP)
        t0 = time.monotonic()
        failed, fails = None, {}
        while failed is None or "slow" not in fails:
            assert time.monotonic() - t0 < 120, "hung worker not detected"
            for e in c.poll(0.5):
                if isinstance(e, WorkerFailed):
                    failed = e
                elif isinstance(e, RequestDone):
                    fails[e.req_id] = e
        assert failed.worker == hung and "heartbeat" in failed.reason
        assert not fails["slow"].ok and hung in fails["slow"].error
    finally:
        c.stop()
    _no_leftovers(pids, c.run_prefix)


@pytest.mark.slow
def test_worker_killed_mid_run_fails_its_requests_cleanly():
    c = Cluster(MODEL, ENGINE, {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}})
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        decode_pid = next(w.pid for w in c.workers if w.role == "decode")
        for i in range(3):
            c.submit(f"k{i}", eh.prompts([20], seed=i)[0], {"max_tokens": 500, "ignore_eos": True})
        seen = set()
        deadline = time.monotonic() + 120
        while len(seen) < 3:
            assert time.monotonic() < deadline
            seen |= {e.req_id for e in c.poll(0.5) if isinstance(e, TokenEvent) and e.index >= 1}
        os.kill(decode_pid, signal.SIGKILL)
        t0 = time.monotonic()
        failed, done = [], {}
        while len(done) < 3:
            assert time.monotonic() - t0 < 120, "dead worker not detected"
            for e in c.poll(0.5):
                if isinstance(e, WorkerFailed):
                    failed.append(e)
                elif isinstance(e, RequestDone):
                    done[e.req_id] = e
        assert [f.worker for f in failed] == ["decode0"] and "signal 9" in failed[0].reason
        assert all(not d.ok and "decode0" in d.error for d in done.values())
        # the surviving prefill worker released what the dead one would have taken
        assert all(s.free_blocks == s.total_blocks for s in c.kv_stats().values())
    finally:
        c.stop()
        c.stop()  # idempotent
    _no_leftovers(pids, c.run_prefix)


SCRIPT = """
import sys, time
from pdlab.engine.config import EngineConfig
from pdlab.recipe import Deployment, ModelSpec
from pdlab.serve.cluster import Cluster

def main():
    with Cluster(ModelSpec(preset="tiny-llama"), EngineConfig(kv_blocks=32, block_size=8),
                 Deployment.from_raw({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                      "mode": "push"}, "deployment")) as c:
        c.start()
        print(c.run_prefix, *[w.pid for w in c.workers], flush=True)
        c.submit("a", [5] * 20, {"max_tokens": 100000, "ignore_eos": True})
        while True:
            c.poll(0.5)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.mark.slow
def test_ctrl_c_stops_everything(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        line = proc.stdout.readline().split()
        assert line, proc.stderr.read()
        prefix, pids = line[0], [int(p) for p in line[1:]]
        assert len(pids) == 2 and all(os.kill(p, 0) is None for p in pids)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "interrupted" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _no_leftovers(pids, prefix)


@pytest.mark.parametrize("deployment,match", [
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:0"]}}, "overlap on cpu:0"),
    ({"unified": {"replicas": 2, "devices": ["cpu:0"]}}, "cannot be split"),
    ({"unified": {"replicas": 0, "devices": ["cpu:0"]}}, "unified.replicas: expected an integer >= 1"),
    ({"prefill": {"devices": ["cpu:0"]}}, "decode: missing"),
    ({"prefill": {"replicas": 0, "devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}},
     "prefill.replicas: expected an integer >= 1"),
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "cuda-ipc"},
     "cuda-ipc does not move cpu pools"),
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm", "nixl": {}},
     "nixl: only for transport: nixl"),
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "carrier-pigeon"},
     "transport: expected one of shm, cuda-ipc, host, nixl"),
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "sideways"}, "mode"),
    ({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "first_token": "x"}, "first_token"),
    ({"unified": {"devices": ["gpu:0"]}}, "bad device spec"),
    ({"unified": {}, "decode": {}}, "not both"),
    ({"unified": {"devices": ["cpu:0"]}, "replica": 3}, "replica: unknown key"),
])
def test_bad_deployment_shapes_fail_before_any_process_starts(deployment, match):
    before = multiprocessing.active_children()
    with pytest.raises(RecipeError, match=match):
        Cluster(MODEL, ENGINE, deployment)
    assert multiprocessing.active_children() == before


@pytest.mark.parametrize("deployment,match", [
    ({"unified": {"devices": ["cpu:999"]}}, "cpu:999 does not exist"),
    ({"unified": {"devices": ["cuda:7"]}}, "cuda:7 does not exist"),
])
def test_devices_the_machine_lacks_fail_before_any_process_starts(deployment, match):
    before = multiprocessing.active_children()
    with pytest.raises(ClusterError, match=match):
        Cluster(MODEL, ENGINE, deployment)
    assert multiprocessing.active_children() == before


def test_sharing_devices_is_allowed_when_asked():
    c = Cluster(MODEL, ENGINE, {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:0"]},
                                "share_devices": True})
    assert [(w.name, w.devices) for w in c.workers] == [("prefill0", ["cpu:0"]), ("decode0", ["cpu:0"])]
    c.stop()  # never started: a no-op
    with pytest.raises(ClusterError, match="not running"):
        c.submit("x", [1], {})


def _exists(pid: int) -> bool:
    """Whether `pid` is still in the process table, as a zombie too (os.kill(pid, 0) also finds zombies)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.slow
def test_stop_reaps_every_worker_even_when_they_are_slow_to_die():
    """stop() waits for every child, however short its own timeout: a worker SIGKILLed a moment before, or
    one still unwinding, is reaped, not left behind as a zombie (re-parented to init once we exit)."""
    c = Cluster(MODEL, ENGINE, {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}})
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        c.submit("k", eh.prompts([20], seed=1)[0], {"max_tokens": 500, "ignore_eos": True})
        deadline = time.monotonic() + 120
        while not any(isinstance(e, TokenEvent) and e.index >= 1 for e in c.poll(0.5)):
            assert time.monotonic() < deadline
        os.kill(next(w.pid for w in c.workers if w.role == "decode"), signal.SIGKILL)
    finally:
        c.stop(timeout=0.01)  # no time to exit politely: terminated and killed at once, then waited for
    assert not [p for p in pids if _exists(p)], "a worker was not waited for"
    assert not segments_with([c.run_prefix])
