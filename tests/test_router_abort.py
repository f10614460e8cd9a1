"""Router.abort: a client gives a request up (a stop string matched, it went away, the server shuts down).
Every worker that holds the request is told to let go, and the request ends once, not ok, with the reason.
In push mode the decode blocks are not given back while the prefill worker may still write into them: the
decode worker hears of the abort only after the prefill worker stopped (its Aborted or PrefillDone)."""

import os
import threading
import time

import pytest

from pdlab.serve import messages as m
from pdlab.serve.events import RequestDone
from pdlab.serve.router import Router, WorkerState


def router(mode: str, disagg: bool = True, on_failure: str = "fail"):
    if disagg:
        states = [WorkerState("prefill0", "prefill", ["cpu:0"]), WorkerState("decode0", "decode", ["cpu:1"])]
    else:
        states = [WorkerState("unified0", "unified", ["cpu:0"])]
    for w in states:
        w.ready, w.block_size, w.kv_blocks, w.free_blocks = True, 8, 64, 64
    r = Router(None, states, mode=mode, first_token="decode", transfer_timeout_s=30, heartbeat_timeout_s=30,
               step_timeout_s=30, on_transfer_failure=on_failure)
    sent: list = []
    r.send = lambda worker, msg: sent.append((worker, msg))
    return r, sent


def dispatch(r: Router, msg) -> None:
    r.dispatch(m.encode(msg))


def done(r: Router) -> list[RequestDone]:
    return [e for e in r.events if isinstance(e, RequestDone)]


def aborts(sent, since: int = 0) -> list[str]:
    return [w for w, msg in sent[since:] if isinstance(msg, m.Abort)]


def test_abort_of_a_running_unified_request_tells_its_worker_and_ends_it_once():
    r, sent = router("pull", disagg=False)
    r.submit("a", list(range(10, 30)), {"max_tokens": 50})
    dispatch(r, m.Tokens("unified0", [["a", 7, 0, False]], time.monotonic()))
    r.abort("a", "stop string")
    assert aborts(sent) == ["unified0"]
    (d,) = done(r)
    assert (d.req_id, d.ok, d.error, d.output_ids) == ("a", False, "stop string", [7])
    assert not r.workers["unified0"].holds and "a" not in r.reqs
    r.abort("a", "again")  # ended: nothing more is sent or reported
    dispatch(r, m.Finished("unified0", "a", False, "aborted"))  # the worker's own word comes late
    assert len(done(r)) == 1 and aborts(sent) == ["unified0"]


def test_abort_in_pull_mode_reaches_both_holders():
    r, sent = router("pull")
    r.submit("a", list(range(10, 30)), {"max_tokens": 50})
    now = time.monotonic()
    dispatch(r, m.PrefillDone("prefill0", "a", 5, [0, 1, 2], 0, now, now))  # the decode worker pulls now
    assert [type(msg).__name__ for _, msg in sent] == ["Submit", "Pull"]
    r.abort("a", "client went away")
    assert sorted(aborts(sent)) == ["decode0", "prefill0"]
    assert [e.error for e in done(r)] == ["client went away"]


@pytest.mark.parametrize("confirm", ["Aborted", "PrefillDone"])
def test_abort_in_push_mode_waits_for_the_prefill_worker_before_the_decode_blocks_go_back(confirm):
    r, sent = router("push", on_failure="recompute")  # a user's abort is never recomputed
    r.submit("a", list(range(10, 30)), {"max_tokens": 50})
    dispatch(r, m.Reserved("decode0", "a", [4, 5, 6], 0))  # the prefill worker now writes into 4, 5, 6
    n = len(sent)
    r.abort("a", "stop string")
    assert aborts(sent, n) == ["prefill0"] and not done(r)  # the decode side keeps its blocks meanwhile
    now = time.monotonic()
    if confirm == "Aborted":
        dispatch(r, m.Aborted("prefill0", "a"))
    else:  # the step that pushed the last layer ended before the Abort was read
        dispatch(r, m.PrefillDone("prefill0", "a", 5, [0, 1, 2], 0, now, now, transfer=None))
    assert aborts(sent, n) == ["prefill0", "decode0"]
    assert not any(isinstance(msg, (m.Recompute, m.Admit)) for _, msg in sent[n:])
    assert [(e.ok, e.error) for e in done(r)] == [(False, "stop string")]


def test_abort_in_push_mode_after_a_dead_prefill_worker_ends_at_once():
    r, sent = router("push")
    r.submit("a", list(range(10, 30)), {"max_tokens": 50})
    dispatch(r, m.Reserved("decode0", "a", [4, 5, 6], 0))
    r.fail_worker("prefill0", "killed")  # the router fails what it held
    assert [e.ok for e in done(r)] == [False]
    r.abort("a")  # nothing left to abort
    assert len(done(r)) == 1


@pytest.mark.slow
def test_abort_through_workers_frees_every_block():
    """A running request aborted through the cluster: RequestDone(ok=False) with the reason, its tokens so far,
    and no KV block held on any worker afterwards (unified, and push mode with its fence)."""
    from pdlab.engine.config import EngineConfig
    from pdlab.recipe import Deployment, ModelSpec
    from pdlab.serve.cluster import Cluster, TokenEvent

    deployments = [{"unified": {"devices": ["cpu:0"]}},
                   {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm",
                    "mode": "push"}]
    for dep in deployments:
        with Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"),
                     EngineConfig.from_raw({"block_size": 8, "kv_blocks": 64}, "engine"),
                     Deployment.from_raw(dep, "deployment")) as c:
            c.start()
            # another thread's wake() makes a waiting poll return long before its timeout (pdlab serve's bridge)
            waker = threading.Timer(0.2, c.wake)
            waker.start()
            t0 = time.monotonic()
            assert c.poll(300) == [] and time.monotonic() - t0 < 150
            waker.join()
            c.submit("a", list(range(10, 40)), {"max_tokens": 400, "ignore_eos": True})
            c.submit("b", list(range(50, 70)), {"max_tokens": 4, "ignore_eos": True})
            tokens, ended = {"a": 0, "b": 0}, {}
            deadline = time.monotonic() + 60
            while len(ended) < 2:
                assert time.monotonic() < deadline
                for e in c.poll(0.2):
                    if isinstance(e, TokenEvent):
                        tokens[e.req_id] += 1
                        if e.req_id == "a" and tokens["a"] == 3:
                            c.abort("a", "stop string")
                    elif isinstance(e, RequestDone):
                        ended[e.req_id] = e
            assert (ended["a"].ok, ended["a"].error) == (False, "stop string") and 3 <= len(ended["a"].output_ids) < 400
            assert ended["b"].ok and len(ended["b"].output_ids) == 4  # the other request is not disturbed
            time.sleep(0.3)  # the Abort reaches the workers
            stats = c.kv_stats()
            assert all(s.requests == 0 and s.free_blocks == s.total_blocks and not s.leak
                       for s in stats.values()), stats
            pids = [w.pid for w in c.workers]
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
