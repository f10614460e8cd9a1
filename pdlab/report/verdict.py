"""The verdict: one sentence per variant against the baseline, right in every case the numbers allow.

A difference is claimed only when the goodput intervals over repeats separate (pdlab.measure.confidence);
with one repeat there is no interval and the verdict says so instead of guessing. Cases, in the order they
are decided:

1. a row that did not run, or whose run was cut short: no verdict, say why;
2. neither meets the SLO at any rate tried (goodput 0 on both): nothing to choose;
3. the baseline meets it nowhere and the candidate does: the candidate is the difference between serving
   and not (never "n/a");
4. the candidate meets it nowhere and the baseline does: the reverse;
5. intervals separate: the ratio, what it bought (predictability, capacity), where the misses went;
   a bound that did not close (goodput a lower bound, or 0 above an unexplored floor) is named;
6. intervals overlap, or one repeat: not distinguishable on this machine; with no ITL problem in the
   baseline, the unified engine is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdlab.measure.confidence import Estimate, format_estimate, separated


@dataclass(frozen=True)
class Row:
    """What a verdict reads of one compare row."""

    label: str
    kind: str  # unified | disagg | ?
    ran: bool
    partial: bool
    goodput: Estimate
    open_above: bool = False  # some repeat never failed: goodput is a lower bound
    open_below: bool = False  # some repeat failed at the lowest rate tried, above the search floor
    capped: bool = False  # some repeat met the SLO up to its saturation throughput: capacity limits it
    itl_misses: int = 0
    ttft_misses: int = 0
    prefill_interruptions: int = 0
    throughput: Optional[Estimate] = None  # output tok/s at saturation
    ttft_p50: Optional[Estimate] = None  # at the latency table's rate (ms)


def _g(r: Row) -> str:
    s = format_estimate(r.goodput)
    return ("≥ " + s) if r.open_above else s


def _zero(r: Row) -> bool:
    return r.goodput.mean is not None and r.goodput.mean == 0 and not r.open_below


def _misses(base: Row, row: Row) -> str:
    return (f"ITL misses {base.itl_misses} → {row.itl_misses}, TTFT misses {base.ttft_misses} → {row.ttft_misses}")


def _throughput(base: Row, row: Row) -> Optional[float]:
    if base.throughput is None or row.throughput is None or not base.throughput.mean or row.throughput.mean is None:
        return None
    return (row.throughput.mean - base.throughput.mean) / base.throughput.mean


def _ttft_cost(base: Row, row: Row) -> str:
    """'; paid in TTFT: p50 182 → 318 ms' when the candidate's median TTFT is higher beyond noise."""
    a, b = base.ttft_p50, row.ttft_p50
    if a is None or b is None or a.mean is None or b.mean is None or not separated(a, b) or b.mean <= a.mean:
        return ""
    return f"; paid in TTFT: p50 {a.mean:.0f} → {b.mean:.0f} ms"


def verdict(base: Row, row: Row) -> str:
    head = f"{row.label} vs {base.label}: "
    for r in (row, base):
        if not r.ran:
            return head + f"no verdict: {r.label} did not run"
        if r.partial:
            return head + f"no verdict: the run of {r.label} was cut short (partial)"
        if r.goodput.mean is None:
            return head + f"no verdict: {r.label} has no goodput (no finite rate measured)"
    if _zero(base) and _zero(row):
        return head + ("neither meets the SLO at any rate tried (goodput 0 for both): nothing to choose here; "
                       "loosen the SLO or change the deployment")
    thr = _throughput(base, row)
    thr_s = "" if thr is None else f", saturation throughput {thr * 100:+.0f}%".replace("-", "−")
    who = "disaggregation" if row.kind == "disagg" and base.kind != "disagg" else row.label
    if _zero(base) and row.goodput.mean > 0:
        return head + (f"goodput {_g(row)} req/s against 0: {base.label} meets the SLO at no rate tried and "
                       f"{row.label} does, so {who} is the difference between serving and not "
                       f"({_misses(base, row)}{thr_s})")
    if _zero(row) and base.goodput.mean > 0:
        return head + (f"goodput 0 against {_g(base)} req/s: {row.label} meets the SLO at no rate tried; "
                       f"{base.label} is the one to deploy ({_misses(base, row)}{thr_s})")
    ratio = row.goodput.mean / base.goodput.mean if base.goodput.mean else None
    nums = f"goodput {_g(row)} vs {_g(base)} req/s" + (f" ({ratio:.2f}×)" if ratio else "")
    one = base.goodput.n < 2 or row.goodput.n < 2
    caveat = " (one repeat has no interval: set repeats: 3 or more to tell a difference from noise)" if one else ""
    bound = ""
    if row.open_above or base.open_above:
        bound = "; a lower bound: the rates tried never failed for " + " and ".join(
            r.label for r in (row, base) if r.open_above)
    if row.open_below or base.open_below:
        bound += "; the lowest rate tried already failed for " + " and ".join(
            r.label for r in (row, base) if r.open_below)
    if row.capped or base.capped:
        bound += "; held to the saturation throughput (capacity, not latency, limits it) for " + " and ".join(
            r.label for r in (row, base) if r.capped)
    if not one and separated(row.goodput, base.goodput):
        if row.goodput.mean > base.goodput.mean:
            what = "capacity and predictability" if thr is not None and thr > 0.05 else "predictability, not capacity"
            moved = ("; the remaining misses are TTFT misses: the bottleneck moved to prefill"
                     if row.ttft_misses > 0 and row.itl_misses < base.itl_misses else "")
            cost = _ttft_cost(base, row)
            return head + f"{nums}, {_misses(base, row)}{thr_s}: {who} bought {what}{moved}{cost}{bound}"
        return head + f"{nums}, {_misses(base, row)}{thr_s}: {base.label} is better here{bound}"
    if base.kind == "unified" and base.itl_misses == 0 and base.prefill_interruptions == 0:
        return head + (f"{nums}, {_misses(base, row)}{thr_s}: no ITL problem at these rates: the unified engine "
                       f"is enough{bound}{caveat}")
    return head + f"{nums}, {_misses(base, row)}{thr_s}: not distinguishable on this machine{bound}{caveat}"
