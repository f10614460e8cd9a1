"""A run cut short — a worker killed with SIGKILL, or Ctrl-C — ends cleanly: exit code, partial summary,
records kept, no orphan process, no shared memory left behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import pdlab as pdlab_here
from proc_helpers import descendants, name_of, run_prefixes, segments_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")
LONG = ["--set", "workload.requests=60", "--set", "workload.output_len.value=40", "--set", "rates=[4]",
        "--variants", "disagg"]


def start_run(out: str, extra: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdlab.cli", "run", TINY, "--out", out, *LONG, *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_requests(out: str, proc: subprocess.Popen, timeout: float = 600) -> None:  # against a hang
    path = os.path.join(out, "requests.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path) and sum(1 for line in open(path) if '"warmup"' not in line) >= 3:
            return
        time.sleep(0.1)
    raise AssertionError("the run produced no measured request in time")


def check_clean(out: str, workers: list[int], prefixes: set) -> dict:
    # pdlab has exited: it waited for every child, so none is left, not even as a zombie re-parented to init
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "a child of pdlab was not waited for"
    assert prefixes and not segments_with(prefixes), "leaked shared memory"
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["partial"] is True and summary["reason"]
    for name in ("requests.jsonl", "steps.jsonl", "trace.json", "recipe.yaml"):
        assert os.path.exists(os.path.join(out, name)), name
    return summary


def cut_run(out: str, cut, extra: tuple = ()) -> tuple[subprocess.Popen, str, list[int], set]:
    """Start a run, wait until it has measured a few requests, then `cut(proc, workers)` it; returns the
    finished process, its stderr, the worker pids it had and the run prefixes of the segments they mapped."""
    proc = start_run(out, extra)
    try:
        wait_for_requests(out, proc)
        workers = descendants(proc.pid)
        prefixes = run_prefixes(workers)
        cut(proc, workers)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, err, workers, prefixes


@pytest.mark.slow
def test_worker_killed_mid_run(tmp_path):
    out = str(tmp_path / "killed")

    def kill_a_worker(proc, workers):
        spawned = [p for p in workers if name_of(p).startswith("pdlab-")]
        assert spawned  # a worker, not multiprocessing's fork server or resource tracker
        os.kill(spawned[-1], signal.SIGKILL)

    # 400-token outputs outlast the 250 ms between arrivals: requests are in flight when the worker dies
    proc, err, workers, prefixes = cut_run(out, kill_a_worker, ("--set", "workload.output_len.value=400"))
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "run stopped early" in err
    summary = check_clean(out, workers, prefixes)
    assert "worker" in summary["reason"]
    lines = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl"))]
    failed = [r for r in lines if not r["ok"]]
    assert failed, "the worker died mid-run: the requests it held must be written as failed"
    assert all("worker" in r["error"] for r in failed)


@pytest.mark.slow
def test_ctrl_c_keeps_what_was_measured(tmp_path):
    out = str(tmp_path / "interrupted")
    proc, err, workers, prefixes = cut_run(out, lambda proc, _: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    summary = check_clean(out, workers, prefixes)
    assert "interrupted" in summary["reason"]
    measured = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl")) if '"warmup"' not in x]
    assert len(measured) >= 3
    # the cut run still compares, and says it is partial
    c = pdlab_here("compare", out)
    assert c.returncode == 3 and "Traceback" not in c.stderr, c.stderr  # 3: printed, but the run is partial
    assert "None" not in c.stdout and "disagg (partial)" in c.stdout and "PARTIAL" in c.stdout, c.stdout


@pytest.mark.slow
def test_failed_hand_overs_in_a_run_are_failed_misses_or_recomputed(tmp_path):
    """`pdlab run` with every third KV hand-over dropped (test-only PDLAB_KV_FAULT): the run completes; under
    `fail` those requests are written failed, with the reason, and counted as failed misses; under
    `recompute` every request is served, token for token as unified, and says it was recomputed."""
    out = str(tmp_path / "faults")
    dep = "{prefill: {devices: [cpu:0]}, decode: {devices: [cpu:1]}, transfer_timeout_s: 1, on_transfer_failure: %s}"
    r = pdlab_here("run", TINY, "--out", out, "--set", "rates=[20]",
                   "--set", f"variants.disagg.deployment={dep % 'fail'}",
                   "--set", f"variants.recompute.deployment={dep % 'recompute'}", env={"PDLAB_KV_FAULT": "drop:3"})
    assert r.returncode == 0, r.stderr[-2000:]
    reqs = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl")) if '"warmup"' not in x]
    by = {v: {q["id"]: q for q in reqs if q["variant"] == v} for v in ("unified", "disagg", "recompute")}
    failed = [q for q in by["disagg"].values() if not q["ok"]]
    assert failed and all("KV hand-over failed" in q["error"] and "lease ran out" in q["error"] for q in failed)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert not summary.get("partial")
    assert summary["variants"]["disagg"]["rates"]["20"]["misses"]["failed"] == len(failed)
    assert all(q["ok"] for q in by["recompute"].values())
    assert any(q["prefill_route"] == "recompute" for q in by["recompute"].values())
    outputs = {v: {i: q["output_ids"] for i, q in by[v].items()} for v in by}
    assert outputs["recompute"] == outputs["unified"]
    assert {q["prefill_route"] for q in by["unified"].values()} == {"unified"}
