"""The server side of the cross-check (benchmarks/cross_check.py): `pdlab serve` of a recipe variant in a
process group of its own on a free loopback port, stopped as a user stops it (SIGTERM: it drains and stops its
workers), and what it stamped for a client's requests, read from its run directory's requests.jsonl (worker
token stamps; TTFT from the request's arrival at the server, ITL per token)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from cross_check_clients import ROOT, Sample
from pdlab.external.server import free_port

SERVED_NAME = "cross-check"
READY_S = 300.0
STOP_S = 90.0
SETTLE_S = 1.0  # the server's records are complete when none came for this long after a client ended


class Failed(RuntimeError):
    pass


def serve(recipe: str, variant: str, model_dir: str, out: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdlab.cli", "serve", recipe, "--variant", variant, "--port", str(port),
           "--out", out, "--served-model-name", SERVED_NAME, "--set", f"model={{path: {model_dir}}}"]
    log = f"{out}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_S
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise Failed(f"pdlab serve {recipe} --variant {variant} did not become healthy (log: {log})") \
                    from None
            time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it drains and stops its workers), SIGKILL if it does not end."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def server_lines(run_dir: str) -> list[str]:
    path = os.path.join(run_dir, "requests.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.endswith("\n")]


def settled(run_dir: str) -> list[str]:
    """The server's records once no more arrive (each is written when its request ends)."""
    n = -1
    while len(lines := server_lines(run_dir)) != n:
        n = len(lines)
        time.sleep(SETTLE_S)
    return lines


def server_sample(lines: list[str], sent: int) -> Sample:
    """What the server stamped for a client's measured requests: the last `sent` it received while that
    client ran (its warm-up, probe and calibration requests come first)."""
    recs = sorted(map(json.loads, lines), key=lambda r: r["arrival"])[-sent:] if sent else []
    ok = [r for r in recs if r["ok"]]
    return Sample(tuple(r["ttft"] for r in ok), tuple(g for r in ok for g in r["itl"]),
                  tuple(r["tpot"] for r in ok if r["tpot"] is not None), len(recs),
                  sum(r["output_len"] for r in ok), sum(r["output_len"] for r in ok))
