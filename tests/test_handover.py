"""The hand-over protocol as objects: one per mode and side (the router's half, pdlab.serve.handover; the
prefill worker's, pdlab.serve.sender; the decode worker's, pdlab.serve.intake), with public interfaces, and
each request's state at the router an explicit ReqState, its phases only timestamps."""

import ast
import os
import time

import pytest

from pdlab.serve import messages as m
from pdlab.serve.events import RequestDone
from pdlab.serve.handover import PullHandOver, PushHandOver
from pdlab.serve.request import ReqState
from pdlab.serve.router import Router, WorkerState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = list(range(10, 30))


def router(mode: str, on_failure: str = "fail"):
    states = [WorkerState("prefill0", "prefill", ["cpu:0"]), WorkerState("decode0", "decode", ["cpu:1"])]
    for w in states:
        w.ready, w.block_size, w.kv_blocks, w.free_blocks = True, 8, 64, 64
    r = Router(None, states, mode=mode, first_token="decode", transfer_timeout_s=30, heartbeat_timeout_s=30,
               step_timeout_s=30, on_transfer_failure=on_failure)
    sent: list = []
    r.send = lambda worker, msg: sent.append((worker, type(msg).__name__))
    return r, sent


def dispatch(r: Router, msg) -> None:
    r.dispatch(m.encode(msg))


def state(r: Router, rid: str = "a"):
    return r.reqs[rid].state if rid in r.reqs else None


def ended(r: Router) -> list:
    return [(e.req_id, e.ok, e.route) for e in r.events if isinstance(e, RequestDone)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_request_goes_through_its_states_and_its_phases_only_record_when(mode):
    r, sent = router(mode)
    assert isinstance(r.handover, {"pull": PullHandOver, "push": PushHandOver}[mode])
    r.submit("a", PROMPT, {"max_tokens": 4})
    if mode == "push":
        assert state(r) is ReqState.QUEUED and sent[-1] == ("decode0", "Reserve")
        dispatch(r, m.Reserved("decode0", "a", [4, 5, 6], 0))
    assert state(r) is ReqState.PREFILLING and sent[-1] == ("prefill0", "Submit")
    now = time.monotonic()
    transfer = {"start": now, "end": now} if mode == "push" else None
    dispatch(r, m.PrefillDone("prefill0", "a", 7, [0, 1, 2], 0, now, now, transfer, [4, 5, 6] if transfer else []))
    assert state(r) is ReqState.TRANSFERRING and sent[-1] == ("decode0", {"pull": "Pull", "push": "Admit"}[mode])
    assert "admitted" not in r.reqs["a"].phases
    dispatch(r, m.Transferred("decode0", "a", time.monotonic()))
    assert state(r) is ReqState.DECODING and sent[-1] == ("prefill0", "Release")
    assert r.reqs["a"].phases["admitted"] > 0
    dispatch(r, m.Finished("decode0", "a", True))
    assert state(r) is None and ended(r) == [("a", True, "remote")]


def test_a_local_prefill_decodes_from_its_first_token():
    r, sent = router("pull")
    r.remote_min = 100  # selective: 20 uncached tokens < 100, prefilled by the decode worker
    r.submit("a", PROMPT, {"max_tokens": 4})
    assert state(r) is ReqState.PREFILLING and sent[-1] == ("decode0", "Submit") and r.reqs["a"].route == "local"
    dispatch(r, m.Tokens("decode0", [["a", 7, 0, False]], time.monotonic()))
    assert state(r) is ReqState.DECODING


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_follows_the_policy(policy):
    r, sent = router("pull", on_failure=policy)
    r.submit("a", PROMPT, {"max_tokens": 4})
    now = time.monotonic()
    dispatch(r, m.PrefillDone("prefill0", "a", 7, [0, 1, 2], 0, now, now))
    dispatch(r, m.TransferFailed("decode0", "a", "copy failed"))
    if policy == "fail":
        assert ended(r) == [("a", False, "remote")]
    else:
        assert state(r) is ReqState.PREFILLING and r.reqs["a"].route == "recompute"
        assert sent[-2:] == [("prefill0", "Abort"), ("decode0", "Recompute")]


def test_a_push_that_fails_while_its_prefill_writes_is_fenced_until_the_prefill_worker_stopped():
    r, sent = router("push", on_failure="recompute")
    r.submit("a", PROMPT, {"max_tokens": 4})
    dispatch(r, m.Reserved("decode0", "a", [4, 5, 6], 0))
    dispatch(r, m.TransferFailed("decode0", "a", "lease ran out"))
    assert state(r) is ReqState.FENCED and sent[-1] == ("prefill0", "Abort")
    r.check_health(time.monotonic() + 1000)  # a fenced request has no hand-over timeout of its own
    assert state(r) is ReqState.FENCED
    dispatch(r, m.Aborted("prefill0", "a"))
    assert state(r) is ReqState.PREFILLING and r.reqs["a"].route == "recompute" and sent[-1] == ("decode0", "Recompute")


def test_a_hand_over_that_does_not_end_in_time_fails():
    r, sent = router("pull")
    r.submit("a", PROMPT, {"max_tokens": 4})
    now = time.monotonic()
    dispatch(r, m.PrefillDone("prefill0", "a", 7, [0, 1, 2], 0, now, now))
    r.check_health(now + 10)
    assert state(r) is ReqState.TRANSFERRING
    r.check_health(now + 33)  # transfer_timeout_s 30, +2 s for the decode worker's own lease
    assert ended(r) == [("a", False, "remote")]


def _private_uses(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "super":
                continue
            out.append(f"{os.path.basename(path)}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_the_serving_objects_use_each_others_public_interfaces_only():
    serve = os.path.join(ROOT, "pdlab", "serve")
    stdlib = {"os", "sys", "forkserver", "resource_tracker"}  # launch.py: the stdlib's own helpers, documented there
    found = [u for f in sorted(os.listdir(serve)) if f.endswith(".py") for u in _private_uses(os.path.join(serve, f))
             if u.split(": ")[1].split(".")[0] not in stdlib]
    assert found == []


def test_the_checker_finds_a_call_to_another_objects_private_method(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("class A:\n    def f(self):\n        self._ok()\n        self.h._fail()\n        super()._g()\n")
    assert _private_uses(str(p)) == ["x.py:4: self.h._fail"]


def test_a_worker_silent_right_after_ready_is_failed_within_the_heartbeat_timeout():
    """The start-up grace (imports, model load) ends at Ready: a worker that hangs at its first step must not
    keep the grace a launcher gave it (60 s)."""
    r, _ = router("pull")

    class Alive:
        pid, exitcode = 1, None

        def kill(self):
            self.exitcode = -9

    w = r.workers["decode0"]
    w.ready, w.proc = False, Alive()
    now = time.monotonic()
    w.last_hb = now + 60  # what the launcher grants before the first heartbeat
    r.check_health(now + 40)  # heartbeat_timeout_s 30: still loading, within its grace
    assert w.failed is None
    dispatch(r, m.Ready("decode0", 1, None, 64, 8))
    r.check_health(now + 40)
    assert w.failed is not None and "no heartbeat" in w.failed and w.proc.exitcode == -9
