"""Contention (pdlab.timing.contention): a step's context in a run, the figures read back from steps, the
profile's section, and the simulator stepping by it so that what it simulates is what the estimate reads."""

import numpy as np
import pytest

from pdlab.constants import SPREAD_LEVELS
from pdlab.recipe import parse_recipe
from pdlab.recipe.timing import ContentionTiming, StepTiming, parse_timing
from pdlab.fields import RecipeError
from pdlab.sim.simulator import Simulator
from pdlab.timing.build import kept_contention, worker_step_warnings
from pdlab.timing.contention import (AFTER_STEPS, after_prefill_fit, context, contention_raw, describe, estimate,
                                     main_step, predicted_ms)
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
    raw = contention_raw(est)
    assert {k: raw[k] for k in ("prefill_x", "decode_x", "cold_ms")} == \
        {k: round(est[k], 4) for k in ("prefill_x", "decode_x", "cold_ms")}
    assert len(raw["decode_spread"]) == len(SPREAD_LEVELS)  # 40 warm decode steps alone: a spread
    quiet = estimate(StepTiming(**STEP).to_raw(), synthetic(1.0, 1.0, 0.0))
    assert quiet["prefill_x"] == pytest.approx(1.0, abs=0.02) and quiet["decode_x"] == pytest.approx(1.0, abs=0.02)
    assert quiet["cold_ms"] == pytest.approx(0.0, abs=0.05)


def test_a_slower_box_is_not_counted_as_cold_time():
    """Everything 1.5x longer, cold cost and idle time included: the cold cost reads 1.5 x 4 ms, the factors as
    they were. (It is read from the decode worker's cold steps: the cold prefills have no warm prefill alone to
    give their kind's pace, and are left out.)"""
    slow = [dict(s, start=s["start"] * 1.5, end=s["end"] * 1.5) for s in synthetic(1.3, 1.1, 4.0)]
    est = estimate(StepTiming(**STEP).to_raw(), slow)
    # the warm steps alone say how far the box (or a worker's code path) is off the model; cold ones do not count
    assert est["alone"]["decode"] == pytest.approx(1.5, rel=1e-6) and est["alone"]["prefill"] is None
    assert estimate(StepTiming(**STEP).to_raw(), synthetic(1.3, 1.1, 4.0))["alone"]["decode"] == pytest.approx(1.0)
    assert est["cold_ms"] == pytest.approx(6.0, abs=0.1)
    assert est["decode_x"] == pytest.approx(1.1, rel=0.05)
    assert est["prefill_x"] == pytest.approx(1.3, rel=0.05)  # no warm prefill alone: against the warm decodes


def test_a_cold_step_is_read_at_the_pace_of_its_own_kind():
    """A unified worker whose decode steps run x0.8 the model and its prefills x1.1, with no cold cost at all:
    each request comes to it idle, so every cold step is a 400-token prefill. At the decode steps' pace those
    would read +60 ms "cold" (the 2026-12-07 unified runs: +14-46 ms); with no warm prefill alone to give their
    own pace they are left out, and with some they read 0."""
    def worker(warm_prefills):
        steps, t = [], 1.0
        for _ in range(8):
            for k in range(1 + warm_prefills):  # the first after idling is cold; the next ones, back to back, warm
                ms = model_ms(prefill=400) * 1.1
                steps.append(step("u", t, ms, prefill=400))
                t += ms / 1e3 + 0.0002
            for _ in range(20):
                ms = model_ms(decode=2) * 0.8
                steps.append(step("u", t, ms, decode=2))
                t += ms / 1e3 + 0.0002
            t += 0.1  # idle: the next step is cold
        return steps

    coef = StepTiming(**STEP).to_raw()
    assert estimate(coef, worker(0))["cold_ms"] is None  # only cold prefills, and no prefill pace to read them at
    est = estimate(coef, worker(1))
    assert est["cold_ms"] == pytest.approx(0.0, abs=0.01) and est["samples"]["cold"] == 8
    assert est["alone"]["prefill"] == pytest.approx(1.1) and est["alone"]["decode"] == pytest.approx(0.8)


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
    # replayed against the same profile, the contention is the profile's, not the workers' pace: each worker's
    # pace is near 1 (the simulator reads the others' share at a step's start, the replay over the step: within
    # 5%), and nearer than against the profile without its contention
    paces = worker_paces(v.model.timing, steps)
    blind = worker_paces(v.model.timing.replace(contention=ContentionTiming()), steps)
    assert set(paces) == set(by_worker)
    for w, p in paces.items():
        assert p.factor == pytest.approx(1.0, abs=0.05) and abs(p.factor - 1) < abs(blind[w].factor - 1), w
    assert all(m is None or m > 0 for m in predicted_ms(v.model.timing, steps))


ALONE_RATIOS = (0.95, 1.0, 1.0, 1.02, 1.05, 1.1, 1.3)  # a decode step's time over its model, cycled
BESIDE_RATIOS = (1.0, 1.05, 1.1, 1.2, 1.6, 2.0)


def spread_steps():
    """Worker d decodes alone for a while, its steps at ALONE_RATIOS of the model in turn, then beside p's long
    prefill steps at BESIDE_RATIOS."""
    steps, t = [], 1.0
    for i in range(70):
        ms = model_ms(decode=2) * ALONE_RATIOS[i % len(ALONE_RATIOS)]
        steps.append(step("d", t, ms, decode=2))
        t += ms / 1e3 + 0.0002
    p0 = t
    steps.append(step("p", p0, 2000.0, prefill=4000))  # p steps throughout what follows
    t += 0.0001
    for i in range(60):
        ms = model_ms(decode=2) * BESIDE_RATIOS[i % len(BESIDE_RATIOS)]
        steps.append(step("d", t, ms, decode=2))
        t += ms / 1e3 + 0.0002
    return steps


def test_the_spread_of_decode_steps_is_read_by_context_over_its_median():
    est = estimate(StepTiming(**STEP).to_raw(), spread_steps())
    for key, ratios in (("decode_spread", ALONE_RATIOS), ("decode_spread_beside", BESIDE_RATIOS)):
        cycled = np.array(ratios * 12)
        want = np.quantile(cycled / np.median(cycled), SPREAD_LEVELS)
        assert est[key] == pytest.approx(tuple(want), abs=0.03), key
        assert est[key][SPREAD_LEVELS.index(0.5)] == pytest.approx(1.0)
    few = estimate(StepTiming(**STEP).to_raw(), spread_steps()[:10])
    assert few["decode_spread"] is None and few["decode_spread_beside"] is None  # below MIN_SPREAD
    raw = contention_raw(est)
    assert "decode steps spread p90 x" in describe(raw) and " beside" in describe(raw)
    # the step model off by batch size (x1.0 for 2 sequences, x1.3 for 6), every step of a size alike: no spread
    shaped, t = [], 1.0
    for i in range(40):
        n = 2 if i % 2 else 6
        ms = model_ms(decode=n) * (1.0 if n == 2 else 1.3)
        shaped.append(step("d", t, ms, decode=n))
        t += ms / 1e3 + 0.0002
    assert estimate(StepTiming(**STEP).to_raw(), shaped)["decode_spread"] == pytest.approx((1.0,) * len(SPREAD_LEVELS))


def test_the_section_draws_a_decode_step_from_its_spread():
    qs = tuple(np.linspace(0.9, 1.5, len(SPREAD_LEVELS)))
    beside = tuple(np.linspace(1.0, 2.5, len(SPREAD_LEVELS)))
    c = ContentionTiming(decode_spread=qs, decode_spread_beside=beside)
    assert c.step_s(0.010, False, 0.0, False, u=SPREAD_LEVELS[-1]) == pytest.approx(0.015)  # alone, at p99
    assert c.step_s(0.010, False, 1.0, False, u=SPREAD_LEVELS[-1]) == pytest.approx(0.025)  # beside, at p99
    assert c.step_s(0.010, False, 0.5, False, u=1.0) == pytest.approx(0.020)  # past p99: p99, weighted
    assert c.step_s(0.010, True, 1.0, False, u=1.0) == pytest.approx(0.010)  # a prefill step: no spread
    assert c.step_s(0.010, False, 1.0, False) == pytest.approx(0.010)  # no draw: the median
    t = parse_timing({"step": STEP, "contention": {"decode_spread": list(qs)}}, "model.timing")
    assert t.contention.decode_spread == pytest.approx(qs) and t.contention.decode_spread_beside == ()
    assert "decode_spread_beside" not in t.contention.to_raw()
    for bad in ([1.0, 1.1], list(reversed(qs)), [0.0] * len(SPREAD_LEVELS), "wide"):
        with pytest.raises(RecipeError, match="model.timing.contention.decode_spread"):
            parse_timing({"step": STEP, "contention": {"decode_spread": bad}}, "model.timing")


def test_the_simulator_draws_decode_steps_from_the_spread_and_repeats_exactly():
    qs = tuple(float(x) for x in np.linspace(0.8, 1.6, len(SPREAD_LEVELS)))
    con = {"decode_spread": list(qs), "decode_spread_beside": list(qs)}
    v, slo = variant(con, PULL)
    reqs = build_requests(v.workload, 40.0, seed=1, vocab_size=256)
    recs, steps, _ = Simulator(v, slo).run(reqs, 40.0)
    again = Simulator(v, slo).run(reqs, 40.0)[1]
    other = Simulator(v, slo).run(reqs, 40.0, repeat=1)[1]
    bare_recs, bare_steps, _ = Simulator(*variant({}, PULL)).run(reqs, 40.0)
    assert {r["id"]: r["output_ids"] for r in recs} == {r["id"]: r["output_ids"] for r in bare_recs}
    span = lambda ss: [s["end"] - s["start"] for s in ss]  # noqa: E731
    assert span(steps) == span(again) and span(steps) != span(other)  # seeded per worker, rate and repeat
    ratios = [(s["end"] - s["start"]) * 1e3 / model_ms(0, s["decode_seqs"]) for s in steps
              if s["decode_seqs"] and not s["prefill_tokens"] and s["worker"] == "decode0"]
    assert qs[0] - 1e-6 <= min(ratios) and max(ratios) <= qs[-1] + 1e-6
    assert np.median(ratios) == pytest.approx(np.interp(0.5, SPREAD_LEVELS, qs), rel=0.05)
    prefill = [s for s in steps if s["prefill_tokens"] and not s["decode_seqs"]]
    assert all((s["end"] - s["start"]) * 1e3 == pytest.approx(model_ms(s["prefill_tokens"])) for s in prefill)
    # what it simulates, the estimate reads back: the spread of the simulated decode steps
    est = estimate(StepTiming(**STEP).to_raw(), steps)
    got = est["decode_spread_beside"] or est["decode_spread"]
    want = np.array(qs) / np.interp(0.5, SPREAD_LEVELS, qs)
    assert got[SPREAD_LEVELS.index(0.9)] == pytest.approx(want[SPREAD_LEVELS.index(0.9)], rel=0.08)


def test_the_after_prefill_fit_reads_a_geometric_fall_back():
    """Decode steps after a prefill at 1 + 0.5 x 0.6^k of settled ones read back x1.5, decay 0.6; with fewer
    than MIN_SAMPLES at any k, or nothing left after a prefill, no figure or x1 decay 0."""
    by_k = {k: [1.0 + 0.5 * 0.6 ** k] * 6 for k in range(AFTER_STEPS)}
    assert after_prefill_fit(by_k, [1.0] * 8) == pytest.approx((1.5, 0.6))
    assert after_prefill_fit({**by_k, 3: [1.0] * 2}, [1.0] * 8) is None
    assert after_prefill_fit({k: [1.0] * 6 for k in range(AFTER_STEPS)}, [1.0] * 8) == pytest.approx((1.0, 0.0))


def after_prefill_steps(x, decay, rounds=8):
    """Worker u decodes 2 sequences; every 20 steps it prefills 64 tokens; each decode step k steps after it
    takes 1 + (x - 1) decay^k its model."""
    steps, t = [], 1.0
    for _ in range(rounds):
        ms = model_ms(prefill=64, decode=2)
        steps.append(step("u", t, ms, prefill=64, decode=2))
        t += ms / 1e3 + 0.0002
        for k in range(20):
            ms = model_ms(decode=2) * (1 + (x - 1) * decay ** k)
            steps.append(step("u", t, ms, decode=2))
            t += ms / 1e3 + 0.0002
    return steps


def test_the_estimate_reads_what_a_prefill_leaves_to_the_decode_steps_after_it():
    est = estimate(StepTiming(**STEP).to_raw(), after_prefill_steps(1.4, 0.7))
    assert est["after_prefill_x"] == pytest.approx(1.4, rel=0.01)
    assert est["after_prefill_decay"] == pytest.approx(0.7, abs=0.02)
    assert "a decode step after a prefill x1.4" in describe(contention_raw(est))
    flat = estimate(StepTiming(**STEP).to_raw(), after_prefill_steps(1.0, 0.0))
    assert flat["after_prefill_x"] == pytest.approx(1.0) and flat["after_prefill_decay"] == pytest.approx(0.0)
    decode_only = [s for s in after_prefill_steps(1.4, 0.7) if not s["prefill_tokens"]]
    assert estimate(StepTiming(**STEP).to_raw(), decode_only)["after_prefill_x"] is None  # a decode worker's


def test_the_simulator_slows_the_decode_steps_after_a_prefill_and_the_estimate_reads_it_back():
    con = {"after_prefill_x": 1.5, "after_prefill_decay": 0.5}
    v, slo = variant(con, UNIFIED2)
    reqs = build_requests(v.workload, 40.0, seed=1, vocab_size=256)
    recs, steps, _ = Simulator(v, slo).run(reqs, 40.0)
    bare_recs = Simulator(*variant({}, UNIFIED2)).run(reqs, 40.0)[0]
    assert {r["id"]: r["output_ids"] for r in recs} == {r["id"]: r["output_ids"] for r in bare_recs}
    for w in ("unified0", "unified1"):
        since = None
        for s in sorted((s for s in steps if s["worker"] == w), key=lambda s: s["start"]):
            x = 1.0 if s["prefill_tokens"] or since is None else 1 + 0.5 * 0.5 ** since  # k decode steps after one
            took = (s["end"] - s["start"]) * 1e3
            assert took == pytest.approx(model_ms(s["prefill_tokens"], s["decode_seqs"]) * x), (w, s, since)
            since = 0 if s["prefill_tokens"] else None if since is None else since + 1
    est = estimate(StepTiming(**STEP).to_raw(), steps)
    assert est["after_prefill_x"] == pytest.approx(1.5, rel=0.02)
    assert est["after_prefill_decay"] == pytest.approx(0.5, abs=0.05)


def test_what_a_prefill_leaves_is_not_read_again_as_co_running_or_spread():
    """Simulated with decode_x 1.2 and after_prefill x1.5 (decay 0.5) and no spread, unified workers' steps read
    back each once: decode_x 1.2, and decode steps that do not spread (the slow ones after a prefill are that
    prefill's, not a tail of their own)."""
    con = {"decode_x": 1.2, "after_prefill_x": 1.5, "after_prefill_decay": 0.5}
    v, slo = variant(con, UNIFIED2)
    steps = Simulator(v, slo).run(build_requests(v.workload, 40.0, seed=1, vocab_size=256), 40.0)[1]
    est = estimate(StepTiming(**STEP).to_raw(), steps)
    assert est["after_prefill_x"] == pytest.approx(1.5, rel=0.05)
    assert est["decode_x"] == pytest.approx(1.2, rel=0.03)
    for key in ("decode_spread", "decode_spread_beside"):
        if est[key] is not None:
            assert est[key][-1] == pytest.approx(1.0, abs=0.05), key  # p99
    assert est["decode_spread"] is not None or est["decode_spread_beside"] is not None


def back_to_back(worker: str, n: int, ms: float, lost_ms: float, **tag) -> list[dict]:
    """`n` steps of `worker` back to back from t = 10 s, each `ms` long, of which `lost_ms` went to another
    process (cpu_s is the rest)."""
    return [dict(step(worker, 10 + i * ms / 1e3, ms, decode=4), cpu_s=(ms - lost_ms) / 1e3, **tag) for i in range(n)]


def test_the_main_process_time_per_step_is_read_from_what_the_steps_lost():
    """Two workers step back to back for a second, 400 steps between them: at 0.25 ms of the main process's
    time each, it takes a tenth of a core, all of it from one of them while both step (0.5 ms of each of its
    5 ms steps). One worker alone: it takes it from that one. Steps without cpu_s say nothing."""
    two = back_to_back("a", 200, 5.0, 0.5) + back_to_back("b", 200, 5.0, 0.0)
    ms, read = main_step(two, context(two))
    assert ms == pytest.approx(0.25, rel=0.01) and read == 400
    one = back_to_back("a", 200, 5.0, 0.25 * 200 / 1000 * 5.0)  # D = 0.25 ms x 200 steps/s: 5% of each step
    assert main_step(one, context(one))[0] == pytest.approx(0.25, rel=0.01)
    bare = [{k: v for k, v in s.items() if k != "cpu_s"} for s in two]
    assert main_step(bare, context(bare)) == (None, 0)
    assert estimate(StepTiming(**STEP).to_raw(), two)["main_step_ms"] == pytest.approx(0.25, rel=0.01)


def test_a_probe_whose_workers_step_far_off_the_profile_warns_by_kind():
    assert worker_step_warnings({"decode": 1.06, "prefill": 0.9}) == []  # within PROFILE_CHECK_MAPE_PCT
    (w,) = worker_step_warnings({"decode": 1.32, "prefill": 1.0})
    assert "ran their decode steps at x1.32 the step model" in w and "kernels" in w
    assert len(worker_step_warnings({"decode": 0.5, "prefill": 3.0})) == 2
    # the box sped up x0.74 under the profile's steps (2026-12-07): the warning names the box, not the kernels
    (box,) = worker_step_warnings({"decode": 0.75, "prefill": 0.95}, moved=0.74)
    assert "decode steps at x0.75" in box and "pace moved x0.74" in box and "kernels" not in box
    (path,) = worker_step_warnings({"decode": 0.75, "prefill": 0.95}, moved=1.05)  # a steady box: the path
    assert "kernels" in path and "pace moved" not in path
    # the whole steady, its memory half moved x1.3: the box again
    (memory,) = worker_step_warnings({"decode": 1.25, "prefill": 1.0}, moved=1.05, memory_moved=1.3)
    assert "memory half of the box's pace moved x1.30" in memory and "kernels" not in memory


def test_a_fresh_profile_keeps_its_probes_contention_with_no_factor_below_1():
    """The probe's factors beside stepping workers, cold step and decode spreads go into the profile; a factor
    below 1 (the box's pace moving between the probe's steps alone and together) is kept as 1; what the probe
    read for after_prefill and the main process is not kept (a run's steps give those)."""
    spread = [1.0, 1.1, 1.2, 1.3, 1.4]
    probed = {"prefill_x": 1.16, "decode_x": 0.967, "cold_ms": 0.4, "after_prefill_x": 1.3, "main_step_ms": 0.7,
              "decode_spread": spread}
    assert kept_contention(probed) == {"prefill_x": 1.16, "decode_x": 1.0, "cold_ms": 0.4, "decode_spread": spread}
    assert kept_contention({"prefill_x": 0.5}) == {"prefill_x": 1.0}
    assert kept_contention({"main_step_ms": 0.7}) is None and kept_contention({}) is None
    ContentionTiming(**kept_contention(probed))  # a profile's contention block as it loads
