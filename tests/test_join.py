"""The join step (pdlab.timing.join): a decode worker's first step after it admitted hand-overs takes join_ktok_ms
more per 1000 prompt tokens admitted; read from a run's steps and requests as a slope over the worker's plain
steps, simulated on the step after an admit, and read back from the simulation's own records."""

import pytest

from pdlab.recipe import StepTiming
from pdlab.timing.contention import context, contention_raw, describe, estimate, predicted_ms
from pdlab.timing.join import MIN_SAMPLES, join_fit, join_rows, joins
from pdlab.timing.replay import worker_paces

from test_sim_pace import QUICK_PREFILL as TIMING, handed_over, handed_over_variant  # one simulated 1P1D run


def test_the_fit_is_the_slope_over_tokens_not_its_foot():
    rows = [(x / 10, 0.3 + 0.6 * x / 10) for x in range(2, 20)] + [(1.0, 9.0), (1.5, -5.0)]  # two the OS stretched
    ms, n = join_fit(rows)
    assert ms == pytest.approx(0.6, rel=0.02) and n == len(rows)
    alike = [(1.0, 0.8), (1.0, 0.7), (1.1, 0.99), (1.0, 0.6), (1.0, 0.75)]  # no line: the median per 1000 tokens
    assert join_fit(alike)[0] == pytest.approx(0.75)
    assert join_fit([(x / 10, 2.0 - x / 10) for x in range(2, 20)])[0] == 0.0  # never below 0
    assert join_fit([(1.0, 1.0)] * (MIN_SAMPLES - 1)) == (None, MIN_SAMPLES - 1)


def test_a_join_step_is_the_first_after_an_admit_and_the_one_after_it_is_marked():
    steps = [{"variant": "v", "rate": 1.0, "repeat": 0, "worker": "d", "role": "decode", "start": t, "end": t + 0.01}
             for t in (0.0, 0.02, 0.04, 0.06)]
    reqs = [{"variant": "v", "rate": 1.0, "repeat": 0, "prefill_worker": "p", "decode_worker": "d",
             "prompt_len": 1200, "cached_tokens": 200, "phases": {"admitted": 0.015}},
            {"variant": "v", "rate": 1.0, "repeat": 0, "prefill_worker": "d", "decode_worker": "d",
             "prompt_len": 500, "phases": {"admitted": 0.035}}]  # prefilled where it decodes: no hand-over
    ktok, after = joins(steps, reqs)
    assert ktok == {1: pytest.approx(1.0)} and after == {2}  # the uncached tokens only


def run(mode: str, join_ktok_ms: float):
    return handed_over(mode, {"gap_ms": 0.2}, {"join_ktok_ms": join_ktok_ms})


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_simulated_decode_worker_pays_the_join_on_its_next_step_and_its_records_read_it_back(mode):
    recs, steps = run(mode, 4.0)
    coef = StepTiming(**TIMING).to_raw()
    est = estimate(coef, steps, requests=recs)
    assert est["join_ktok_ms"] == pytest.approx(4.0, rel=0.02) and est["samples"]["join"] >= MIN_SAMPLES
    assert "after it admits +4 ms per 1000 tokens" in describe(contention_raw(est))
    dec = sorted((s for s in steps if s["worker"] == "decode0"), key=lambda s: s["start"])
    for r in recs:  # the first step after each admission: its model and the KV of what it admitted
        t = r["phases"]["admitted"]
        nxt = next(s for s in dec if s["start"] >= t)
        model_ms = TIMING["fixed_ms"] + TIMING["decode_seq_ms"] * nxt["decode_seqs"]
        assert (nxt["end"] - nxt["start"]) * 1e3 >= model_ms + 4.0 * r["prompt_len"] / 1000 - 1e-6
    recs0, steps0 = run(mode, 0.0)
    assert estimate(coef, steps0, requests=recs0)["join_ktok_ms"] == pytest.approx(0.0, abs=1e-6)
    assert "join_ktok_ms" not in estimate(coef, steps0)  # without the requests: not read
    assert {r["id"]: r["output_ids"] for r in recs} == {r["id"]: r["output_ids"] for r in recs0}  # the same tokens


def test_the_decode_spreads_leave_the_join_steps_out_once_the_requests_say_which():
    """A decode worker whose steps run at their model but its joins: without the requests the joins are its
    spread's tail, with them the spread is flat (the join is join_ktok_ms's, counted once)."""
    recs, steps = run("push", 4.0)
    coef = StepTiming(**TIMING).to_raw()
    blind, told = estimate(coef, steps), estimate(coef, steps, requests=recs)
    tail = [k for k in ("decode_spread", "decode_spread_beside") if blind.get(k)]
    assert tail and all(blind[k][-1] > 1.05 for k in tail)
    assert all(told[k] is None or told[k][-1] == pytest.approx(1.0, abs=1e-6) for k in tail)


def test_a_pace_read_with_the_requests_counts_the_join_once():
    """predicted_ms and worker_paces (the replay's and the drift's pace) given the run's requests predict a join
    step with its join cost, as the simulator stepped it: the simulated decode worker then reads at its own pace,
    1; without them its joins read as a slower worker."""
    recs, steps = run("push", 4.0)
    profile = handed_over_variant("push", {"gap_ms": 0.2}, {"join_ktok_ms": 4.0}).model.timing
    ktok = joins(steps, recs)[0]
    told, blind = predicted_ms(profile, steps, recs), predicted_ms(profile, steps)
    assert len(ktok) >= MIN_SAMPLES
    for i, (a, b) in enumerate(zip(told, blind)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a == pytest.approx(b + 4.0 * ktok.get(i, 0.0))
            if steps[i]["worker"] == "decode0":
                assert (steps[i]["end"] - steps[i]["start"]) * 1e3 == pytest.approx(a, rel=1e-6)
    assert worker_paces(profile, steps, requests=recs)["decode0"].factor == pytest.approx(1.0, abs=1e-6)
    assert worker_paces(profile, steps)["decode0"].factor > 1.01


def test_a_join_after_its_worker_idled_is_the_cold_steps_not_the_joins():
    """A decode worker that idled COLD_AFTER_MS or more before a join step pays the cold step there
    (contention.cold_ms): that join is left out of the fit, and so is each worker's first step."""
    def step(t: float, ms: float) -> dict:
        return {"variant": "v", "rate": 1.0, "repeat": 0, "worker": "d", "role": "decode", "start": t,
                "end": t + ms / 1e3, "decode_seqs": 1}

    steps = [step(0.01 * i, 5.0) for i in range(30)]  # plain, back to back at 5 ms a step
    steps += [step(0.3, 6.0), step(0.31, 5.0), step(0.5, 9.0)]  # a warm join, the step after it, a join after idling
    reqs = [{"variant": "v", "rate": 1.0, "repeat": 0, "prefill_worker": "p", "decode_worker": "d",
             "prompt_len": 1000, "phases": {"admitted": t}} for t in (0.2995, 0.45)]
    ktok, after = joins(steps, reqs)
    assert set(ktok) == {30, 32}  # both are joins ...
    cold = {i for i, c in enumerate(context(steps)) if c.cold}
    rows = join_rows(steps, [((s["end"] - s["start"]) * 1e3, 5.0) for s in steps], ktok, after, cold)
    assert rows == [(pytest.approx(1.0), pytest.approx(1.0))]  # ... but only the warm one is the join's
