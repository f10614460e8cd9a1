"""The formulas of DESIGN.md's Measurement section, on cases small enough to compute by hand."""

import math

import pytest

from pdlab.measure.attribution import attribute_gaps, ttft_parts
from pdlab.measure.metrics import build_request_record, stats, summarize_rate, timings
from pdlab.measure.search import goodput_of
from pdlab.measure.slo import itl_value, miss_kind, request_slo
from pdlab.measure.summary import summarize_run
from pdlab.recipe import SLO as Slo

SLO = Slo(ttft_ms=100.0, itl_ms=50.0, itl_stat="p99", attainment=0.9)


def rec(id, arrival, times, slo=SLO, error=None, worker="u0", rate=1.0, variant="v", **kw):
    return build_request_record(variant=variant, rate=rate, id=id, prompt_ids=[1] * 10, output_ids=[5] * len(times),
                                arrival=arrival, token_times=times, slo=slo, error=error,
                                workers={"unified": worker}, **kw)


def test_timings_by_hand():
    # arrival 10.0; tokens at 10.05, 10.07, 10.10, 10.17
    t = timings(10.0, [10.05, 10.07, 10.10, 10.17])
    assert t["ttft"] == pytest.approx(0.05)
    assert t["e2el"] == pytest.approx(0.17)
    assert t["itl"] == pytest.approx([0.02, 0.03, 0.07])
    assert t["tpot"] == pytest.approx((0.17 - 0.05) / 3)  # = mean of the gaps, 0.04
    one = timings(1.0, [1.5])
    assert (one["tpot"], one["itl"]) == (None, [])


def test_stats_use_numpy_linear_percentiles():
    s = stats([1, 2, 3, 4], scale=1000)
    # p50 of 1,2,3,4 -> 2.5; p90 -> 1 + 0.9*3 = 3.7 ; p99 -> 3.97
    assert s == pytest.approx({"mean": 2500.0, "p50": 2500.0, "p90": 3700.0, "p99": 3970.0, "max": 4000.0, "n": 4})
    assert stats([])["p99"] is None


def test_itl_stat_choices():
    gaps = [0.01, 0.02, 0.03, 0.10]
    assert itl_value(gaps, "mean") == pytest.approx(0.04)
    assert itl_value(gaps, "p50") == pytest.approx(0.025)
    assert itl_value(gaps, "p90") == pytest.approx(0.03 + 0.7 * 0.07)  # rank 2.7
    assert itl_value(gaps, "max") == pytest.approx(0.10)
    assert itl_value([], "p99") is None


def test_request_slo_and_miss_kinds():
    slo = SLO.replace(itl_stat="max")
    assert request_slo(True, 0.09, [0.04, 0.05], slo)["slo_ok"] is True  # <= is a pass
    r = request_slo(True, 0.2, [0.04], slo)
    assert (r["slo_ttft_ok"], r["slo_itl_ok"]) == (False, True)
    r = request_slo(True, 0.05, [], slo)  # one output token: no gaps, ITL met
    assert r["slo_itl_ok"] and r["slo_itl_value"] is None
    assert request_slo(False, None, [], slo)["slo_ok"] is False
    kinds = [miss_kind({"ok": ok, "slo_ttft_ok": t, "slo_itl_ok": i})
             for ok, t, i in [(True, True, True), (True, False, True), (True, True, False),
                              (True, False, False), (False, False, False)]]
    assert kinds == [None, "ttft_only", "itl_only", "both", "failed"]


def test_build_request_record_fields():
    r = rec("a", 0.0, [0.05, 0.08, 0.2], cached_tokens=4, phases={"prefill_start": 0.01})
    assert r["ttft"] == pytest.approx(0.05) and r["e2el"] == pytest.approx(0.2)
    assert r["itl"] == pytest.approx([0.03, 0.12])
    assert r["slo_ttft_ok"] and not r["slo_itl_ok"] and not r["slo_ok"]  # p99 of gaps ~0.119 > 50 ms
    assert r["prefill_worker"] == r["decode_worker"] == "u0"
    assert (r["prompt_len"], r["output_len"], r["cached_tokens"], r["ok"]) == (10, 3, 4, True)
    f = rec("b", 0.0, [], error="worker died")
    assert not f["ok"] and not f["slo_ok"] and f["ttft"] is None


def test_goodput_interpolates_where_attainment_crosses_target():
    g = goodput_of([(1, 1.0), (2, 0.95), (4, 0.85), (8, 0.2)], 0.9)
    # between 2 (0.95) and 4 (0.85): 2 + (0.95-0.9)/(0.95-0.85) * 2 = 3.0
    assert g.goodput == pytest.approx(3.0)
    assert g.closed and g.monotonic and (g.last_pass, g.first_fail) == (2.0, 4.0)


def test_goodput_edge_cases():
    allpass = goodput_of([(1, 1.0), (2, 0.95), (math.inf, 0.1)], 0.9)  # inf is saturation, not a rate
    assert allpass.goodput == 2.0 and allpass.open_above
    assert [r for r, _ in allpass.trials] == [1.0, 2.0]
    nopass = goodput_of([(1, 0.5), (2, 0.2)], 0.9)
    assert nopass.goodput == 0.0 and nopass.open_below
    exact = goodput_of([(1, 1.0), (2, 0.9), (4, 0.5)], 0.9)  # exactly at target passes
    assert exact.goodput == pytest.approx(2.0)
    # the first crossing bounds goodput: a pass above a failure is flagged, never rewarded
    bumpy = goodput_of([(1, 0.95), (2, 0.5), (4, 0.92), (6, 0.4)], 0.9)
    assert bumpy.goodput == pytest.approx(1 + 0.05 / 0.45) and not bumpy.monotonic
    assert goodput_of([(math.inf, 1.0)], 0.9).goodput is None


def test_ttft_parts_unified_and_disagg():
    u = ttft_parts(0.0, 0.5, {"prefill_start": 0.1, "prefill_end": 0.45})
    assert u["queue"] == pytest.approx(0.1) and u["prefill"] == pytest.approx(0.35)
    assert u["delivery"] == pytest.approx(0.05) and u["transfer"] is None and u["admission"] is None
    ph = {"prefill_start": 0.1, "prefill_end": 0.4, "transfer_start": 0.3, "transfer_end": 0.45, "admitted": 0.47}
    d = ttft_parts(0.0, 0.5, ph)
    assert d["transfer"] == pytest.approx(0.05)  # push: only the exposed part after prefill_end
    assert d["admission"] == pytest.approx(0.02) and d["delivery"] == pytest.approx(0.03)
    assert sum(d.values()) == pytest.approx(0.5)  # the parts add up to TTFT
    early = ttft_parts(0.0, 0.42, ph)  # first token from prefill: transfer/admission happen after TTFT
    assert early["transfer"] is None and early["delivery"] == pytest.approx(0.02)
    assert ttft_parts(0.0, 0.5, {})["queue"] is None


def test_interference_attribution():
    steps = [
        {"worker": "u0", "start": 0.00, "end": 0.01, "prefill_tokens": 0, "decode_seqs": 1},
        {"worker": "u0", "start": 0.01, "end": 0.30, "prefill_tokens": 1800, "decode_seqs": 1},  # long prefill
        {"worker": "u0", "start": 0.30, "end": 0.31, "prefill_tokens": 0, "decode_seqs": 1},
        {"worker": "u0", "start": 0.40, "end": 0.50, "prefill_tokens": 0, "decode_seqs": 1, "preempted": 1},
        {"worker": "u1", "start": 0.01, "end": 0.30, "prefill_tokens": 999, "decode_seqs": 0},  # other worker
    ]
    r = rec("a", 0.0, [0.01, 0.31, 0.32, 0.50, 0.52, 0.70])
    gaps = attribute_gaps([r], steps, itl_ms=50)
    assert [(g["index"], g["cause"]) for g in gaps] == [(1, "prefill"), (3, "preemption"), (5, "no_step")]
    assert gaps[0]["prefill_tokens"] == 1800  # u1's prefill does not count: it did not produce these tokens


def test_summarize_rate_by_hand():
    rs = [
        rec("a", 0.0, [0.05, 0.07, 0.09]),          # ok
        rec("b", 1.0, [1.20, 1.22]),                # TTFT 200 ms > 100: ttft-only
        rec("c", 2.0, [2.05, 2.20]),                # gap 150 ms: itl-only
        rec("d", 3.0, [3.5, 3.9]),                  # both
        rec("e", 4.0, [], error="boom"),            # failed
        rec("w", 0.0, [0.01], warmup=True),         # warm-up: ignored
    ]
    steps = [{"worker": "u0", "start": 2.06, "end": 2.19, "prefill_tokens": 500, "decode_seqs": 1}]
    s = summarize_rate(rs, steps, [{"start": 0, "end": 0.002, "bytes": 100}], SLO)
    assert (s["sent"], s["completed"], s["failed"], s["slo_met"]) == (5, 4, 1, 1)
    assert s["attainment"] == pytest.approx(0.2)
    assert s["misses"] == {"ttft_only": 1, "itl_only": 1, "both": 1, "failed": 1}
    assert s["duration_s"] == pytest.approx(3.9)  # first arrival 0.0 -> last token 3.9
    assert s["output_tok_s"] == pytest.approx(9 / 3.9)
    assert s["total_tok_s"] == pytest.approx((9 + 40) / 3.9)
    assert s["slo_met_per_s"] == pytest.approx(1 / 3.9)
    assert s["ttft_ms"]["p50"] == pytest.approx(125.0)  # 50, 50, 200, 500 -> (50+200)/2
    assert s["itl_ms"]["max"] == pytest.approx(400.0)
    assert s["interference"]["prefill_interruptions"] == 1  # c's gap overlaps a prefill step
    assert s["interference"]["slow_gaps"] == 2  # c's 150 ms and d's 400 ms
    assert s["transfers"]["count"] == 1 and s["transfers"]["copy_ms"]["max"] == pytest.approx(2.0)


def test_summarize_run_goodput_per_variant():
    reqs = []
    for rate, n_ok in [(1.0, 10), (2.0, 8), (math.inf, 2)]:
        for i in range(10):
            late = i >= n_ok
            reqs.append(rec(f"{rate}-{i}", 0.0, [0.5 if late else 0.05, 0.55 if late else 0.06], rate=rate))
    s = summarize_run(reqs, [], [], SLO)
    v = s["variants"]["v"]
    assert list(v["rates"]) == ["1", "2", "inf"]
    assert v["rates"]["2"]["attainment"] == pytest.approx(0.8)
    # 1 -> 1.0, 2 -> 0.8: 1 + (1.0 - 0.9) / 0.2 * 1 = 1.5
    assert v["goodput"]["mean"] == pytest.approx(1.5) and v["goodput"]["closed"]
    assert v["saturation"]["output_tok_s"]["mean"] == pytest.approx(20 / 0.55)
    assert s["slo"] == {"ttft_ms": 100.0, "itl_ms": 50.0, "itl_stat": "p99", "attainment": 0.9}
    assert s["partial"] is False


def test_a_rate_pooled_over_repeats_is_timed_repeat_by_repeat():
    """The two repeats of a rate ran 100 s apart (the other rates in between): pooled, the rate's throughput and
    realised rate are those of each repeat, not of the time from the first repeat's start to the second's end."""
    reqs = []
    for repeat, t0 in ((0, 0.0), (1, 100.0)):
        for rate in (2.0, math.inf):
            for i in range(4):
                arrival = t0 + (0.0 if math.isinf(rate) else i * 0.5)
                reqs.append(rec(f"{rate}-{repeat}-{i}", arrival, [arrival + 0.05, arrival + 0.08], rate=rate,
                                repeat=repeat))
    one = summarize_run([r for r in reqs if r["repeat"] == 0], [], [], SLO)["variants"]["v"]["rates"]
    both = summarize_run(reqs, [], [], SLO)["variants"]["v"]["rates"]
    assert one["inf"]["output_tok_s"] == pytest.approx(8 / 0.08) and one["inf"]["slo_met"] == 4
    for tag in ("2", "inf"):
        for k in ("output_tok_s", "request_throughput", "total_tok_s", "slo_met_per_s"):
            assert both[tag][k] == pytest.approx(one[tag][k]), (tag, k)
        assert both[tag]["duration_s"] == pytest.approx(2 * one[tag]["duration_s"])
    assert one["2"]["realised_rate"] == pytest.approx(2.0) and both["2"]["realised_rate"] == pytest.approx(2.0)
    # a third repeat whose requests all failed: no duration to add, its failures counted
    dead = [rec(f"x-{i}", 300.0 + i * 0.5, [], rate=2.0, repeat=2, error="boom") for i in range(4)]
    three = summarize_run(reqs + dead, [], [], SLO)["variants"]["v"]["rates"]["2"]
    assert three["duration_s"] == pytest.approx(both["2"]["duration_s"]) and three["failed"] == 4
    assert three["output_tok_s"] == pytest.approx(one["2"]["output_tok_s"])
    assert three["realised_rate"] == pytest.approx(2.0)


def test_ttft_parts_wait_for_room_is_admission_not_transfer():
    # pull: prefill ends at 0.40, the decode side finds KV room at 0.46, copies until 0.47, admits at 0.48
    ph = {"prefill_start": 0.1, "prefill_end": 0.40, "transfer_start": 0.46, "transfer_end": 0.47, "admitted": 0.48}
    p = ttft_parts(0.0, 0.5, ph)
    assert p["transfer"] == pytest.approx(0.01) and p["admission"] == pytest.approx(0.07)
    assert sum(p.values()) == pytest.approx(0.5)
    # push: the copy overlapped prefill; only what is left after prefill_end is exposed
    ph = {"prefill_start": 0.1, "prefill_end": 0.40, "transfer_start": 0.2, "transfer_end": 0.405, "admitted": 0.41}
    p = ttft_parts(0.0, 0.5, ph)
    assert p["transfer"] == pytest.approx(0.005) and p["admission"] == pytest.approx(0.005)
