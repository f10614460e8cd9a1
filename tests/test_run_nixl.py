"""`transport: nixl` end to end through the CLI: token parity with unified (pull and push, 2P1D, prefix cache
on), the transfers and their path in transfers.jsonl, the trace and env.json, and two "nodes" on one box.

Skipped where NIXL is not installed (`pip install -e '.[nixl]'`); CI installs the extra, so they run there.
"""

import json
import os
import socket

import pytest

from pdlab.measure.records import load_run
from pdlab.recipe.nixl import nixl_module, resolve_ucx_tls
from tests.test_run import ROOT, pdlab

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed: pip install -e '.[nixl]'")]
RECIPE = os.path.join(ROOT, "tests", "data", "nixl-recipe.yaml")


def outputs(run, variant):
    return {r["id"]: (r["prompt_ids"], r["output_ids"]) for r in run.requests
            if r["variant"] == variant and not r.get("warmup")}


@pytest.fixture(scope="module")
def nixl_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "nixl")
    r = pdlab("run", RECIPE, "--out", out, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    return load_run(out)


def test_pull_and_push_over_nixl_match_unified_token_for_token(nixl_run):
    unified = outputs(nixl_run, "unified")
    assert len(unified) == 8 and all(len(o) == 6 for _, o in unified.values())
    assert outputs(nixl_run, "nixl-pull") == unified
    assert outputs(nixl_run, "nixl-push") == unified
    assert all(r["ok"] for r in nixl_run.requests)


def test_transfers_are_nixl_with_the_path_ucx_took(nixl_run):
    for variant, mode in (("nixl-pull", "pull"), ("nixl-push", "push")):
        ts = [t for t in nixl_run.transfers if t["variant"] == variant]
        served = {r["id"] for r in nixl_run.requests if r["variant"] == variant}
        assert {t["request"] for t in ts} == served  # one hand-over per request, warm-ups included
        assert {(t["transport"], t["mode"]) for t in ts} == {("nixl", mode)}
        assert {t["src"] for t in ts} == {"prefill0", "prefill1"} and {t["dst"] for t in ts} == {"decode0"}
        assert all(t["path"].startswith("UCX intra-node ") and "rma" in t["path"] for t in ts)
        assert all(t["path"].endswith(f"[UCX_TLS={resolve_ucx_tls('auto', cuda=False)}]") for t in ts)
        assert any(t["saved_bytes"] > 0 for t in ts)  # the decode side's prefix cache spared blocks


def test_trace_and_env_record_the_transport_actually_used(nixl_run):
    with open(os.path.join(nixl_run.path, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    kv = [e for e in events if e.get("cat") == "transfer"]
    assert kv and {e["args"]["transport"] for e in kv} == {"nixl"} and all(e["args"]["path"] for e in kv)
    env = nixl_run.env["transports"]
    assert set(env) == {"nixl-pull", "nixl-push"}
    for variant, entry in env.items():
        assert entry["transport"] == "nixl" and entry["nixl"] == {"backends": ["UCX"], "ucx_tls": "auto"}
        assert entry["paths"] == sorted({t["path"] for t in nixl_run.transfers if t["variant"] == variant})


def test_two_nodes_on_one_box_share_nothing_but_tcp(nixl_run, tmp_path):
    """Workers that reach each other only through a tcp:// control plane and NIXL over TCP (UCX_TLS=tcp,self:
    no shared-memory transport), the way a prefill node and a decode node would. Pull only: its READs are the
    path whose silent fallback the doctor warns about; push over NIXL is the main run's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two-nodes")
    r = pdlab("run", RECIPE, "--out", out, "--variants", "nixl-pull",
              "--set", f"variants.nixl-pull.deployment.control=tcp://127.0.0.1:{port}",
              "--set", "variants.nixl-pull.deployment.nixl={ucx_tls: 'tcp,self'}", timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    run = load_run(out)
    unified = outputs(nixl_run, "unified")
    assert outputs(run, "nixl-pull") == unified
    paths = {t["path"] for t in run.transfers}
    lanes = " ".join(paths)
    assert paths and "tcp/" in lanes and not any(x in lanes for x in ("cma/", "posix/", "sysv/", "xpmem/")), paths
    assert all(p.endswith("[UCX_TLS=tcp,self]") for p in paths), paths
    assert run.recipe["variants"]["nixl-pull"]["deployment"]["control"] == f"tcp://127.0.0.1:{port}"
