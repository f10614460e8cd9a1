"""The verdict's sentence, generated from the structured verdict (pdlab.report.verdict.Verdict) and nothing
else: every number and every claim in it is a field of the verdict, so `compare --json` carries the facts
and the table the words.
"""

from __future__ import annotations

from pdlab.report.verdict import CAPACITY_GAIN, WHERE, Verdict

CAVEAT = " (one repeat has no interval: set repeats: 3 or more to tell a difference from noise)"
RATIO = {"exact": " ({:.2f}×)", "lower": " (≥ {:.2f}×: a lower bound)", "upper": " (≤ {:.2f}×: an upper bound)",
         "unknown": " (no ratio: both goodputs are lower bounds)"}


def _head(v: Verdict) -> str:
    notes = ([f"cross-engine: {v.engines[1]} against {v.engines[0]}"] if v.cross_engine else []) + (
        [v.timing] if v.timing != "measured" else [])
    return f"{v.candidate} vs {v.baseline}" + (f" ({'; '.join(notes)})" if notes else "") + ": "


def _misses(v: Verdict) -> str:
    (bi, ci), (bt, ct) = v.itl_misses, v.ttft_misses
    cap = "" if v.capacity_change is None else f", saturation throughput {v.capacity_change * 100:+.0f}%"
    return f"ITL misses {bi} → {ci}, TTFT misses {bt} → {ct}{cap}".replace("-", "−")


def _nums(v: Verdict) -> str:
    ratio = "" if v.ratio is None else RATIO[v.ratio_bound].format(v.ratio)
    return f"goodput {v.goodput_text[1]} vs {v.goodput_text[0]} req/s{ratio}"


def _ttft(v: Verdict) -> str:
    if v.ttft_p50_ms is None:
        return ""
    a, b = v.ttft_p50_ms
    paid = "paid in TTFT: " if v.outcome in ("better", "baseline_fails") and b > a else ""
    return f"; {paid}TTFT p50 {a:.0f} → {b:.0f} ms"


def _bounds(v: Verdict) -> str:
    out = ""
    if v.open_above:
        out += "; a lower bound: the rates tried never failed for " + " and ".join(v.open_above)
    if v.open_below:
        out += "; the lowest rate tried already failed for " + " and ".join(v.open_below)
    return out


def _limits(v: Verdict) -> str:
    b, c = v.limits
    if not b or not c or b == c:
        return ""
    return f"; {v.baseline} was limited by {b}, {v.candidate} by {c}"


def _bought(v: Verdict) -> str:
    (bi, ci), (bt, ct) = v.itl_misses, v.ttft_misses
    gain = "predictability" if ci < bi else "lower TTFT" if ct < bt else "goodput"
    if v.capacity_change is None:
        what = f"{gain} (capacity not measured: no all-at-once rate)"
    else:
        what = f"{gain} and capacity" if v.capacity_change > CAPACITY_GAIN else f"{gain}, not capacity"
    moved = ("; the remaining misses are TTFT misses: the bottleneck moved to prefill"
             if v.kind == "disaggregation" and ct > 0 and ci < bi else "")
    return f"{v.who} bought {what}{moved}"


def sentence(v: Verdict) -> str:
    head, b, c = _head(v), v.baseline, v.candidate
    if v.outcome == "no_verdict":
        return head + f"no verdict: {v.reason}"
    if v.outcome == "neither_serves":
        lower = f"; try rates below the lowest tried ({' and '.join(v.open_below)})" if v.open_below else ""
        return head + (f"neither meets the SLO at any rate tried (goodput 0 for both){lower}: nothing to choose "
                       "here; loosen the SLO or change the deployment")
    caveat = CAVEAT if v.repeats < 2 else ""
    tail = f"{_ttft(v)}{_bounds(v)}{_limits(v)}"
    if v.outcome == "baseline_fails":
        return head + (f"goodput {v.goodput_text[1]} req/s against 0: {b} meets the SLO at no rate tried and {c} "
                       f"does, so {v.who} is the difference between serving and not ({_misses(v)}){tail}")
    if v.outcome == "candidate_fails":
        return head + (f"goodput 0 against {v.goodput_text[0]} req/s: {c} meets the SLO at no rate tried; {b} is "
                       f"the one to deploy ({_misses(v)}){tail}")
    lead = f"{_nums(v)}, {_misses(v)}: "
    if v.outcome == "better":
        return head + lead + _bought(v) + tail
    if v.outcome == "worse":
        return head + lead + f"{b} is better here" + tail
    if v.outcome == "unified_enough":
        return head + lead + "no ITL problem at these rates: the unified engine is enough" + tail + caveat
    return head + lead + f"not distinguishable {WHERE[v.timing]}" + tail + caveat
