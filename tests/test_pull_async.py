"""Pull mode copies KV beside the decode loop: running requests keep decoding while a pull is in flight.

The handler tests drive a decode RoleHandler in-process the way Worker.serve does (poll_pending, then a
step), with a copy function that blocks on an event: deterministic, no timing assumptions. The end-to-end
test checks a real 1P1D pull cluster still gives the unified engine's tokens with the copy off the loop.
"""

import threading
import time
import types

import pytest
import torch

from pdlab.engine import SamplingParams
from pdlab.kv.pull import PullCopier
from pdlab.kv.copy import block_bytes, copy_blocks
from pdlab.serve import messages as m
from pdlab.serve.handlers import RoleHandler
import engine_helpers as eh

CFG = {"block_size": 8, "kv_blocks": 48, "token_budget": 256, "max_running": 16}
PROMPT_A = eh.prompts([21], seed=11)[0]
PROMPT_B = eh.prompts([45], seed=12)[0]


class Gate:
    """A copy function that waits for `release` before copying (and says when it was entered)."""

    def __init__(self, error=None):
        self.entered, self.release, self.error = threading.Event(), threading.Event(), error

    def __call__(self, *args, **kw):
        self.entered.set()
        assert self.release.wait(30), "gate never released"
        if self.error:
            raise self.error
        return copy_blocks(*args, **kw)


class FakeTransport:
    name = "shm"

    def __init__(self, pools):
        self.pools = pools

    def open(self, handle):
        return self.pools[handle["name"]]

    def copy(self, *args, **kw):
        return copy_blocks(*args, **kw)

    def path(self, peer):
        return self.name


class FakeWorker:
    """What RoleHandler uses of a Worker: name, role, engine, spec, transport, send, step_record."""

    def __init__(self, engine, src_pool, timeout=30.0):
        self.name, self.role, self.engine = "decode0", "decode", engine
        self.spec = types.SimpleNamespace(mode="pull", transfer_timeout_s=timeout, first_token="decode",
                                          model=types.SimpleNamespace(timing=None), transport="shm",
                                          report_cache=False)
        self.transport = FakeTransport({"prefill0-kv": src_pool})
        self.sent, self.steps = [], []

    def send(self, msg):
        self.sent.append(msg)

    def step_record(self, rec):
        self.steps.append(rec)

    def about(self, req_id, kind):
        return [x for x in self.sent if isinstance(x, kind) and x.req_id == req_id]

    def tokens(self, req_id):
        return [tok for x in self.sent if isinstance(x, m.Tokens) for rid, tok, _, _ in x.items if rid == req_id]


def _prefill(peng, rid, prompt, max_tokens):
    """Run a prompt through a prefill engine; the Pull a router would send for it."""
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    peng.add(rid, prompt, SamplingParams(**params))
    while peng.has_work():
        peng.step()
    info = peng.handoff(rid)
    return m.Pull(rid, prompt, params, info.first_token, "prefill0", {"name": "prefill0-kv"}, info.block_ids)


def _setup(timeout=30.0, copy_fn=copy_blocks):
    peng, deng = eh.engine(role="prefill", **CFG), eh.engine(role="decode", **CFG)
    w = FakeWorker(deng, peng.kv, timeout)
    h = RoleHandler(w)
    h.intake.puller = PullCopier(deng.kv, copy_fn=copy_fn)
    return peng, deng, w, h


def _loop(h, n=1):
    """n iterations of Worker.serve's loop, messages aside."""
    for _ in range(n):
        h.poll_pending()
        if h.eng.has_work():
            h.step()


def _until(h, cond, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        _loop(h)


def test_decode_steps_while_a_pull_copies():
    gate = Gate()
    peng, deng, w, h = _setup()
    try:
        h.intake.puller.copy_fn = copy_blocks  # request a: an ordinary pull, then it decodes
        h.handle(_prefill(peng, "a", PROMPT_A, 30))
        _until(h, lambda: len(w.tokens("a")) >= 3)
        assert w.about("a", m.Transferred)
        h.intake.puller.copy_fn = gate  # request b: its copy is held until we release it
        h.handle(_prefill(peng, "b", PROMPT_B, 6))
        assert gate.entered.wait(10)
        before = len(w.tokens("a"))
        _loop(h, 5)
        assert len(w.tokens("a")) == before + 5, "decode stalled while the pull was in flight"
        assert h.has_pending() and not w.about("b", m.Transferred) and deng.num_running == 1
        gate.release.set()
        _until(h, lambda: w.about("b", m.Transferred))
        (tr,) = w.about("b", m.Transferred)
        rec = tr.record
        inside = [s for s in w.steps if s.decode_seqs >= 1 and rec["start"] <= s.start and s.end <= rec["end"]]
        assert len(inside) >= 5, "no decode step inside the copy's interval"
        assert rec["mode"] == "pull" and rec["src"] == "prefill0" and rec["dst"] == "decode0"
        assert rec["blocks"] == -(-len(PROMPT_B) // 8) and rec["bytes"] == rec["blocks"] * block_bytes(deng.kv)
        assert rec["copy_s"] == pytest.approx(rec["end"] - rec["start"]) and rec["end"] <= tr.admitted
        _until(h, lambda: not deng.has_work() and not h.has_pending())
        peng.release("a"), peng.release("b")
        for rid, prompt, n in (("a", PROMPT_A, 30), ("b", PROMPT_B, 6)):
            ref, _ = eh.run(eh.engine(prefix_caching=False, **{**CFG}), [prompt], max_tokens=n)
            assert w.tokens(rid) == ref["0"], rid
            (fin,) = w.about(rid, m.Finished)
            assert fin.ok
        deng.check_idle(), peng.check_idle()
    finally:
        gate.release.set()
        h.close()


def test_abort_during_the_copy_frees_the_blocks_after_it():
    gate = Gate()
    peng, deng, w, h = _setup(copy_fn=gate)
    try:
        h.handle(_prefill(peng, "b", PROMPT_B, 6))
        assert gate.entered.wait(10)
        h.handle(m.Abort("b"))
        _loop(h, 3)
        # the copy still writes into b's blocks: they must not go back to the pool yet
        assert deng.blocks.num_free == deng.blocks.num_blocks - (-(-len(PROMPT_B) // 8))
        assert h.has_pending()
        gate.release.set()
        _until(h, lambda: not h.has_pending())
        assert not w.about("b", m.Transferred) and not w.about("b", m.Finished) and not w.tokens("b")
        assert deng.blocks.num_free == deng.blocks.num_blocks
        deng.check_idle()
    finally:
        gate.release.set()
        h.close()


def test_a_pull_that_does_not_finish_in_time_fails_and_is_never_admitted():
    """The lease runs out: the hand-over is reported failed (the router applies the failure policy), and
    the blocks go back only once the copy, which may still be writing into them, has ended."""
    gate = Gate()
    peng, deng, w, h = _setup(timeout=0.05, copy_fn=gate)
    try:
        h.handle(_prefill(peng, "b", PROMPT_B, 6))
        assert gate.entered.wait(10)
        _until(h, lambda: w.about("b", m.TransferFailed))
        (fail,) = w.about("b", m.TransferFailed)
        assert "did not complete within" in fail.reason and "lease ran out" in fail.reason
        assert deng.blocks.num_free < deng.blocks.num_blocks and h.has_pending()  # held until the copy ends
        gate.release.set()
        _until(h, lambda: not h.has_pending())
        _loop(h, 3)
        assert not w.about("b", m.Transferred) and not deng.has_work() and len(w.about("b", m.TransferFailed)) == 1
        assert not w.about("b", m.Finished)
        deng.check_idle()
    finally:
        gate.release.set()
        h.close()


def test_a_copy_that_raises_fails_the_request():
    gate = Gate(error=RuntimeError("boom"))
    gate.release.set()
    peng, deng, w, h = _setup(copy_fn=gate)
    try:
        h.handle(_prefill(peng, "b", PROMPT_B, 6))
        _until(h, lambda: not h.has_pending())
        (fail,) = w.about("b", m.TransferFailed)
        assert "KV pull from prefill0 failed: boom" in fail.reason
        assert not w.about("b", m.Transferred)
        deng.check_idle()
    finally:
        h.close()


def test_copier_copies_reports_and_closes():
    src, dst = torch.randn(2, 2, 8, 4, 2, 8), torch.zeros(2, 2, 8, 4, 2, 8)
    gate = Gate()
    cp = PullCopier(dst, copy_fn=gate)
    job = cp.submit("r1", src, [1, 2, 5], [0, 3, 4])
    queued = cp.submit("r2", src, [6], [7])
    assert gate.entered.wait(10) and cp.busy and cp.poll() == []
    cp.wait(0.01)  # nothing ended: returns after the timeout
    threading.Timer(0.2, gate.release.set).start()
    cp.close()  # skips the queued job, waits for the running one
    assert not cp._thread.is_alive()
    assert cp.poll() == [job, queued]
    assert job.error is None and job.bytes == 3 * block_bytes(src) and 0 < job.start <= job.end
    assert torch.equal(dst[:, :, [0, 3, 4]], src[:, :, [1, 2, 5]])
    assert queued.start == 0 and queued.error == "cancelled before it started" and not dst[:, :, 7].any()


@pytest.mark.slow
def test_pull_cluster_matches_unified_with_a_long_decode_running():
    """A long decode runs while other requests are pulled in: every output equals the unified engine's,
    and each transfer record is a real copy interval that ends before its request is admitted."""
    from test_cluster import Cluster, _drain

    long_a = eh.prompts([30], seed=21)[0]
    others = {f"p{i}": eh.prompts([200 + 40 * i], seed=30 + i)[0] for i in range(4)}
    engine = {**CFG, "kv_blocks": 256, "max_model_len": 1024}
    c = Cluster({"preset": "tiny-llama"}, engine,
                {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"})
    try:
        c.start()
        c.submit("long", long_a, {"max_tokens": 120, "ignore_eos": True})
        time.sleep(0.5)
        for rid, p in others.items():
            c.submit(rid, p, {"max_tokens": 8, "ignore_eos": True})
        done, tokens, other = _drain(c, ["long", *others], timeout=120)
        stats = c.kv_stats()
    finally:
        c.stop()
    for rid, p in {"long": long_a, **others}.items():
        ref, _ = eh.run(eh.engine(prefix_caching=False, **engine), [p], max_tokens=120 if rid == "long" else 8)
        assert done[rid].ok, done[rid].error
        assert done[rid].output_ids == ref["0"], rid
    from pdlab.serve.cluster import TransferEvent

    recs = {e.record["request"]: e.record for e in other if isinstance(e, TransferEvent)}
    assert set(recs) == set(done)
    for rid, r in recs.items():
        ph = done[rid].phases
        assert r["start"] <= r["end"] <= ph["admitted"] and r["copy_s"] == pytest.approx(r["end"] - r["start"])
    for name, s in stats.items():
        assert s.free_blocks == s.total_blocks and s.requests == 0 and not s.leak, (name, s)
