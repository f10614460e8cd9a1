"""The verdict sentence, one row per case: what a user reads must be right whatever the numbers are.
(Runs with different SLOs or workloads are refused before any verdict: tests/test_compare.py.)"""

import pytest

from pdlab.measure.confidence import estimate
from pdlab.report.verdict import Row, verdict


def row(label, goodput, kind="disagg", **kw):
    kw.setdefault("itl_misses", 0)
    return Row(label, kind, kw.pop("ran", True), kw.pop("partial", False), estimate(goodput), **kw)


BASE = dict(kind="unified", itl_misses=30, ttft_misses=0, prefill_interruptions=100,
            throughput=estimate([500, 510, 490]))
TPUT = estimate([400, 405, 395])

CASES = [
    ("baseline 0, candidate serves",
     row("unified", [0, 0, 0], **BASE), row("disagg", [1.5, 1.6, 1.4], ttft_misses=4, throughput=TPUT),
     "disagg vs unified: goodput 1.50 ± 0.25 req/s against 0: unified meets the SLO at no rate tried and disagg "
     "does, so disaggregation is the difference between serving and not (ITL misses 30 → 0, TTFT misses 0 → 4, "
     "saturation throughput −20%)"),
    ("both 0",
     row("unified", [0, 0, 0], **BASE), row("disagg", [0, 0, 0]),
     "disagg vs unified: neither meets the SLO at any rate tried (goodput 0 for both): nothing to choose here; "
     "loosen the SLO or change the deployment"),
    ("candidate 0, baseline serves",
     row("unified", [1.0, 1.1, 0.9], **BASE), row("disagg", [0, 0, 0]),
     "disagg vs unified: goodput 0 against 1.00 ± 0.25 req/s: disagg meets the SLO at no rate tried; unified is "
     "the one to deploy (ITL misses 30 → 0, TTFT misses 0 → 0)"),
    ("separated, better, bottleneck moved",
     row("unified", [1.3, 1.4, 1.5], **BASE), row("disagg", [3.9, 4.0, 4.1], ttft_misses=6, throughput=TPUT),
     "disagg vs unified: goodput 4.00 ± 0.25 vs 1.40 ± 0.25 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 6, "
     "saturation throughput −20%: disaggregation bought predictability, not capacity; the remaining misses are "
     "TTFT misses: the bottleneck moved to prefill"),
    ("separated, better, paid in TTFT (chunked prefill's trade)",
     row("budget-2048", [0.9, 1.0, 1.1], kind="unified", itl_misses=14, ttft_p50=estimate([180, 185, 182])),
     row("budget-32", [2.0, 2.1, 1.9], kind="unified", ttft_p50=estimate([310, 320, 318])),
     "budget-32 vs budget-2048: goodput 2.00 ± 0.25 vs 1.00 ± 0.25 req/s (2.00×), ITL misses 14 → 0, TTFT misses "
     "0 → 0: budget-32 bought predictability, not capacity; paid in TTFT: p50 182 → 316 ms"),
    ("separated, worse",
     row("unified", [3.0, 3.1, 2.9], **BASE), row("disagg", [2.0, 2.1, 1.9]),
     "disagg vs unified: goodput 2.00 ± 0.25 vs 3.00 ± 0.25 req/s (0.67×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "unified is better here"),
    ("tie: intervals overlap",
     row("unified", [1.3, 1.6, 1.0], **BASE), row("disagg", [1.5, 1.2, 1.8]),
     "disagg vs unified: goodput 1.50 ± 0.75 vs 1.30 ± 0.75 req/s (1.15×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "not distinguishable on this machine"),
    ("one repeat: no interval, no claim",
     row("unified", [1.4], **BASE), row("disagg", [4.0]),
     "disagg vs unified: goodput 4.00 vs 1.40 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 0: not "
     "distinguishable on this machine (one repeat has no interval: set repeats: 3 or more to tell a difference "
     "from noise)"),
    ("bracket open above (a lower bound) still separates",
     row("unified", [1.3, 1.4, 1.5], **BASE), row("disagg", [4.0, 4.0, 4.0], open_above=True),
     "disagg vs unified: goodput ≥ 4.00 ± 0.00 vs 1.40 ± 0.25 req/s (2.86×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "disaggregation bought predictability, not capacity; a lower bound: the rates tried never failed for disagg"),
    ("bracket open below is named",
     row("unified", [0.0, 0.1, 0.2], open_below=True, **BASE), row("disagg", [1.0, 1.1, 0.9]),
     "disagg vs unified: goodput 1.00 ± 0.25 vs 0.10 ± 0.25 req/s (10.00×), ITL misses 30 → 0, TTFT misses 0 → 0: "
     "disaggregation bought predictability, not capacity; the lowest rate tried already failed for unified"),
    ("no ITL problem in the unified baseline",
     row("unified", [2.0, 2.1, 1.9], kind="unified"), row("disagg", [1.9, 2.0, 1.8]),
     "disagg vs unified: goodput 1.90 ± 0.25 vs 2.00 ± 0.25 req/s (0.95×), ITL misses 0 → 0, TTFT misses 0 → 0: "
     "no ITL problem at these rates: the unified engine is enough"),
    ("candidate cut short",
     row("unified", [1.4, 1.5, 1.3], **BASE), row("disagg", [2.0], partial=True),
     "disagg vs unified: no verdict: the run of disagg was cut short (partial)"),
    ("candidate never ran",
     row("unified", [1.4, 1.5, 1.3], **BASE), row("disagg", [], ran=False),
     "disagg vs unified: no verdict: disagg did not run"),
    ("baseline cut short",
     row("unified", [1.4], partial=True, **BASE), row("disagg", [4.0, 4.1, 3.9]),
     "disagg vs unified: no verdict: the run of unified was cut short (partial)"),
    ("no finite rate measured",
     row("unified", [1.4, 1.5, 1.3], **BASE), row("disagg", []),
     "disagg vs unified: no verdict: disagg has no goodput (no finite rate measured)"),
]


@pytest.mark.parametrize("case,base,cand,sentence", CASES, ids=[c[0] for c in CASES])
def test_verdict_sentence(case, base, cand, sentence):
    assert verdict(base, cand) == sentence
