"""A KV hand-over that fails never hangs a request and never leaks a block, under either failure policy.

Faults are injected where every transport's hand-over ends (pdlab.kv.faults: the decode worker's landing
notice), here every second hand-over a decode worker receives, with the shm transport (and nixl where it is
installed), pull and push:
- `drop`: the notice never comes; the decode reservation's lease runs out after transfer_timeout_s;
- `delay`: it comes after the lease ran out, and is ignored;
- `corrupt`: it names blocks other than those reserved, and is refused before anything is read.
With `on_transfer_failure: fail` those requests fail with the reason; with `recompute` they are prefilled
again on the decode worker and give exactly the tokens a single engine gives. Either way every block is
back on both sides afterwards and the cluster keeps serving.
"""

import time

import pytest

import engine_helpers as eh
from pdlab.constants import KV_FAULT_ENV
from pdlab.engine.config import EngineConfig
from pdlab.kv.faults import FaultInjector, FaultSpec, Landing
from pdlab.recipe import Deployment, ModelSpec
from pdlab.recipe.nixl import nixl_module
from pdlab.serve.cluster import Cluster
from test_cluster import _drain

ENGINE = {"block_size": 8, "kv_blocks": 48, "token_budget": 256, "max_running": 16}
PROMPTS = {f"f{i}": eh.prompts([12 + 7 * i], seed=20 + i)[0] for i in range(4)}
TIMEOUT_S = 1.5  # a tiny-llama hand-over takes milliseconds; the lease only has to outlast a busy box
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference():
    out = {}
    for rid, p in PROMPTS.items():
        got, _ = eh.run(eh.engine("tiny-llama", prefix_caching=False, kv_blocks=48, block_size=8), [p],
                        max_tokens=MAX_TOKENS)
        out[rid] = got["0"]
    return out


def _cluster(mode: str, policy: str, first_token: str = "decode", transport: str = "shm") -> Cluster:
    dep = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": mode,
           "first_token": first_token, "transfer_timeout_s": TIMEOUT_S, "on_transfer_failure": policy,
           "transport": transport}
    return Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"), EngineConfig.from_raw(ENGINE, "engine"),
                   Deployment.from_raw(dep, "deployment"))


def _serve(c: Cluster, ids: list[str]) -> tuple[dict, dict]:
    done, tokens, _ = _drain(c, ids)  # fails the test if a request hangs
    return done, tokens


def _no_block_held(c: Cluster) -> None:
    for name, s in c.kv_stats().items():
        assert s.free_blocks == s.total_blocks and s.requests == 0 and not s.leak, (name, s)


CASES = [
    pytest.param("drop", "pull", "fail", "lease ran out", id="drop-pull-fail"),
    pytest.param("drop", "push", "fail", "lease ran out", id="drop-push-fail"),
    pytest.param("drop", "pull", "recompute", "", id="drop-pull-recompute"),
    pytest.param("drop", "push", "recompute", "", id="drop-push-recompute"),
    pytest.param("delay", "pull", "recompute", "", id="delay-pull-recompute"),
    pytest.param("delay", "push", "fail", "lease ran out", id="delay-push-fail"),
    pytest.param("corrupt", "pull", "fail", "bad hand-over notice", id="corrupt-pull-fail"),
    pytest.param("corrupt", "push", "recompute", "", id="corrupt-push-recompute"),
]
NIXL = pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed: pip install -e '.[nixl]'")
CASES = [pytest.param(*c.values, "shm", id=f"{c.id}-shm") for c in CASES] + [
    pytest.param("drop", "pull", "fail", "lease ran out", "nixl", id="drop-pull-fail-nixl", marks=NIXL),
    pytest.param("drop", "push", "recompute", "", "nixl", id="drop-push-recompute-nixl", marks=NIXL),
    pytest.param("delay", "pull", "recompute", "", "nixl", id="delay-pull-recompute-nixl", marks=NIXL),
    pytest.param("corrupt", "push", "fail", "bad hand-over notice", "nixl", id="corrupt-push-fail-nixl", marks=NIXL),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,mode,policy,reason,transport", CASES)
def test_failed_hand_overs_follow_the_policy(fault, mode, policy, reason, transport, reference, monkeypatch):
    monkeypatch.setenv(KV_FAULT_ENV, f"{fault}:2")  # every second hand-over the decode worker receives
    # recompute with first_token from prefill: the first token, already delivered, is not sent twice
    c = _cluster(mode, policy, first_token="prefill" if policy == "recompute" and mode == "pull" else "decode",
                 transport=transport)
    try:
        c.start()
        for rid, p in PROMPTS.items():
            c.submit(rid, p, {"max_tokens": MAX_TOKENS, "ignore_eos": True})
        done, tokens = _serve(c, list(PROMPTS))
        hit = [d for d in done.values() if (not d.ok) or d.route == "recompute"]
        assert len(hit) == 2, [(d.req_id, d.ok, d.route, d.error) for d in done.values()]
        for rid, d in done.items():
            if policy == "fail" and d in hit:
                assert not d.ok and "KV hand-over failed" in d.error and reason in d.error, d.error
                continue
            assert d.ok, d.error
            assert d.output_ids == reference[rid], rid
            assert [e.token_id for e in tokens[rid]] == reference[rid]
            assert [e.index for e in tokens[rid]] == list(range(MAX_TOKENS))
            assert d.route == ("recompute" if d in hit else "remote")
        if fault == "delay":
            time.sleep(2 * TIMEOUT_S)  # the late notices arrive now, and must change nothing
        _no_block_held(c)
        # the run goes on: the next requests are served (their hand-overs may be faulted too)
        for rid, p in PROMPTS.items():
            c.submit(f"again-{rid}", p, {"max_tokens": MAX_TOKENS, "ignore_eos": True})
        again, _ = _serve(c, [f"again-{rid}" for rid in PROMPTS])
        assert sum(d.ok for d in again.values()) >= (4 if policy == "recompute" else 2)
        if fault == "delay":
            time.sleep(2 * TIMEOUT_S)
        _no_block_held(c)
    finally:
        c.stop()


def test_fault_spec_and_injector():
    assert FaultSpec.parse("drop") == FaultSpec("drop", 1) and FaultSpec.parse("corrupt:3") == FaultSpec("corrupt", 3)
    for bad in ("explode", "drop:0", "drop:x"):
        with pytest.raises(ValueError, match=KV_FAULT_ENV):
            FaultSpec.parse(bad)
    landing = Landing("r", (4, 5), 7)
    assert FaultInjector(None, 1.0).filter(landing) is landing  # off: untouched
    corrupt = FaultInjector(FaultSpec("corrupt", 2), 1.0)
    assert corrupt.filter(landing) is landing and corrupt.filter(landing).blocks != landing.blocks
    delay = FaultInjector(FaultSpec("delay"), 0.05)
    assert delay.filter(landing) is None and delay.due() == []
    time.sleep(0.06)
    assert delay.due() == [landing] and delay.due() == []
    assert FaultInjector(FaultSpec("drop"), 1.0).filter(landing) is None


@pytest.mark.slow
def test_a_push_lease_does_not_run_out_while_the_prefill_queue_is_long(monkeypatch):
    """Push reserves decode blocks before the prefill runs. Six requests queue at a prefill worker whose steps
    take 0.3 s (a timed engine), one prompt per step: the last waits about 1.8 s, beyond its 1 s lease, but
    the router renews the leases of requests its live prefill worker still holds, so none fails."""
    monkeypatch.delenv(KV_FAULT_ENV, raising=False)
    dep = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "push",
           "transfer_timeout_s": 1.0}
    c = Cluster(ModelSpec.from_raw({"preset": "tiny-llama", "timing": {"fixed_ms": 300}}, "model"),
                EngineConfig.from_raw({**ENGINE, "token_budget": 40}, "engine"), Deployment.from_raw(dep, "deployment"))
    try:
        c.start()
        ids = [f"q{i}" for i in range(6)]
        for i, rid in enumerate(ids):
            c.submit(rid, eh.prompts([30], seed=40 + i)[0], {"max_tokens": 2, "ignore_eos": True})
        done, _ = _serve(c, ids)
        assert all(d.ok for d in done.values()), [d.error for d in done.values() if not d.ok]
        spread = max(d.phases["prefill_end"] for d in done.values()) - min(d.phases["queued"] for d in done.values())
        assert spread > 1.5  # the last one did wait longer than a lease
        _no_block_held(c)
    finally:
        c.stop()


def test_a_failed_push_reservation_keeps_its_blocks_until_the_router_says_then_recomputes():
    """In-process, the decode handler as Worker.serve drives it: an Admit naming blocks other than those
    reserved is refused before anything is read; the blocks stay reserved (the prefill worker might still
    be writing into them) however long the router takes; `Recompute` then gives them back and prefills the
    request here, keeping its first token, with the tokens a single engine gives."""
    from test_pull_async import CFG, PROMPT_B, FakeWorker, _loop, _until

    from pdlab.serve import messages as m
    from pdlab.serve.handlers import RoleHandler

    params = {"max_tokens": 5, "ignore_eos": True}
    ref, _ = eh.run(eh.engine(prefix_caching=False, **CFG), [PROMPT_B], max_tokens=5)
    deng = eh.engine(role="decode", **CFG)
    w = FakeWorker(deng, None, timeout=0.05)
    w.spec.mode = "push"
    h = RoleHandler(w)
    try:
        h.handle(m.Reserve("b", PROMPT_B, params))
        (res,) = w.about("b", m.Reserved)
        held = deng.blocks.num_blocks - deng.blocks.num_free
        h.handle(m.Admit("b", ref["0"][0], [b + 1 for b in res.blocks[res.skip:]]))
        (fail,) = w.about("b", m.TransferFailed)
        assert "refused a bad hand-over notice" in fail.reason
        _loop(h, 3)
        time.sleep(0.1)  # well past the 0.05 s lease
        _loop(h, 3)
        assert deng.blocks.num_blocks - deng.blocks.num_free == held and not deng.has_work()
        assert len(w.about("b", m.TransferFailed)) == 1 and not w.about("b", m.Transferred)
        h.handle(m.Recompute("b", PROMPT_B, params, ref["0"][0]))
        _until(h, lambda: w.about("b", m.Finished))
        assert w.tokens("b") == ref["0"]  # the kept first token, sent once, then the recomputed rest
        deng.check_idle()
    finally:
        h.close()
