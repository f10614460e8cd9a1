"""One external server and its client, against the fake server: start, health, streamed tokens stamped at
the client (several tokens in one chunk share its time), stop with the whole process group gone."""

import os
import socket
import sys

import pytest

from pdlab.external.loop import ClientLoop
from pdlab.external.server import HOST, Server, ServerError, ServerSpec, free_port
from pdlab.external.stream import chunk_tokens, completion_body, stream_completion
from proc_helpers import running

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fake_vllm.py")


def spec(tmp_path, port, *extra):
    return ServerSpec("unified0", "unified", (sys.executable, FAKE, "--port", str(port), *extra),
                      (("FAKE_VLLM_PIDS", str(tmp_path / "pids")), ("FAKE_VLLM_TMP", str(tmp_path / "tmp"))),
                      port, str(tmp_path / "server.log"))


@pytest.fixture
def server(request, tmp_path):
    s = Server(spec(tmp_path, free_port(), *getattr(request, "param", ())))
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("server", [("--fake-chunk", "3", "--fake-child")], indirect=True)
def test_tokens_of_one_chunk_share_the_chunk_time(server, tmp_path):
    import time

    server.wait_ready(time.monotonic() + 300)  # deadlines against a hang, not speed bounds
    got = []
    loop = ClientLoop("test", 300.0)
    loop.start()
    try:
        final = loop.call(stream_completion(loop.session, f"http://{HOST}:{server.spec.port}/v1/completions",
                                            completion_body([1, 2, 3], 7, stream=True),
                                            lambda event, t: got.append((chunk_tokens(event), t))), timeout=300)
    finally:
        loop.close()
    assert [len(ids) for ids, _ in got] == [3, 3, 1]  # chunks as the server sent them
    assert [t for _, t in got] == sorted(t for _, t in got)
    assert final["usage"]["completion_tokens"] == 7 and final["finish_reason"] == "length"
    pids = [int(x) for x in open(tmp_path / "pids").read().split()]
    server.stop()
    assert not [p for p in pids if running(p)], "the server's child outlived stop()"


def test_a_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as held:
        held.bind((HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on {HOST} is in use"):
            Server(spec(tmp_path, port)).start()
    assert not os.path.exists(tmp_path / "pids")


def test_stop_is_idempotent_and_safe_before_start(tmp_path):
    s = Server(spec(tmp_path, free_port()))
    s.stop()
    s.start()
    s.stop()
    s.stop()
    assert s.proc.returncode is not None


def test_what_the_server_leaves_in_its_temporary_directory_goes_with_it(tmp_path):
    """vLLM leaves ipc:// sockets and vllm_dist_* files in tempfile.gettempdir() when its group is killed: the
    server's TMPDIR is a private directory that stop() removes."""
    import tempfile
    import time

    s = Server(spec(tmp_path, free_port(), "--fake-child"))
    try:
        s.start()
        s.wait_ready(time.monotonic() + 300)  # a hang guard, not a speed bound
        left = open(tmp_path / "tmp").read().split()
        assert len(left) == 1 and os.path.exists(left[0])
        assert os.path.dirname(left[0]) == s.tmp != tempfile.gettempdir()
    finally:
        s.stop()
    assert not os.path.exists(left[0]) and not os.path.exists(os.path.dirname(left[0]))
    assert s.tmp is None
