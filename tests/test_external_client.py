"""The HTTP client of external backends (pdlab.external.client): one event loop drives 512 concurrent streams
(every one open at the same time: no connection limit), each token stamped once, in order, at or after the
server sent it; several tokens in one chunk share its time; a stopped cluster leaves no thread behind."""

import json
import threading
import time
import urllib.request

from pdlab.external.endpoint import EndpointCluster
from pdlab.recipe import parse_recipe
from pdlab.serve.events import RequestDone, TokenEvent
from test_endpoint import FakeServer

STREAMS = 512


def cluster_for(server, log_dir) -> EndpointCluster:
    v = parse_recipe({"rates": [1], "model": {"preset": "tiny-llama"},
                      "engine": {"backend": "endpoint", "url": server.url, "model": "fake-model"},
                      "deployment": {"endpoint": {"devices": 1, "kind": "unified"}}}).resolved("default")
    return EndpointCluster(v, v.deployment, label="client-test", log_dir=None if log_dir is None else str(log_dir))


def drain(c, n: int, timeout: float = 120) -> tuple[dict, dict]:
    tokens: dict[str, list] = {}
    done: dict[str, RequestDone] = {}
    deadline = time.monotonic() + timeout
    while len(done) < n:
        assert time.monotonic() < deadline, f"{len(done)} of {n} requests finished"
        for e in c.poll(1.0):
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.req_id, []).append(e)
            elif isinstance(e, RequestDone):
                done[e.req_id] = e
    return tokens, done


def test_one_loop_drives_512_concurrent_streams(tmp_path):
    server = FakeServer(tmp_path, "--token-s", "0.02", "--hold", str(STREAMS))
    threads_before = threading.active_count()
    try:
        with cluster_for(server, tmp_path) as c:
            c.start()
            sent = time.monotonic()
            for i in range(STREAMS):
                c.submit(str(i), [i % 500, 1, 2], {"max_tokens": 20})
            tokens, done = drain(c, STREAMS)
        stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/fake/stats", timeout=5))
    finally:
        server.stop()
    assert all(d.ok for d in done.values()), next(d.error for d in done.values() if not d.ok)
    assert stats["max_inflight"] == STREAMS  # all open at once: nothing queued behind a connection limit
    for i in range(STREAMS):
        evs = tokens[str(i)]
        assert [e.index for e in evs] == list(range(20))
        assert [e.token_id for e in evs] == [((i % 500 + 3) * 31 + 7 * k + 3) % 512 for k in range(20)]
        assert all(a.t <= b.t for a, b in zip(evs, evs[1:])) and evs[0].t > sent  # chunks of one read share a time
        assert done[str(i)].client["chunks"] == [1] * 20 and done[str(i)].client["usage"]["completion_tokens"] == 20
    assert threading.active_count() <= threads_before  # the loop thread ended with the cluster


def test_tokens_of_one_chunk_share_its_time(tmp_path):
    """Each chunk's tokens carry one time, chunk after chunk in order. Two chunks may still share a time: a
    busy box can deliver both in one read (seen in CI with 2 ms between them), and a read is stamped once."""
    server = FakeServer(tmp_path, "--chunk", "3", "--token-s", "0.05")
    try:
        with cluster_for(server, tmp_path) as c:
            c.start()
            c.submit("a", [1, 2, 3], {"max_tokens": 7})
            tokens, done = drain(c, 1)
            assert c.multi_token_chunks == 2
    finally:
        server.stop()
    times = [e.t for e in tokens["a"]]
    assert done["a"].client["chunks"] == [3, 3, 1]
    assert len(set(times[:3])) == 1 and len(set(times[3:6])) == 1 and times[0] <= times[3] <= times[6]


def test_a_loop_that_cannot_be_made_fails_start_instead_of_hanging_it(monkeypatch):
    import pytest

    from pdlab.external import loop as client_loop

    def broken():
        raise RuntimeError("no loop here")

    monkeypatch.setattr(client_loop, "new_loop", broken)
    c = client_loop.ClientLoop("broken", 5.0)
    with pytest.raises(RuntimeError, match="no loop here"):
        c.start()


def test_a_cluster_without_a_run_directory_writes_nothing(tmp_path, monkeypatch):
    """A client of its own (a benchmark) has no run directory to record what served it: nothing is written,
    not even a scratch folder left behind in the temp directory."""
    import os
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    server = FakeServer(tmp_path, "--token-s", "0.001")
    try:
        with cluster_for(server, None) as c:
            c.start()
            c.submit("0", [1, 2, 3], {"max_tokens": 3})
            _, done = drain(c, 1)
    finally:
        server.stop()
    assert done["0"].ok and os.listdir(scratch) == [] and not (tmp_path / "client-test.json").exists()
