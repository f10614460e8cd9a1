"""Contention (pdlab.timing.contention): a step's context in a run, the figures read back from steps, the
profile's section, and the simulator stepping by it so that what it simulates is what the estimate reads."""

import pytest

from pdlab.recipe import parse_recipe
from pdlab.recipe.timing import ContentionTiming, StepTiming, parse_timing
from pdlab.fields import RecipeError
from pdlab.sim.simulator import Simulator
from pdlab.timing.contention import context, contention_raw, describe, estimate, predicted_ms
from pdlab.timing.replay import worker_paces
from pdlab.workload import build_requests

STEP = {"fixed_ms": 2.0, "prefill_token_ms": 0.5, "decode_seq_ms": 1.0}
COUNTS = ("prefill_tokens", "decode_seqs", "context_tokens", "prefill_pairs", "chunks", "fresh_pairs",
          "resumed_pairs", "resumed_context")


def step(worker, start, ms, prefill=0, decode=0):
    rec = {"variant": "v", "rate": 1.0, "repeat": 0, "worker": worker, "start": start, "end": start + ms / 1e3}
    rec.update({k: 0 for k in COUNTS}, prefill_tokens=prefill, decode_seqs=decode, running=1)
    return rec


def model_ms(prefill=0, decode=0):
    return STEP["fixed_ms"] + STEP["prefill_token_ms"] * prefill + STEP["decode_seq_ms"] * decode


def test_a_steps_context_is_the_others_share_and_its_own_idle_time():
    a = [step("a", 0.000, 10, decode=1), step("a", 0.0105, 10, decode=1), step("a", 0.100, 10, decode=1)]
    b = [step("b", 0.005, 10, prefill=8)]  # covers half of a's first step and half of its second
    c = context(a + b)
    assert c[0].others_busy == pytest.approx(0.5) and c[0].idle_ms is None and c[0].cold  # a worker's first step
    assert c[1].others_busy == pytest.approx(0.45) and c[1].idle_ms == pytest.approx(0.5) and not c[1].cold
    assert c[2].others_busy == 0 and c[2].idle_ms == pytest.approx(79.5) and c[2].cold  # >= COLD_AFTER_MS
    assert c[3].others_busy == pytest.approx(0.95)  # all of b's step but the 0.5 ms between a's two
    other_rate = dict(b[0], rate=2.0)  # another rate is another run: never beside a's steps
    assert context(a + [other_rate])[0].others_busy == 0


def synthetic(prefill_x, decode_x, cold_ms):
    """Worker d decodes back to back throughout; worker p prefills now and then (cold: it idled before), beside
    d, whose steps during p's take decode_x; first a stretch of d alone, warm."""
    steps, t = [], 1.0
    for i in range(40):  # d alone and warm (after its first, cold step)
        ms = model_ms(decode=2) + (cold_ms if i == 0 else 0)
        steps.append(step("d", t, ms, decode=2))
        t += ms / 1e3 + 0.0002
    for j in range(12):  # p's cold prefill with d stepping beside it all along
        ms = model_ms(prefill=64) * prefill_x + cold_ms
        p0 = t + 0.0001
        steps.append(step("p", p0, ms, prefill=64))
        end = p0 + ms / 1e3
        while t < end + 0.002:
            d_ms = model_ms(decode=2) * decode_x
            steps.append(step("d", t, d_ms, decode=2))
            t += d_ms / 1e3
        t += 0.05  # d idles (its next step is cold) and p too
        steps.append(step("d", t, model_ms(decode=2) + cold_ms, decode=2))
        t += (model_ms(decode=2) + cold_ms) / 1e3
    for j in range(8):  # cold prefills alone, d idle
        t += 0.05
        steps.append(step("p", t, model_ms(prefill=32) + cold_ms, prefill=32))
        t += (model_ms(prefill=32) + cold_ms) / 1e3
    return steps


def test_the_estimate_reads_back_what_the_steps_took():
    est = estimate(StepTiming(**STEP).to_raw(), synthetic(1.3, 1.1, 4.0))
    assert est["cold_ms"] == pytest.approx(4.0, abs=0.05)
    assert est["prefill_x"] == pytest.approx(1.3, rel=0.05)  # the cold cost taken off first
    assert est["decode_x"] == pytest.approx(1.1, rel=0.05)
    assert contention_raw(est) == {k: round(est[k], 4) for k in ("prefill_x", "decode_x", "cold_ms")}
    quiet = estimate(StepTiming(**STEP).to_raw(), synthetic(1.0, 1.0, 0.0))
    assert quiet["prefill_x"] == pytest.approx(1.0, abs=0.02) and quiet["decode_x"] == pytest.approx(1.0, abs=0.02)
    assert quiet["cold_ms"] == pytest.approx(0.0, abs=0.05)


def test_a_slower_box_is_not_counted_as_cold_time():
    """Every step 1.5x longer, cold cost included: the cold cost reads 1.5 x 4 ms, the factors as they were."""
    slow = [dict(s, end=s["start"] + (s["end"] - s["start"]) * 1.5) for s in synthetic(1.3, 1.1, 4.0)]
    est = estimate(StepTiming(**STEP).to_raw(), slow)
    assert est["cold_ms"] == pytest.approx(6.0, abs=0.1)
    assert est["decode_x"] == pytest.approx(1.1, rel=0.05)
    assert est["prefill_x"] == pytest.approx(1.3, rel=0.05)  # no warm prefill alone: against the warm decodes


def test_too_few_steps_leave_a_figure_out():
    few = [step("a", 0.0, 5, decode=1), step("a", 1.0, 5, decode=1)]
    est = estimate(StepTiming(**STEP).to_raw(), few)
    assert est["prefill_x"] is None and est["decode_x"] is None and est["cold_ms"] is None
    assert contention_raw(est) == {} and describe({}) == "none"
    assert describe({"prefill_x": 1.09, "cold_ms": 2.1}) == "prefill x1.09 beside stepping workers; a cold step +2.1 ms"


def test_the_profile_section_scales_and_refuses_what_is_not_a_figure():
    c = ContentionTiming(prefill_x=1.5, decode_x=1.2, cold_ms=3.0)
    assert c.step_s(0.010, True, 1.0, False) == pytest.approx(0.015)
    assert c.step_s(0.010, True, 0.5, True) == pytest.approx(0.0125 + 0.003)  # linear in the share stepping
    assert c.step_s(0.010, False, 1.0, False) == pytest.approx(0.012)
    t = parse_timing({"step": STEP, "contention": {"prefill_x": 1.5, "cold_ms": 3}}, "model.timing")
    assert t.contention == ContentionTiming(prefill_x=1.5, cold_ms=3.0)
    assert t.scaled(2.0).contention.cold_ms == 6.0 and t.scaled(2.0).contention.prefill_x == 1.5
    with pytest.raises(RecipeError, match="model.timing.contention.prefill_x"):
        parse_timing({"step": STEP, "contention": {"prefill_x": 0}}, "model.timing")
    with pytest.raises(RecipeError, match="model.timing.contention"):
        parse_timing({"step": STEP, "contention": {"prefil_x": 1.2}}, "model.timing")


def variant(contention, deployment):
    raw = {"model": {"preset": "tiny-llama", "timing": {"step": STEP, "contention": contention,
                                                        "transfer": {"shm": {"gbps": 1.0}}}},
           "engine": {"block_size": 8, "kv_blocks": 256, "max_running": 16}, "rates": [40],
           "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "workload": {"requests": 60, "input_len": {"kind": "uniform", "min": 20, "max": 80},
                        "output_len": {"kind": "fixed", "value": 48}},
           "deployment": deployment}
    r = parse_recipe(raw)
    return r.resolved("default"), r.slo


UNIFIED2 = {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}
PULL = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm", "mode": "pull"}


@pytest.mark.parametrize("dep", [UNIFIED2, PULL], ids=["unified", "pull"])
def test_the_simulator_steps_by_contention_and_the_replay_explains_it(dep):
    con = {"prefill_x": 1.4, "decode_x": 1.15, "cold_ms": 3.0}
    v, slo = variant(con, dep)
    reqs = build_requests(v.workload, 40.0, seed=1, vocab_size=256)
    recs, steps, _ = Simulator(v, slo).run(reqs, 40.0)
    (bare_recs, bare_steps, _) = Simulator(*variant({}, dep)).run(reqs, 40.0)
    tokens = lambda rs: {r["id"]: r["output_ids"] for r in rs}  # noqa: E731
    assert tokens(recs) == tokens(bare_recs)  # time moves, tokens do not
    # every step lasts its model, up to x prefill_x / decode_x beside the other worker (all of it where one step
    # of the other spans it), cold_ms more after idling
    by_worker: dict = {}
    for s in steps:
        by_worker.setdefault(s["worker"], []).append(s)
    together = 0
    for w, mine in by_worker.items():
        others = [s for s in steps if s["worker"] != w]
        prev = None
        for s in sorted(mine, key=lambda s: s["start"]):
            cold = prev is None or s["start"] - prev >= 0.020
            base = model_ms(s["prefill_tokens"], s["decode_seqs"]) / 1e3
            x = con["prefill_x"] if s["prefill_tokens"] else con["decode_x"]
            alone, beside = base + (0.003 if cold else 0.0), base * x + (0.003 if cold else 0.0)
            took = s["end"] - s["start"]
            assert alone - 1e-9 <= took <= beside + 1e-9, (w, s)
            if any(o["start"] <= s["start"] and o["end"] >= s["end"] for o in others):  # the other's step spans it
                assert took == pytest.approx(beside)
                together += 1
            prev = s["end"]
    assert together > 10  # the workers did step together
    assert sum(r["token_times"][-1] for r in recs) > sum(r["token_times"][-1] for r in bare_recs)
    # replayed against the same profile, the contention is the profile's, not the workers' pace
    # replayed against the same profile, the contention is the profile's, not the workers' pace: each worker's
    # pace is near 1 (the simulator reads the others' share at a step's start, the replay over the step: within
    # 5%), and nearer than against the profile without its contention
    paces = worker_paces(v.model.timing, steps)
    blind = worker_paces(v.model.timing.replace(contention=ContentionTiming()), steps)
    assert set(paces) == set(by_worker)
    for w, p in paces.items():
        assert p.factor == pytest.approx(1.0, abs=0.05) and abs(p.factor - 1) < abs(blind[w].factor - 1), w
    assert all(m is None or m > 0 for m in predicted_ms(v.model.timing, steps))
