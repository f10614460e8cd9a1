"""pdlab diagnose's analysis as a specification, on streams from a simulated engine whose truth is known: which
gaps are stalls, what a stall costs per prompt token, where chunking caps it, and what the verdict says."""

import json
import os
import random

import pytest

from pdlab.diagnose.agreement import ClockError
from pdlab.diagnose.analysis import analyse, with_agreement
from pdlab.diagnose.fit import Point, fit_stalls
from pdlab.diagnose.misses import miss_shares
from pdlab.diagnose.streams import Stream, from_record, group_records
from pdlab.diagnose.tagging import FLOOR, MIN_STEADY_GAPS, Gap, tag, threshold_of

T0 = 1000.0


def simulate(unified=True, ms_per_1k=60.0, step_ms=5.0, lengths=(500, 1000, 2000), repeats=3, chunk=0, seed=0,
             noise_ms=0.2, streams=4, hiccups=0):
    """A one-worker engine: every step gives each background stream a token; a probe's prompt is prefilled in
    the step after it arrives (whole, or `chunk` tokens a step), which then lasts that much longer (unified).
    Disaggregated, prefill runs elsewhere and the probe's first token comes after its prefill time alone.
    `hiccups`: steps that take 40 ms for no prefill's sake. Returns (streams, steps, probe phase)."""
    rng = random.Random(seed)
    probes, t = [], T0 + 6.0
    for i, n in enumerate(n for n in lengths for _ in range(repeats)):
        probes.append([f"probe-{i}", t, n, n])  # id, send, prompt, left to prefill
        t += 1.5
    end, now = t + 1.0, T0
    times = {k: [T0] for k in range(streams)}
    firsts, steps, queue = {}, [], []
    slow = set(rng.sample(range(2000, 5000), hiccups)) if hiccups else set()
    i = 0
    while now < end:
        while probes and probes[0][1] <= now:
            queue.append(probes.pop(0))
        pre, head = 0, None
        if unified and queue:
            head = queue[0]
            pre = min(head[3], chunk) if chunk else head[3]
        dur = step_ms + rng.gauss(0, noise_ms) + ms_per_1k * pre / 1000.0 + (40.0 if i in slow else 0.0)
        steps.append({"worker": "w0", "start": now, "end": now + dur / 1000.0, "prefill_tokens": pre})
        now += dur / 1000.0
        i += 1
        for k in times:
            times[k].append(now)
        if head is not None:
            head[3] -= pre
            if head[3] <= 0:
                firsts[head[0]] = (head[1], now, head[2])
                queue.pop(0)
        elif not unified:
            for q in queue:
                firsts[q[0]] = (q[1], q[1] + ms_per_1k * q[2] / 1e6 + 0.002, q[2])
            queue.clear()
    out = [Stream(f"bg-{k}", "background", T0 - 0.01, tuple(v), 64, "w0") for k, v in times.items()]
    out += [Stream(pid, "probe", send, (first,), n) for pid, (send, first, n) in firsts.items()]
    return out, steps, (T0 + 6.0, end)


def test_a_gap_is_a_stall_only_in_another_requests_window_and_above_the_threshold():
    streams, _, phase = simulate()
    a = analyse("x", streams, 50.0, probes_phase=phase)
    th = a.tagging.threshold.value_ms
    windows = [w for w in a.tagging.windows if w.phase == "probe"]
    for g in a.tagging.gaps:
        inside = any(w.start < g.end and w.end > g.start for w in windows)
        assert (g.tag == "stall") == (inside and g.ms > th)
    # every probe stalled the 4 streams once, in the step that carried its prefill
    assert len(a.tagging.of("stall")) == 4 * 9


def test_the_threshold_is_the_steady_median_plus_six_robust_sigmas_or_its_p99_9_or_1_5x_median():
    base = [10.0] * 900 + [11.0] * 100
    th = threshold_of(base)
    assert th.p50_ms == 10.0 and th.mad_ms == 0.0
    assert th.value_ms == pytest.approx(FLOOR * 10.0)  # MAD 0 and p99.9 11: the floor decides
    spread = [10.0 + (i % 7) for i in range(1000)]  # 10..16, MAD 2
    th = threshold_of(spread)
    assert th.value_ms == pytest.approx(max(13.0 + 6 * 1.4826 * 2.0, th.quantile_ms))
    hiccups = [10.0] * 990 + [80.0] * 10  # 1% of steady gaps are 80 ms: a 60 ms gap does not stand out
    assert threshold_of(hiccups).value_ms == pytest.approx(80.0)
    assert threshold_of([10.0] * (MIN_STEADY_GAPS - 1)) is None


def test_too_few_steady_gaps_is_inconclusive_and_nothing_is_called_a_stall():
    streams, _, phase = simulate()
    short = [Stream(s.id, s.phase, s.send, s.times[:12], s.prompt_tokens) if s.background else s for s in streams]
    a = analyse("x", short, 50.0, probes_phase=phase)
    assert a.tagging.threshold is None and not a.tagging.of("stall")
    assert a.verdict.kind == "inconclusive"


def test_unified_the_fit_recovers_the_prefill_cost_and_the_verdict_names_prefill_interference():
    streams, steps, phase = simulate(ms_per_1k=60.0, step_ms=5.0)
    a = analyse("x", streams, 50.0, probes_phase=phase)
    line = a.fit.line
    assert line.per_1k_ms == pytest.approx(60.0, rel=0.03) and line.r2 > 0.99
    assert line.intercept_ms == pytest.approx(5.0, abs=1.0)
    assert a.verdict.kind == "prefill_interference"
    # stall 5 + 0.06 n > 50 ms from n = 750; the budget: the largest power of two whose stall stays within
    assert a.verdict.stall_beyond_tokens == pytest.approx(750, abs=25)
    assert a.verdict.budget == 512 and a.verdict.budget_stall_ms <= 50.0 and line.at(1024) > 50.0
    assert "Prefill interference explains 100% of ITL misses" in a.verdict.text
    assert "chunked-prefill token budget of 512" in a.verdict.text and "Disaggregation" in a.verdict.text


def test_disaggregated_the_verdict_is_not_prefill_stalls_and_nothing_stalls():
    streams, steps, phase = simulate(unified=False, hiccups=15)
    a = analyse("x", streams, 30.0, probes_phase=phase)
    assert a.verdict.kind == "not_prefill_stalls"
    assert a.misses["misses"] >= 15  # the hiccups miss the target, outside and inside windows alike
    assert a.misses["explained_share"] < 0.5
    assert "not prefill stalls" in a.verdict.text
    assert a.fit.line is None or abs(a.fit.line.per_1k_ms) < 2.0


def test_chunked_prefill_levels_the_stalls_off_at_about_one_chunk():
    streams, _, phase = simulate(ms_per_1k=60.0, lengths=(250, 500, 1000, 2000), chunk=600)
    a = analyse("x", streams, 30.0, probes_phase=phase)
    assert a.fit.levels_off_from == 1000
    assert a.fit.plateau_ms == pytest.approx(5.0 + 0.06 * 600, rel=0.1)
    assert all(p.levelled == (p.prompt_tokens >= 1000) for p in a.fit.points)
    assert a.fit.line.per_1k_ms == pytest.approx(60.0, rel=0.05)  # fitted below the chunk only
    small = analyse("x", simulate(lengths=(250, 500, 1000, 2000), chunk=128)[0], 10.0, probes_phase=phase)
    assert small.fit.flat and small.fit.plateau_ms == pytest.approx(5.0 + 0.06 * 128, rel=0.15)
    assert "Stalls do not grow with prompt length" in small.verdict.text and small.verdict.budget is None


def test_fit_stalls_needs_two_lengths_and_three_points():
    pts = [Point("a", 500, 40.0, True, 50.0), Point("b", 500, 42.0, True, 50.0)]
    assert fit_stalls(pts).line is None
    assert fit_stalls(pts + [Point("c", 500, 41.0, True, 50.0)]).line is None
    assert fit_stalls(pts + [Point("c", 1000, 70.0, True, 80.0)]).line is not None


def test_misses_in_windows_by_chance_explain_nothing():
    def gap(i, inside, ms):
        return Gap("s", i, 0.0, ms / 1000.0, ("w",) if inside else (), "steady", False)
    # 10% of gaps miss wherever they are (one in each run of 10), a quarter of the runs are in windows
    gaps = [gap(i, (i // 10) % 4 == 0, 60.0 if i % 10 == 0 else 5.0) for i in range(1000)]
    m = miss_shares(gaps, 50.0)
    assert m["misses"] == 100 and m["in_windows"] == 25 and m["explained_share"] == pytest.approx(0.0, abs=1e-9)
    only_inside = [gap(i, (i // 10) % 4 == 0, 60.0 if (i // 10) % 4 == 0 and i % 10 == 0 else 5.0)
                   for i in range(1000)]
    assert miss_shares(only_inside, 50.0)["explained_share"] == 1.0


def test_agreement_holds_the_tags_against_the_engines_own_steps():
    streams, steps, phase = simulate(ms_per_1k=60.0)
    a = with_agreement(analyse("x", streams, 50.0, probes_phase=phase), steps)
    ag = a.agreement
    assert ag["precision"] == 1.0 and ag["recall"] == 1.0 and ag["stall_gaps"] == 36
    assert ag["server_prefill"]["prefill_ms_per_1k_tokens"] == pytest.approx(60.0, rel=0.02)
    assert ag["stall_over_prefill_per_1k"] == pytest.approx(1.0, abs=0.05)
    moved = [{**s, "start": s["start"] + 1e5, "end": s["end"] + 1e5} for s in steps]
    with pytest.raises(ClockError):
        with_agreement(a, moved)


def test_agreement_matches_streams_to_the_servers_records_by_response_id():
    streams, steps, phase = simulate()
    anon = [Stream(s.id, s.phase, s.send, s.times, s.prompt_tokens, None, f"cmpl-{s.id}") for s in streams]
    server = [{"id": f"cmpl-{s.id}-0", "decode_worker": "w0"} for s in streams]
    a = analyse("x", anon, 50.0, probes_phase=phase)
    ag = with_agreement(a, steps, server).agreement
    assert ag["streams_matched"] == 4 and ag["precision"] == 1.0 and ag["recall"] == 1.0


def test_streams_from_records_use_chunk_times_and_the_servers_prompt_count():
    rec = {"id": "r", "phase": "background", "arrival": 1.0, "token_times": [1.1, 1.1, 1.2, 1.3, 1.3],
           "chunks": [2, 1, 2], "prompt_len": 10, "usage": {"prompt_tokens": 12}}
    s = from_record(rec)
    assert s.times == (1.1, 1.2, 1.3) and s.prompt_tokens == 12 and s.background
    plain = {k: v for k, v in rec.items() if k != "phase"}  # another run's record: no phase
    run = [{**plain, "variant": "a"}, {**plain, "variant": "b", "id": "q"}, {"variant": "b", "arrival": 1.0,
                                                                            "token_times": []}]
    groups = group_records(run)
    assert sorted(groups) == ["a", "b"] and len(groups["b"]) == 1 and groups["b"][0].phase == "request"


def test_offline_a_runs_variants_are_diagnosed_apart_and_held_against_their_own_steps(tmp_path, capsys):
    from pdlab.commands.diagnose import main
    from pdlab.measure.records import RunDir

    rd = RunDir(str(tmp_path / "run"))
    for variant, unified in (("unified", True), ("disagg", False)):
        streams, steps, _ = simulate(unified=unified)
        rd.append("requests", [{"variant": variant, "id": s.id, "arrival": s.send, "token_times": list(s.times),
                                "prompt_len": s.prompt_tokens, "decode_worker": "w0"} for s in streams])
        rd.append("steps", [{"variant": variant, **s} for s in steps])
    rd.close()
    page = tmp_path / "page.html"
    code = main(str(tmp_path / "run"), itl_ms=None, out=None, html=str(page), json_=True, steps_from=None)
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    by = {a["label"]: a for a in summary["analyses"]}
    assert by["unified"]["verdict"]["kind"] == "prefill_interference"
    assert by["unified"]["agreement"]["precision"] == 1.0 and by["unified"]["agreement"]["recall"] == 1.0
    assert by["disagg"]["verdict"]["kind"] == "not_prefill_stalls" and by["disagg"]["agreement"]["stall_gaps"] == 0
    assert sorted(os.listdir(tmp_path / "run" / "diagnose")) == [
        "gap_timeline-disagg.png", "gap_timeline-unified.png", "stall_fit-disagg.png", "stall_fit-unified.png",
        "summary.json"]
    assert page.read_text().count("data:image/png;base64,") == 4


def test_offline_every_request_is_a_stream_and_an_isolated_window_a_point():
    streams, _, _ = simulate()
    as_run = [Stream(s.id, "request", s.send, s.times, s.prompt_tokens) for s in streams]
    a = analyse("run", as_run, 50.0)
    assert len(a.fit.points) == 9 and a.verdict.kind == "prefill_interference"
    assert len(tag(as_run).of("stall")) == 36


def test_a_budget_never_promises_less_than_a_steady_step_plus_its_chunks_prefill():
    """A line fitted over long prompts may have a negative intercept (here -108 ms + 0.346 ms a token, as a
    2-core box measured): extrapolated to a small budget it would promise a negative stall."""
    from pdlab.diagnose.fit import Fit, Line, Point
    from pdlab.diagnose.verdict import _budget

    points = tuple(Point(f"p{n}", n, -108.0 + 0.346 * n, True, 0.346 * n) for n in (500, 1000, 2000, 4000))
    fit = Fit(points, Line(0.346, -108.0, 0.99, len(points)))
    assert fit.line.at(256) < 0
    budget, stall = _budget(fit, 50.0, 12.0)  # 12 + 0.346 x 64 is within 50 ms, 12 + 0.346 x 128 is not
    assert budget == 64 and stall == pytest.approx(12.0 + 0.346 * 64)
    assert _budget(fit, 50.0, 45.0) == (None, None)  # a steady step near the target leaves no room for a chunk
