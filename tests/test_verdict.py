"""The verdict, case by case: the structured judgement (pdlab.report.verdict) and the sentence generated from it
(pdlab.report.wording). What a user reads must be right whatever the numbers are.

Two tables. The first gives the verdict's inputs directly, including the shapes real runs produce (a grid whose
only rate failed is *open below*, not a closed 0). The second builds run directories from request records, as a
run does (tests/report_runs.py), and reads the verdict through compare: the same path `pdlab compare` takes.
(Runs with different SLOs or workloads are refused before any verdict: tests/test_compare.py.)"""

import pytest

from pdlab.measure.confidence import estimate
from pdlab.report.compare import compare
from pdlab.report.load import load
from pdlab.report.verdict import Side, judge
from pdlab.report.wording import sentence
from report_runs import DISAGG, UNIFIED, make, variant


def side(label, goodput, layout="disagg", **kw):
    return Side(label, estimate(goodput), layout=layout, **kw)


BASE = dict(layout="unified", itl_misses=30, ttft_misses=0, prefill_interruptions=100,
            throughput=estimate([500, 510, 490]))
TPUT = estimate([400, 405, 395])

CASES = [
    ("baseline 0, candidate serves",
     side("unified", [0, 0, 0], **BASE), side("disagg", [1.5, 1.6, 1.4], ttft_misses=4, throughput=TPUT),
     "baseline_fails",
     "disagg vs unified: goodput 1.50 ± 0.25 req/s against 0: unified meets the SLO at no rate tried and disagg "
     "does, so disaggregation is the difference between serving and not (ITL misses 30 → 0, TTFT misses 0 → 4, "
     "saturation throughput −20%)"),
    ("both 0, closed (the SLO cannot be met even at the search floor)",
     side("unified", [0, 0, 0], **BASE), side("disagg", [0, 0, 0]), "neither_serves",
     "disagg vs unified: neither meets the SLO at any rate tried (goodput 0 for both): nothing to choose here; "
     "loosen the SLO or change the deployment"),
    ("both 0, open below: a real grid whose only rate failed for both",
     side("unified", [0.0], bound="below", open_below=True, **BASE),
     side("disagg", [0.0], bound="below", open_below=True), "neither_serves",
     "disagg vs unified: neither meets the SLO at any rate tried (goodput 0 for both); try rates below the lowest "
     "tried (disagg and unified): nothing to choose here; loosen the SLO or change the deployment"),
    ("candidate 0, baseline serves",
     side("unified", [1.0, 1.1, 0.9], **BASE), side("disagg", [0, 0, 0]), "candidate_fails",
     "disagg vs unified: goodput 0 against 1.00 ± 0.25 req/s: disagg meets the SLO at no rate tried; unified is "
     "the one to deploy (ITL misses 30 → 0, TTFT misses 0 → 0)"),
    ("separated, better, bottleneck moved",
     side("unified", [1.3, 1.4, 1.5], **BASE), side("disagg", [3.9, 4.0, 4.1], ttft_misses=6, throughput=TPUT),
     "better",
     "disagg vs unified: goodput 4.00 ± 0.25 vs 1.40 ± 0.25 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 6, "
     "saturation throughput −20%: disaggregation bought predictability, not capacity; the remaining misses are "
     "TTFT misses: the bottleneck moved to prefill"),
    ("separated, better, capacity never measured (no all-at-once rate)",
     side("unified", [1.3, 1.4, 1.5], **{**BASE, "throughput": None}), side("disagg", [3.9, 4.0, 4.1]), "better",
     "disagg vs unified: goodput 4.00 ± 0.25 vs 1.40 ± 0.25 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "disaggregation bought predictability (capacity not measured: no all-at-once rate)"),
    ("step budget: chunked prefill's trade, paid in TTFT",
     side("budget-2048", [0.9, 1.0, 1.1], layout="unified", itl_misses=14, ttft_p50=estimate([180, 185, 182]),
          token_budget=2048, chunked=False),
     side("budget-32", [2.0, 2.1, 1.9], layout="unified", ttft_p50=estimate([310, 320, 318]), token_budget=32,
          chunked=True),
     "better",
     "budget-32 vs budget-2048: goodput 2.00 ± 0.25 vs 1.00 ± 0.25 req/s (2.00×), ITL misses 14 → 0, TTFT misses "
     "0 → 0: the smaller step budget (32 against 2048 tokens, chunked) bought predictability (capacity not "
     "measured: no all-at-once rate); paid in TTFT: TTFT p50 182 → 316 ms"),
    ("separated, worse",
     side("unified", [3.0, 3.1, 2.9], **BASE), side("disagg", [2.0, 2.1, 1.9]), "worse",
     "disagg vs unified: goodput 2.00 ± 0.25 vs 3.00 ± 0.25 req/s (0.67×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "unified is better here"),
    ("tie: intervals overlap",
     side("unified", [1.3, 1.6, 1.0], **BASE), side("disagg", [1.5, 1.2, 1.8]), "not_distinguishable",
     "disagg vs unified: goodput 1.50 ± 0.75 vs 1.30 ± 0.75 req/s (1.15×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "not distinguishable on this machine"),
    ("tie in simulation: never 'on this machine'",
     side("unified", [1.3, 1.6, 1.0], timing="simulated", **BASE), side("disagg", [1.5, 1.2, 1.8], timing="simulated"),
     "not_distinguishable",
     "disagg vs unified (simulated): goodput 1.50 ± 0.75 vs 1.30 ± 0.75 req/s (1.15×), ITL misses 30 → 0, TTFT "
     "misses 0 → 0: not distinguishable in simulation"),
    ("one repeat: no interval, no claim",
     side("unified", [1.4], **BASE), side("disagg", [4.0]), "not_distinguishable",
     "disagg vs unified: goodput 4.00 vs 1.40 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 0: not "
     "distinguishable on this machine (one repeat has no interval: set repeats: 3 or more to tell a difference "
     "from noise)"),
    ("modelled, one repeat, the candidate a lower bound (the MORI table's shape)",
     side("unified-2xTP4", [0.69], timing="modelled", **BASE),
     side("disagg-read", [10.0], bound="lower", open_above=True, timing="modelled"), "not_distinguishable",
     "disagg-read vs unified-2xTP4 (modelled): goodput ≥ 10.00 vs 0.69 req/s (≥ 14.49×: a lower bound), ITL "
     "misses 30 → 0, TTFT misses 0 → 0: not distinguishable under the timing model; a lower bound: the rates "
     "tried never failed for disagg-read (one repeat has no interval: set repeats: 3 or more to tell a difference "
     "from noise)"),
    ("both lower bounds: no ratio",
     side("unified", [4.0, 4.0, 4.0], bound="lower", open_above=True, layout="unified"),
     side("disagg", [4.0, 4.0, 4.0], bound="lower", open_above=True), "unified_enough",
     "disagg vs unified: goodput ≥ 4.00 ± 0.00 vs ≥ 4.00 ± 0.00 req/s (no ratio: both goodputs are lower bounds), "
     "ITL misses 0 → 0, TTFT misses 0 → 0: no ITL problem at these rates: the unified engine is enough; a lower "
     "bound: the rates tried never failed for disagg and unified"),
    ("bracket open below on one side is named",
     side("unified", [0.0, 0.1, 0.2], bound="lower", open_below=True, **BASE), side("disagg", [1.0, 1.1, 0.9]),
     "better",
     "disagg vs unified: goodput 1.00 ± 0.25 vs ≥ 0.10 ± 0.25 req/s (≤ 10.00×: an upper bound), ITL misses 30 → 0, "
     "TTFT misses 0 → 0: disaggregation bought predictability (capacity not measured: no all-at-once rate); the "
     "lowest rate tried already failed for unified"),
    ("limits differ: named",
     side("unified", [1.3, 1.4, 1.5], limit="ITL misses", **BASE),
     side("disagg", [3.9, 4.0, 4.1], limit="capacity (held to the saturation throughput)", capped=True,
          throughput=TPUT), "better",
     "disagg vs unified: goodput 4.00 ± 0.25 vs 1.40 ± 0.25 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 0, "
     "saturation throughput −20%: disaggregation bought predictability, not capacity; unified was limited by "
     "ITL misses, disagg by capacity (held to the saturation throughput)"),
    ("cross-engine: says so, names the TTFT it costs, never 'the unified engine is enough'",
     side("pdlab-unified", [2.0, 2.1, 1.9], layout="unified", ttft_p50=estimate([26, 25, 27])),
     side("vllm-disagg", [1.9, 2.0, 1.8], engine="vllm", ttft_p50=estimate([932, 900, 960])), "not_distinguishable",
     "vllm-disagg vs pdlab-unified (cross-engine: vllm against pdlab): goodput 1.90 ± 0.25 vs 2.00 ± 0.25 req/s "
     "(0.95×), ITL misses 0 → 0, TTFT misses 0 → 0: not distinguishable on this machine; TTFT p50 26 → 931 ms"),
    ("candidate cut short", side("unified", [1.4, 1.5, 1.3], **BASE), side("disagg", [2.0], partial=True),
     "no_verdict", "disagg vs unified: no verdict: the run of disagg was cut short (partial)"),
    ("candidate never ran", side("unified", [1.4, 1.5, 1.3], **BASE), side("disagg", [], ran=False), "no_verdict",
     "disagg vs unified: no verdict: disagg did not run"),
    ("no finite rate measured", side("unified", [1.4, 1.5, 1.3], **BASE), side("disagg", []), "no_verdict",
     "disagg vs unified: no verdict: disagg has no goodput (no finite rate measured)"),
]


@pytest.mark.parametrize("case,base,cand,outcome,text", CASES, ids=[c[0] for c in CASES])
def test_verdict(case, base, cand, outcome, text):
    v = judge(base, cand)
    assert v.outcome == outcome
    assert sentence(v) == text


def test_the_structured_verdict_carries_every_fact_of_its_sentence():
    v = judge(side("unified-2xTP4", [0.69], timing="modelled", **BASE),
              side("disagg-read", [10.0], bound="lower", open_above=True, timing="modelled"))
    d = v.to_dict()
    assert (d["kind"], d["timing"], d["outcome"], d["cross_engine"]) == ("disaggregation", "modelled",
                                                                         "not_distinguishable", False)
    assert d["ratio"] == pytest.approx(10 / 0.69) and d["ratio_bound"] == "lower"
    assert d["capacity_change"] is None  # the candidate measured no saturation: no capacity claim
    assert d["misses"] == {"itl": {"baseline": 30, "candidate": 0}, "ttft": {"baseline": 0, "candidate": 0}}
    assert d["open_above"] == ["disagg-read"] and d["repeats"] == 1


# ---- the same through run directories built from records ----

def _run(tmp_path, variants, **kw):
    return compare([load(make(tmp_path / "r", variants, **kw))])


def _verdict(result, candidate, baseline):
    return next(v for v in result["verdicts"] if (v["candidate"], v["baseline"]) == (candidate, baseline))


def test_records_a_grid_whose_only_rate_failed_for_both_says_neither_meets_it(tmp_path):
    """The real shape of `rates: [1]` with both goodputs 0: open below (the rates tried said nothing lower)."""
    res = _run(tmp_path, {"disagg-pull": variant(DISAGG, {"ttft": 5}), "unified": variant(UNIFIED, {"itl": 5})},
               rates=(1.0,))
    v = _verdict(res, "disagg-pull", "unified")
    assert v["outcome"] == "neither_serves" and v["open_below"] == ["disagg-pull", "unified"]
    assert "neither meets the SLO at any rate tried" in v["sentence"] and "on this machine" not in v["sentence"]
    assert [r["goodput"]["bound"] for r in res["rows"]] == ["below", "below"]


def test_records_like_is_paired_with_like_and_a_cross_engine_pair_says_it_is_one(tmp_path):
    """vllm-check's shape: pdlab and vLLM, unified and P/D. Each family is judged against its own unified
    variant; each vLLM row also against pdlab's row of the same layout, as a cross-engine comparison."""
    res = _run(tmp_path, {"pdlab-unified": variant(UNIFIED, {"itl": 4}),
                          "pdlab-disagg": variant(DISAGG, {}, ttft_ms=40.0),
                          "vllm-unified": variant(UNIFIED, {"itl": 4}, engine={"backend": "vllm"}),
                          "vllm-disagg": variant({**DISAGG, "mode": "pull"}, {}, engine={"backend": "vllm"},
                                                 ttft_ms=95.0)})
    pairs = {(v["candidate"], v["baseline"]): v for v in res["verdicts"]}
    assert set(pairs) == {("pdlab-disagg", "pdlab-unified"), ("vllm-disagg", "vllm-unified"),
                          ("vllm-unified", "pdlab-unified"), ("vllm-disagg", "pdlab-disagg")}
    assert res["baselines"] == {"pdlab": "pdlab-unified", "vllm": "vllm-unified"}
    assert pairs[("vllm-disagg", "vllm-unified")]["kind"] == "disaggregation"
    cross = pairs[("vllm-disagg", "pdlab-disagg")]
    assert cross["kind"] == "engine" and cross["cross_engine"]
    assert "(cross-engine: vllm against pdlab)" in cross["sentence"]
    assert cross["ttft_p50_ms"] == {"baseline": pytest.approx(40.0), "candidate": pytest.approx(95.0)}
    assert "TTFT p50 40 → 95 ms" in cross["sentence"]  # named, not silent
    assert not any("unified engine is enough" in v["sentence"] for v in res["verdicts"] if v["cross_engine"])


def test_records_a_step_budget_comparison_is_not_called_disaggregation(tmp_path):
    res = _run(tmp_path, {"budget-2048": variant(UNIFIED, lambda j, r: {"itl": 3 + j if r == 2.0 else 0},
                                                 engine={"token_budget": 2048}),
                          "budget-512": variant(UNIFIED, {}, engine={"token_budget": 512, "chunked_prefill": True})},
               repeats=3)
    v = res["verdicts"][0]
    assert v["kind"] == "step_budget" and v["outcome"] == "better"
    assert "the larger" not in v["sentence"] and "disaggregation" not in v["sentence"]
    assert "the smaller step budget (512 against 2048 tokens, chunked) bought predictability" in v["sentence"]


def test_records_a_simulated_run_never_says_on_this_machine(tmp_path):
    timing = {"timing": {"fixed_ms": 5, "prefill_token_ms": 0.5}}
    res = _run(tmp_path, {"unified": variant(UNIFIED, {}, model=timing), "disagg": variant(DISAGG, {}, model=timing)},
               env={"simulated": True})
    assert {r["timing"] for r in res["rows"]} == {"simulated"}
    v = res["verdicts"][0]
    assert v["timing"] == "simulated" and "on this machine" not in v["sentence"]


def test_records_capacity_is_named_only_when_saturation_was_measured(tmp_path):
    plan = {"unified": variant(UNIFIED, lambda j, r: {"itl": 3 + j % 2 if r == 2.0 else 0}),  # same saturation
            "disagg": variant(DISAGG, {})}
    with_sat = _run(tmp_path / "a", plan, repeats=3)
    without = _run(tmp_path / "b", plan, rates=(1.0, 2.0), repeats=3)
    assert with_sat["verdicts"][0]["capacity_change"] == pytest.approx(0.0, abs=0.01)
    assert "predictability, not capacity" in with_sat["verdicts"][0]["sentence"]
    assert without["verdicts"][0]["capacity_change"] is None
    assert "capacity not measured" in without["verdicts"][0]["sentence"]
    assert without["verdicts"][0]["ratio_bound"] == "lower"  # disagg never failed: its goodput is a lower bound
    assert "(≥ " in without["verdicts"][0]["sentence"]
