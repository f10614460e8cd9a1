"""External engines without vLLM: a fake OpenAI server (tests/data/fake_vllm.py) stands in for it, so the
whole path runs here — recipe keys, server start and stop, the streaming client, the proxy hand-off,
records a summary can read — and so does every bad input: a missing interpreter, a server that exits or
never becomes healthy, a port in use, a server killed mid-run. Nothing may be left running."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import pdlab as pdlab_here
from pdlab.recipe import RecipeError, parse_recipe
from proc_helpers import running
from test_run_faults import wait_for_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")
FAKE = os.path.join(ROOT, "tests", "data", "fake_vllm.py")


@pytest.fixture
def fake_python(tmp_path):
    """An 'interpreter' that runs the fake server whatever module it is asked for."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def run(tmp_path, python, *sets, variants="unified", timeout=900):  # against a hang, not a speed bound
    out = tmp_path / "run"
    pids = tmp_path / "pids"
    env = {**os.environ, "FAKE_VLLM_PIDS": str(pids), "PDLAB_MODEL_CACHE": str(tmp_path / "models")}
    cmd = [sys.executable, "-m", "pdlab.cli", "run", TINY, "--out", str(out), "--variants", variants,
           "--set", "engine.backend=vllm", "--set", f"engine.python={python}"]
    for s in sets:
        cmd += ["--set", s]
    p = pdlab_here(*cmd[3:], env=env)
    return p, out, read_pids(pids)


def read_pids(path) -> list[int]:
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


def no_survivor(pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # killed processes may take a moment to leave on a loaded box
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "server processes left running"
    # --fake-child's engine stand-in maps a psm_* segment it never removes, as vLLM's CPU engine does
    assert not [p for p in pids if os.path.exists(f"/dev/shm/psm_fake_{p}")], "shared memory left behind"


def records(out) -> list[dict]:
    with open(out / "requests.jsonl") as f:
        return [json.loads(line) for line in f if '"warmup"' not in line]


# ---- the recipe ----
BASE = {"rates": [1], "deployment": {"unified": {"devices": ["cpu:0"]}}}


def test_engine_backend_is_a_typed_recipe_key():
    v = parse_recipe({**BASE, "engine": {"backend": "vllm", "python": "/x/python", "args": ["--max-num-seqs", 4]}})
    v = v.resolved("default")
    assert v.backend.external and v.backend.interpreter == "/x/python" and v.backend.args == ("--max-num-seqs", "4")
    assert parse_recipe(BASE).resolved("default").backend.external is False


@pytest.mark.parametrize("engine, key", [
    ({"backend": "sglang"}, "engine.backend"),
    ({"python": "/x/python"}, "engine.python"),  # only for an external engine
    ({"backend": "vllm", "args": "--foo"}, "engine.args"),
])
def test_bad_backend_keys_name_the_key(engine, key):
    with pytest.raises(RecipeError, match=f"^variants.default.{key}"):
        parse_recipe({**BASE, "engine": engine})


def test_vllm_push_on_cpu_is_refused():
    dep = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "push"}
    with pytest.raises(RecipeError, match="deployment.mode: .*use mode: pull"):
        parse_recipe({**BASE, "deployment": dep, "engine": {"backend": "vllm"}})


def test_vllm_pd_streams_every_token_from_decode():
    dep = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "first_token": "prefill"}
    with pytest.raises(RecipeError, match="deployment.first_token"):
        parse_recipe({**BASE, "deployment": dep, "engine": {"backend": "vllm"}})


# ---- runs against the fake server ----
@pytest.mark.slow
def test_unified_run_writes_the_in_house_records(tmp_path, fake_python):
    p, out, pids = run(tmp_path, fake_python)
    assert p.returncode == 0, p.stderr
    recs = records(out)  # 6 requests at each of 2 rates
    assert len(recs) == 12 and all(r["ok"] and r["output_len"] == 6 and len(r["token_times"]) == 6 for r in recs)
    assert all(r["ttft"] > 0 and r["prefill_worker"] == "unified0" for r in recs)
    summary = json.load(open(out / "summary.json"))
    assert summary["variants"]["unified"] and not summary.get("partial")
    assert os.path.exists(out / "servers" / "unified.unified0.log")
    assert json.load(open(out / "servers" / "unified.json"))["backend"] == "vllm"
    assert len(pids) == 2  # calibration's server, then the variant's
    no_survivor(pids)


@pytest.mark.slow
def test_pd_run_goes_through_prefill_then_decode(tmp_path, fake_python):
    p, out, pids = run(tmp_path, fake_python, variants="disagg")
    assert p.returncode == 0, p.stderr
    recs = records(out)
    assert recs and all(r["ok"] and r["prefill_worker"] == "prefill0" and r["decode_worker"] == "decode0"
                        for r in recs)
    assert all(r["phases"]["prefill_end"] >= r["phases"]["prefill_start"] for r in recs)
    no_survivor(pids)


def test_missing_interpreter_is_one_line_and_starts_nothing(tmp_path):
    p, out, pids = run(tmp_path, str(tmp_path / "nope" / "python"))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "does not exist" in p.stderr and "scripts/vllm-env.sh" in p.stderr
    assert not pids and not (out / "requests.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("switch, words", [
    ("--fake-exit", "exited with code 3: RuntimeError: Engine core initialization failed"),
    ("--fake-port-busy", "is in use"),
    ("--fake-unhealthy", "not healthy"),
])
def test_a_server_that_does_not_start_is_one_line_with_its_log(tmp_path, fake_python, switch, words):
    p, out, pids = run(tmp_path, fake_python, f"engine.args=[{switch}, --fake-child]", "engine.ready_timeout_s=4")
    assert p.returncode == 1
    err = [line for line in p.stderr.splitlines() if line.startswith("run stopped early")]
    assert len(err) == 1 and words in err[0], p.stderr
    assert "fake vLLM starting" in open(out / "servers" / "calibration.unified0.log").read()
    assert pids
    no_survivor(pids)


@pytest.mark.slow
def test_killing_a_server_mid_run_ends_the_run_cleanly(tmp_path, fake_python):
    out, pids_file = tmp_path / "run", tmp_path / "pids"
    env = {**os.environ, "FAKE_VLLM_PIDS": str(pids_file), "PDLAB_MODEL_CACHE": str(tmp_path / "models")}
    cmd = [sys.executable, "-m", "pdlab.cli", "run", TINY, "--out", str(out), "--variants", "unified",
           "--set", "engine.backend=vllm", "--set", f"engine.python={fake_python}", "--set", "rates=[2]",
           "--set", "workload.requests=20", "--set", "workload.output_len.value=20",
           "--set", "engine.args=[--fake-token-s, '0.03', --fake-child]"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_requests(str(out), proc)  # measuring on the variant's server (pids 3 and 4: it and its child)
        os.kill(read_pids(pids_file)[2], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "unified0" in stderr and "killed by signal 9" in stderr, stderr
    summary = json.load(open(out / "summary.json"))
    assert summary["partial"] is True
    assert any(not r["ok"] for r in records(out))
    no_survivor(read_pids(pids_file))


@pytest.mark.slow
def test_ctrl_c_stops_every_server(tmp_path, fake_python):
    out, pids_file = tmp_path / "run", tmp_path / "pids"
    env = {**os.environ, "FAKE_VLLM_PIDS": str(pids_file), "PDLAB_MODEL_CACHE": str(tmp_path / "models")}
    cmd = [sys.executable, "-m", "pdlab.cli", "run", TINY, "--out", str(out), "--variants", "disagg",
           "--set", "engine.backend=vllm", "--set", f"engine.python={fake_python}", "--set", "rates=[2]",
           "--set", "workload.requests=20", "--set", "workload.output_len.value=20",
           "--set", "engine.args=[--fake-token-s, '0.03', --fake-child]"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_requests(str(out), proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert json.load(open(out / "summary.json"))["partial"] is True
    no_survivor(read_pids(pids_file))
