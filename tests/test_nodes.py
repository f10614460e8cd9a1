"""Two nodes on one box: a router (`pdlab run`) and an agent (`pdlab worker`) as separate process trees, in
separate working directories, joined only by a CurveZMQ control plane on loopback TCP and NIXL over UCX's tcp
transport (`nixl.ucx_tls: "tcp,self"`: not even UCX's shared memory).

- the decode worker on node b gives the tokens the unified worker gives, its KV over NIXL/TCP;
- the agent killed mid-run: the run ends cleanly, partial, with what it measured, and node b's workers die;
- an agent with another cluster's keys is refused, and the run says so in the line naming the missing node;
- `pdlab doctor --peer` measures NIXL to the joined node and flags the TCP path.

Skipped where NIXL is not installed (`pip install -e '.[nixl]'`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pdlab.measure.records import load_run
from pdlab.serve.curve import init_keys
from pdlab.recipe.nixl import nixl_module
from proc_helpers import running
from tests.test_run import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed: pip install -e '.[nixl]'")]

RECIPE = """\
name: two-nodes-test
seed: 0
warmup: 1
model: {{preset: tiny-llama}}
engine: {{block_size: 8, kv_blocks: 64, token_budget: 256, chunked_prefill: false, prefix_caching: true,
         max_running: 8}}
workload:
  requests: {requests}
  arrival: {{kind: poisson}}
  input_len: {{kind: uniform, min: 16, max: 48}}
  output_len: {{kind: fixed, value: 6}}
rates: [{rate}]
slo: {{ttft_ms: 5000, itl_ms: 2000, itl_stat: p99, attainment: 0.9}}
deployment:
  control: {{address: "tcp://127.0.0.1:{port}", keys: "{keys}", join_timeout_s: {join}}}
  nodes: {{b: {{devices: [cpu:1]}}}}
variants:
  unified:
    deployment: {{unified: {{devices: [cpu:0]}}}}
  two-nodes:
    deployment: {{prefill: {{devices: [cpu:0]}}, decode: {{devices: ["b:cpu:1"]}}, transport: nixl, mode: pull,
                 nixl: {{ucx_tls: "tcp,self"}}}}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, cwd, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "pdlab.cli", *args], cwd=cwd, env=env, text=True,
                            start_new_session=True, **kw)


def run(*args, cwd, timeout=600):
    p = cli(*args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def new_keys(path):
    init_keys(str(path))  # what `pdlab keys init` writes (tests/test_keys.py runs the command)
    return str(path)


class Node:
    """`pdlab worker` in its own directory and session, its output in a file."""

    def __init__(self, tmp, port, keys, *extra):
        self.dir = tmp / "node-b"
        self.dir.mkdir()
        self.log = self.dir / "agent.log"
        with open(self.log, "w") as f:
            self.proc = cli("worker", "--join", f"tcp://127.0.0.1:{port}", "--devices", "cpu:1", "--name", "b",
                            "--keys", keys, *extra, cwd=self.dir, stdout=f, stderr=subprocess.STDOUT)

    def text(self):
        return self.log.read_text()

    def worker_pids(self):
        """The pids the agent said it started."""
        return [int(x.split("(pid ")[1].split(")")[0]) for x in self.text().split(", ") if "(pid " in x]

    def wait_for(self, needle, timeout=300):
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert self.proc.poll() is None or needle in self.text(), self.text()
            assert time.monotonic() < deadline, f"agent never said {needle!r}: {self.text()}"
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        time.sleep(0.2)
    return not alive


def router_dir(tmp, port, keys, requests=6, rate=20, join=120):
    d = tmp / "node-a"
    d.mkdir()
    (d / "recipe.yaml").write_text(RECIPE.format(port=port, keys=keys, requests=requests, rate=rate, join=join))
    return d


def outputs(r, variant):
    return {q["id"]: (q["prompt_ids"], q["output_ids"]) for q in r.requests
            if q["variant"] == variant and not q.get("warmup")}


def test_a_decode_worker_on_node_b_gives_the_unified_tokens(tmp_path):
    port, keys = free_port(), new_keys(tmp_path / "keys")
    node = Node(tmp_path, port, keys, "--once")
    a = router_dir(tmp_path, port, keys)
    try:
        rc, out, err = run("run", "recipe.yaml", "--out", "run", cwd=a)
        assert rc == 0, err[-3000:]
        r = load_run(str(a / "run"))
        unified = outputs(r, "unified")
        assert len(unified) == 6 and all(len(o) == 6 for _, o in unified.values())
        assert outputs(r, "two-nodes") == unified
        assert all(q["ok"] for q in r.requests)
        ts = [t for t in r.transfers if t["variant"] == "two-nodes"]
        assert ts and {(t["transport"], t["mode"], t["dst"]) for t in ts} == {("nixl", "pull", "decode0")}
        lanes = " ".join({t["path"] for t in ts})
        assert "tcp/" in lanes and not any(x in lanes for x in ("cma/", "posix/", "sysv/", "xpmem/")), lanes
        assert r.recipe["variants"]["two-nodes"]["deployment"]["nodes"] == {"b": {"devices": ["cpu:1"]}}
        assert r.recipe["variants"]["two-nodes"]["deployment"]["decode"]["devices"] == ["b:cpu:1"]
        # --once: the agent ends with the run's session, its worker reaped
        assert node.proc.wait(120) == 0, node.text()
        assert "started decode0" in node.text() and "over (the run ended it)" in node.text()
        assert node.worker_pids() and gone(node.worker_pids())
    finally:
        node.stop()


def test_the_agent_killed_mid_run_ends_the_run_partial_with_what_it_measured(tmp_path):
    port, keys = free_port(), new_keys(tmp_path / "keys")
    node = Node(tmp_path, port, keys)
    a = router_dir(tmp_path, port, keys, requests=200, rate=2)
    p = cli("run", "recipe.yaml", "--out", "run", "--variants", "two-nodes", cwd=a, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
    try:
        records = a / "run" / "requests.jsonl"
        deadline = time.monotonic() + 400
        while not (records.exists() and '"two-nodes"' in records.read_text() and '"warmup"' not in
                   records.read_text().splitlines()[-1]):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no measured record in time"
            time.sleep(0.5)
        pids = node.worker_pids()
        assert pids
        node.proc.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 1, err[-3000:]
        assert "decode0 on node b" in err or "decode0" in err, err[-3000:]
        r = load_run(str(a / "run"))
        assert r.summary["partial"] is True and "decode0" in r.summary["reason"]
        measured = [q for q in r.requests if not q.get("warmup")]
        assert any(q["ok"] for q in measured) and not all(q["ok"] for q in measured)
        assert gone(pids)  # the kernel ends node b's workers with their agent (PR_SET_PDEATHSIG)
    finally:
        if p.poll() is None:
            p.kill()
        node.stop()


def test_an_agent_with_another_clusters_keys_is_refused_and_the_run_says_so(tmp_path):
    port, keys = free_port(), new_keys(tmp_path / "keys")
    node = Node(tmp_path, port, new_keys(tmp_path / "other-keys"))
    a = router_dir(tmp_path, port, keys, join=10)
    try:
        node.wait_for("joining")  # its imports done: it knocks within the run's 10 s
        rc, out, err = run("run", "recipe.yaml", "--out", "run", "--variants", "two-nodes", cwd=a)
        assert rc == 1, err[-3000:]
        assert "node b did not join within 10s" in err and "refused" in err and "keys" in err, err[-3000:]
        assert "refused a peer" in err  # logged when it happened
        assert "refused by" in node.text() and "started" not in node.text()
        assert node.proc.poll() is None  # it keeps waiting for a router with its keys
    finally:
        node.stop()
    assert node.proc.returncode == 0


def test_doctor_peer_measures_nixl_to_the_joined_node(tmp_path):
    port, keys = free_port(), new_keys(tmp_path / "keys")
    node = Node(tmp_path, port, keys, "--once")
    try:
        rc, out, err = run("doctor", "--peer", f"tcp://127.0.0.1:{port}", "--keys", keys, "--ucx-tls", "tcp,self",
                           "--json", cwd=ROOT, timeout=300)
        assert rc == 0, err[-3000:]
        report = json.loads(out)
        assert report["node"] == "b" and report["same_host"] is True
        sizes = report["sizes"]
        assert len(sizes) == 4 and [s["bytes"] for s in sizes] == sorted(s["bytes"] for s in sizes)
        assert all(s["read_gbps"] > 0 and s["write_gbps"] > 0 for s in sizes)
        assert report["latency_ms"] == sizes[0]["read_ms_p50"] > 0
        assert "tcp/" in report["path"] and report["path"].endswith("[UCX_TLS=tcp,self]")
        assert report["warning"].startswith("FALLBACK")  # TCP between two processes of one box
        assert node.proc.wait(120) == 0, node.text()
        assert gone(node.worker_pids())
    finally:
        node.stop()
