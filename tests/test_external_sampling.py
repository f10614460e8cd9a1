"""The vLLM backend's client under `pdlab serve` (pdlab.external.client, .cluster), against tests/data/fake_vllm.py:
each request's sampling reaches the servers (the prefill call's too), what the harness asks stays greedy with
EOS ignored, a stop token ends the stream, `abort` closes the request's stream (the server sees the client
leave, as vLLM does before aborting it) and is followed by a failed RequestDone, and `wake` ends a waiting
poll."""

import json
import sys
import threading
import time

import pytest

from pdlab.external.client import vllm_sampling
from pdlab.external.cluster import ExternalCluster
from pdlab.recipe import parse_recipe
from pdlab.serve.events import RequestDone, TokenEvent
from test_external import FAKE, no_survivor, read_pids

DEPLOYMENTS = {"unified": {"unified": {"devices": ["cpu:0"]}},
               "disagg": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}}}
ASKED = {"max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "seed": 11, "ignore_eos": False, "stop_token_ids": [500]}
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 11, "ignore_eos": False, "stop_token_ids": [500]}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A started ExternalCluster on fake servers; `cluster(kind, *server_args)`. Every server is gone after."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("PDLAB_MODEL_CACHE", str(tmp_path / "models"))
    made = []

    def make(kind: str, *args: str) -> ExternalCluster:
        v = parse_recipe({"rates": [1], "model": {"preset": "tiny-llama"}, "deployment": DEPLOYMENTS[kind],
                          "engine": {"backend": "vllm", "python": str(exe), "args": list(args)}}).resolved("default")
        c = ExternalCluster(v, v.deployment, label="t", log_dir=str(tmp_path / "servers"))
        made.append(c)
        c.start()
        return c

    yield make
    for c in made:
        c.stop()
    no_survivor(read_pids(tmp_path / "pids"))


def fake_log(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "log")]


def until_done(c: ExternalCluster, req_id: str, timeout: float = 60) -> tuple[list[TokenEvent], RequestDone]:
    """Poll until `req_id` is done: its TokenEvents (from now on) and its RequestDone. Other requests' events
    are kept for their own call (in `c.seen`)."""
    seen = c.__dict__.setdefault("seen", [])
    deadline = time.monotonic() + timeout
    while not any(isinstance(e, RequestDone) and e.req_id == req_id for e in seen):
        assert time.monotonic() < deadline, f"{req_id} did not finish"
        seen.extend(c.poll(1.0))
    mine = [e for e in seen if e.req_id == req_id]
    seen[:] = [e for e in seen if e.req_id != req_id]
    return [e for e in mine if isinstance(e, TokenEvent)], next(e for e in mine if isinstance(e, RequestDone))


def test_what_the_harness_asks_stays_greedy_with_eos_ignored():
    assert vllm_sampling({"max_tokens": 9, "ignore_eos": True}) == {"temperature": 0.0, "top_p": 1.0,
                                                                    "ignore_eos": True}
    assert vllm_sampling({"max_tokens": 9}) == {"temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
    assert vllm_sampling(ASKED) == SAMPLING
    assert "seed" not in vllm_sampling({**ASKED, "seed": None, "stop_token_ids": []})


@pytest.mark.parametrize("kind", ["unified", "disagg"])
def test_the_requests_sampling_reaches_every_server_it_goes_to(tmp_path, cluster, kind):
    c = cluster(kind)
    c.submit("a", [1, 2, 3], ASKED)
    c.submit("h", [4, 5, 6], {"max_tokens": 6, "ignore_eos": True})  # the harness's request
    until_done(c, "a")
    until_done(c, "h")
    bodies = {(b["prompt"][0], b["stream"]): b for b in (e["body"] for e in fake_log(tmp_path))}
    calls = [(1, True), (4, True)] + ([(1, False), (4, False)] if kind == "disagg" else [])
    assert sorted(bodies) == sorted(calls)
    for (first, streamed), b in bodies.items():
        want = SAMPLING if first == 1 else {"temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
        assert {k: b.get(k) for k in SAMPLING} == {k: want.get(k) for k in SAMPLING}
        assert b["max_tokens"] == (6 if streamed else 1)  # the prefill call asks one token, as vLLM's proxy


def test_a_stop_token_ends_the_request_with_it(cluster):
    c = cluster("unified")
    want = [((1 + 2 + 3) * 31 + 7 * i + 3) % 512 for i in range(8)]
    c.submit("s", [1, 2, 3], {"max_tokens": 8, "stop_token_ids": [want[3]], "ignore_eos": False})
    toks, done = until_done(c, "s")
    assert done.ok and done.output_ids == want[:4] == [e.token_id for e in toks]
    assert [e.finished for e in toks] == [False, False, False, True]  # the server's last chunk, not max_tokens


@pytest.mark.parametrize("kind", ["unified", "disagg"])
def test_abort_closes_the_stream_and_fails_the_request(tmp_path, cluster, kind):
    c = cluster(kind, "--fake-token-s", "0.05")
    c.submit("long", [1, 2, 3], {"max_tokens": 400})
    seen, deadline = 0, time.monotonic() + 60
    while seen < 3:
        assert time.monotonic() < deadline, "no tokens"
        seen += sum(isinstance(e, TokenEvent) for e in c.poll(1.0))
    c.abort("long", "a stop string matched")
    toks, done = until_done(c, "long")
    assert not done.ok and done.error == "a stop string matched" and 3 <= len(done.output_ids) < 400
    deadline = time.monotonic() + 30
    while not any("closed" in e for e in fake_log(tmp_path)):  # the server's next write finds the stream closed
        assert time.monotonic() < deadline, "the server kept streaming to nobody"
        time.sleep(0.1)
    (closed,) = [e["closed"] for e in fake_log(tmp_path) if "closed" in e]
    assert closed < 400
    c.abort("long")  # it has ended: nothing more
    c.submit("next", [7], {"max_tokens": 2})  # the cluster serves on
    _, after = until_done(c, "next")
    assert after.ok and not [e for e in c.poll(0.2) if isinstance(e, RequestDone)]


def test_abort_before_the_request_starts_sends_nothing(tmp_path, cluster):
    c = cluster("unified")
    busy, release = threading.Event(), threading.Event()

    def block() -> None:  # holds the loop: what is handed to it meanwhile waits, in order
        busy.set()
        release.wait(30)

    c.client.loop.call_soon_threadsafe(block)
    assert busy.wait(30)
    c.submit("early", [1, 2], {"max_tokens": 4})
    c.abort("early", "client left")  # handled on the loop before the request's first step
    release.set()
    toks, done = until_done(c, "early")
    assert not done.ok and done.error == "client left" and not toks
    assert not (tmp_path / "log").exists()  # nothing was sent


def test_wake_ends_a_waiting_poll(cluster):
    c = cluster("unified")
    got: list = []
    t = threading.Thread(target=lambda: got.append(c.poll(600)))
    t.start()
    time.sleep(0.2)
    c.wake()
    t.join(60)
    assert not t.is_alive() and got == [[]]  # returned, with nothing: the wake-up is not an event
