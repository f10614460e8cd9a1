"""`pdlab serve` as users run it: one process, real workers behind it (tests/test_serve_api.py covers the API
in process). Bad input is one line and exit 2 with nothing started; a served variant answers with the very
tokens the engine gives; SIGTERM drains (or, with --no-drain, cancels) what runs and leaves no process, no
/dev/shm segment and no held port; the API key is nowhere in the run directory."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import engine_helpers as eh
from proc_helpers import descendants, run_prefixes, running, segments_with, workers_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")
ENGINE = {"block_size": 8, "kv_blocks": 64, "token_budget": 256, "max_running": 8}  # the tiny recipe's
KEY = "k-" + "9" * 20


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdlab.cli", "serve", *args]


def one_line_error(code: int, stderr: str, words: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdlab serve: error:") and words in lines[0], stderr


def serve_main(tmp_path, *args, port=0, host="127.0.0.1"):
    from pdlab.commands.serve import main

    recipe, variant, *sets = args
    return main(recipe, variant, host, port, list(sets), str(tmp_path / "run"), None, None, True, 60.0)


@pytest.mark.parametrize("args, port, host, words", [
    (("nope.yaml", "unified"), 0, "127.0.0.1", "recipe file not found: nope.yaml"),
    ((TINY, "unifed"), 0, "127.0.0.1", "--variant: unknown variant 'unifed'; the recipe has: unified, disagg"),
    ((TINY, "unified", "engine.block_size=0"), 0, "127.0.0.1", "engine.block_size"),
    ((TINY, "unified"), 70000, "127.0.0.1", "--port 70000"),
    ((TINY, "unified"), 0, "192.0.2.1", "--host 192.0.2.1 --port 0: cannot listen there"),  # not this machine's
])
def test_bad_input_is_one_line_and_starts_nothing(tmp_path, capsys, args, port, host, words):
    code = serve_main(tmp_path, *args, port=port, host=host)
    one_line_error(code, capsys.readouterr().err, words)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a process of its own: the imports take seconds
def test_a_port_in_use_is_one_line_before_any_worker_starts(tmp_path):
    """Through the command line: exit code 2, one line, no run directory."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run(serve_cmd(TINY, "--variant", "unified", "--port", str(port), "--out", str(tmp_path / "r")),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    one_line_error(p.returncode, p.stderr, f"--port {port}: cannot listen there")
    assert not (tmp_path / "r").exists()


def test_only_loopback_goes_without_a_warning():
    from pdlab.api.serving import host_warning

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert host_warning(host, None, "PDLAB_API_KEY") is None
    assert "no API key: give --api-key or $PDLAB_API_KEY" in host_warning("0.0.0.0", None, "PDLAB_API_KEY")
    assert "not loopback" in host_warning("10.1.2.3", "k", "PDLAB_API_KEY") and "no API key" not in \
        host_warning("10.1.2.3", "k", "PDLAB_API_KEY")


# ---- served, with workers ----
class Served:
    """`pdlab serve` running: its URL, its processes and its shared memory, checked to be gone at the end."""

    def __init__(self, tmp_path, variant: str, *extra: str, env: dict | None = None):
        self.out = tmp_path / "run"
        self.proc = subprocess.Popen(serve_cmd(TINY, "--variant", variant, "--port", "0", "--out", str(self.out),
                                               *extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        deadline = time.monotonic() + 180
        while not any(line.startswith("serving ") for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.proc.communicate()
            self.lines.append(self.proc.stdout.readline())
        self.url = re.search(r"at (http://\S+)/v1", self.lines[-1]).group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.children = set(descendants(self.proc.pid))
        self.prefixes = run_prefixes(self.children)  # the shared memory of this server's runs
        assert self.children, "no worker process"

    def request(self, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        stdout, stderr = self.proc.communicate(timeout=120)
        return self.proc.returncode, stdout, stderr

    def nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while any(running(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in self.children if running(p)], "processes left running"
        assert not segments_with(self.prefixes), "shared memory left behind"
        with socket.socket() as s:  # the port is free again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))


def tokens(status_text: tuple[int, str]) -> list[int]:
    status, text = status_text
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


def generated(served: Served) -> tuple[float, float]:
    """(requests in flight, tokens generated so far), from /metrics."""
    text = served.request("/metrics")[1]
    values = {}
    for name in ("pdlab:requests_in_flight", "vllm:generation_tokens_total"):
        m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["pdlab:requests_in_flight"], values["vllm:generation_tokens_total"]


def stream_in_thread(served: Served, body: dict, out: list) -> threading.Thread:
    """Start a request in a thread; return once the server is streaming it (its metrics say so)."""
    before = generated(served)[1]

    def go():
        out.append(served.request("/v1/completions", body))
    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + 60
    while True:
        in_flight, total = generated(served)
        if in_flight >= 1 and total > before:
            return t
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["unified", "disagg"])
def test_served_tokens_are_the_engines_and_sigterm_drains(tmp_path, variant):
    prompts = eh.prompts([20, 37], seed=3)
    want = [eh.run(eh.engine("tiny-llama", **ENGINE), [p], max_tokens=12)[0]["0"] for p in prompts]
    s = Served(tmp_path, variant, "--api-key", KEY)
    try:
        got = [tokens(s.request("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True})) for p in prompts]
        assert got == want
        assert s.request("/v1/models", key=None)[0] == 401 and s.request("/v1/models")[0] == 200
        long: list = []
        t = stream_in_thread(s, {"prompt": prompts[0], "max_tokens": 300, "ignore_eos": True, "stream": True}, long)
        code, stdout, stderr = s.stop()
        t.join(60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0, stderr
    status, text = long[0]
    events = [line[6:] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"  # drained: the stream ran to its end
    assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1]) == 300
    s.nothing_left()
    files = [p for p in s.out.rglob("*") if p.is_file()]
    assert {"env.json", "recipe.yaml", "requests.jsonl", "steps.jsonl", "transfers.jsonl", "trace.json"} <= \
        {p.name for p in files}
    assert not any(KEY in p.read_text(errors="replace") for p in files)  # never written, argv included
    recs = [json.loads(line) for line in open(s.out / "requests.jsonl")]
    assert sorted(r["output_ids"] for r in recs if r["output_len"] == 12) == sorted(want)
    assert all(r["ok"] and r["variant"] == variant for r in recs)
    if variant == "disagg":
        assert all(r["prefill_worker"] == "prefill0" and r["decode_worker"] == "decode0" for r in recs)
        assert open(s.out / "transfers.jsonl").read().count("\n") == len(recs)


# timed workers (model.timing: each step waits out at least 2 ms, on any box) make the 450-token stream outlast
# the 0.5 s drain by construction; with the real model it ended inside the drain on a fast box
TIMED = ("--set", "model.timing={step: {fixed_ms: 2}, transfer: {shm: {gbps: 5}}}")


@pytest.mark.slow
@pytest.mark.parametrize("flags, sig", [(("--no-drain",), signal.SIGINT),
                                        (("--shutdown-timeout", "0.5", *TIMED), signal.SIGTERM)])
def test_cancelled_at_shutdown_what_runs_ends_and_nothing_is_left(tmp_path, flags, sig):
    """--no-drain cancels at once; a drain that outlasts --shutdown-timeout cancels what is left. The API key
    comes from the environment here: every route but /health needs it."""
    s = Served(tmp_path, "disagg", *flags, env={"PDLAB_API_KEY": KEY})
    try:
        assert s.request("/v1/models", key=None)[0] == 401 and s.request("/health", key=None)[0] == 200
        long: list = []
        t = stream_in_thread(s, {"prompt": eh.prompts([30], seed=4)[0], "max_tokens": 450, "ignore_eos": True,
                                 "stream": True}, long)
        code, stdout, stderr = s.stop(sig)
        t.join(60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0, stderr
    status, text = long[0]
    events = [line[6:] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "cancelled"
    s.nothing_left()
    (rec,) = [json.loads(line) for line in open(s.out / "requests.jsonl")]
    assert not rec["ok"] and rec["error"].startswith("cancelled") and rec["output_len"] < 450
    assert not any(KEY in p.read_text(errors="replace") for p in s.out.rglob("*") if p.is_file())


@pytest.mark.slow
def test_the_vllm_backend_is_served_too(tmp_path):
    """engine.backend: vllm, played by tests/data/fake_vllm.py: pdlab's client forwards each request's sampling
    to its servers (prefill and decode), a stop token ends the request there, a client that leaves mid-stream
    closes the server's stream too (vLLM then aborts it), and SIGTERM stops every server."""
    from test_external import FAKE, no_survivor, read_pids

    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    log = tmp_path / "fake.log"
    env = {"FAKE_VLLM_PIDS": str(tmp_path / "pids"), "PDLAB_MODEL_CACHE": str(tmp_path / "models"),
           "FAKE_VLLM_LOG": str(log)}
    s = Served(tmp_path, "disagg", "--set", "engine.backend=vllm", "--set", f"engine.python={exe}",
               "--set", "engine.args=[--fake-token-s, '0.02']", env=env)
    prompt = [5, 6, 7, 8]
    want = [(sum(prompt) * 31 + 7 * i + 3) % 512 for i in range(6)]
    try:
        sampled = s.request("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0.8, "top_p": 0.5,
                                                "seed": 3, "stop_token_ids": [want[2]]})
        long: list = []
        t = threading.Thread(target=lambda: long.append(leave_after(s, {"prompt": [9], "max_tokens": 400,
                                                                         "stream": True}, events=3)))
        t.start()
        t.join(60)
        deadline = time.monotonic() + 30
        while not any("closed" in e for e in fake_log(log)):
            assert time.monotonic() < deadline, "the vLLM server kept streaming to a client that left"
            time.sleep(0.1)
        code, _, stderr = s.stop()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0, stderr
    assert sampled[0] == 200, sampled[1]
    choice = json.loads(sampled[1])["choices"][0]
    assert choice["token_ids"] == want[:3] and choice["finish_reason"] == "stop" and choice["stop_reason"] == want[2]
    bodies = [e["body"] for e in fake_log(log) if "body" in e and e["body"]["prompt"] == prompt]
    assert sorted(b["max_tokens"] for b in bodies) == [1, 6]  # the prefill call, then the decode stream
    for b in bodies:
        assert (b["temperature"], b["top_p"], b["seed"], b["ignore_eos"], b["stop_token_ids"]) == \
            (0.8, 0.5, 3, False, [want[2]])
    recs = {r["prompt_ids"][0]: r for r in (json.loads(line) for line in open(s.out / "requests.jsonl"))}
    assert sorted(recs) == [5, 9] and long == [3]
    assert recs[5]["ok"] and recs[5]["output_ids"] == want[:3] and recs[5]["finish_reason"] == "stop"
    assert not recs[9]["ok"] and 3 <= recs[9]["output_len"] < 400  # aborted when its client left
    pids = read_pids(tmp_path / "pids")
    assert len(pids) == 2
    no_survivor(pids)
    s.nothing_left()


def fake_log(path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def leave_after(served: Served, body: dict, events: int) -> int:
    """Stream a completion and close the connection after `events` server-sent events; how many it read."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    n = 0
    while n < events:
        line = resp.fp.readline()
        n += line.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return n


@pytest.mark.slow
def test_a_dead_worker_ends_the_server_cleanly(tmp_path):
    """A worker killed mid-stream: its request ends with an error event, the server says why in one line,
    stops (exit 1) and leaves nothing behind, its records written."""
    s = Served(tmp_path, "unified")
    try:
        long: list = []
        t = stream_in_thread(s, {"prompt": eh.prompts([30], seed=4)[0], "max_tokens": 400, "ignore_eos": True,
                                 "stream": True}, long)
        worker = workers_of(s.proc.pid)[0]
        os.kill(worker, signal.SIGKILL)
        t.join(60)
        code = s.proc.wait(120)
        stderr = s.proc.stderr.read()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 1
    assert len([line for line in stderr.splitlines() if "failed" in line and "shutting down" in line]) == 1, stderr
    status, text = long[0]
    events = [line[6:] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    s.nothing_left()
    (rec,) = [json.loads(line) for line in open(s.out / "requests.jsonl")]
    assert not rec["ok"] and (s.out / "trace.json").exists()
