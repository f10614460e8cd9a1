"""The verdict: a structured judgement of one variant against its baseline (its sentence: pdlab.report.wording).

What is compared decides the words (`kind`):
- `disaggregation`: a unified and a disaggregated layout of one engine ("disaggregation bought ...");
- `step_budget`: one layout, another step token budget or chunking ("the smaller step budget bought ...");
- `engine`: two engine families (pdlab, vllm, endpoint): a cross-engine comparison, and it says so;
- `deployment`: anything else of one engine and layout (pull against push, TP, replicas, the prefix cache).
Where the times come from (`timing`: measured, modelled, simulated) decides the place: only measured times
are "on this machine"; modelled ones are "under the timing model", simulated ones "in simulation".

A difference is claimed only when the goodput intervals over repeats separate (pdlab.measure.confidence):
with one repeat there is no interval and the verdict says so. The goodput ratio carries its bound type
(`exact`; `lower` when the candidate's goodput is a lower bound; `upper` when the baseline's is; `unknown`
when both are), and capacity is named only when both sides measured saturation. Outcomes, in the order they
are decided: no_verdict (a side did not run, was cut short, or has no goodput), neither_serves,
baseline_fails, candidate_fails, better, worse, unified_enough (a disaggregation whose unified baseline had
no ITL problem), not_distinguishable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pdlab.measure.confidence import Estimate, format_estimate, separated

KINDS = ("disaggregation", "step_budget", "engine", "deployment")
OUTCOMES = ("no_verdict", "neither_serves", "baseline_fails", "candidate_fails", "better", "worse",
            "unified_enough", "not_distinguishable")
WHERE = {"measured": "on this machine", "modelled": "under the timing model", "simulated": "in simulation"}
CAPACITY_GAIN = 0.05  # saturation throughput up by more than this: disaggregation bought capacity too
TTFT_NOTABLE = 2.0  # a median TTFT this many times the other's is named even without separated intervals


@dataclass(frozen=True)
class Side:
    """What a verdict reads of one compare row (pdlab.report.rows.Row.side)."""

    label: str
    goodput: Estimate
    engine: str = "pdlab"
    layout: str = "unified"  # unified | disagg | ?
    timing: str = "measured"  # measured | modelled | simulated
    bound: str = "exact"  # exact | lower | below (pdlab.report.rows.Goodput.bound)
    open_above: bool = False
    open_below: bool = False
    capped: bool = False
    limit: str = ""
    itl_misses: int = 0
    ttft_misses: int = 0
    prefill_interruptions: int = 0
    throughput: Optional[Estimate] = None  # output tok/s at saturation; None when not measured
    ttft_p50: Optional[Estimate] = None  # at the latency table's rate (ms)
    token_budget: Optional[int] = None
    chunked: Optional[bool] = None
    ran: bool = True
    partial: bool = False


@dataclass(frozen=True)
class Verdict:
    baseline: str
    candidate: str
    kind: str
    timing: str
    outcome: str
    cross_engine: bool = False
    engines: tuple[str, str] = ("pdlab", "pdlab")
    reason: Optional[str] = None  # why there is no verdict
    goodput: tuple[Optional[float], Optional[float]] = (None, None)  # baseline, candidate means
    goodput_text: tuple[str, str] = ("—", "—")
    ratio: Optional[float] = None
    ratio_bound: Optional[str] = None  # exact | lower | upper | unknown
    separated: bool = False
    repeats: int = 0  # the fewer of the two sides
    limits: tuple[str, str] = ("", "")
    itl_misses: tuple[int, int] = (0, 0)
    ttft_misses: tuple[int, int] = (0, 0)
    capacity_change: Optional[float] = None  # saturation output tok/s, relative; None unless both measured it
    ttft_p50_ms: Optional[tuple[float, float]] = None  # named when notable
    open_above: tuple[str, ...] = ()
    open_below: tuple[str, ...] = ()
    who: str = field(default="", repr=False)  # the subject of "... bought": disaggregation, a step budget, a label

    def to_dict(self) -> dict:
        b, c = self.baseline, self.candidate
        return {"baseline": b, "candidate": c, "kind": self.kind, "timing": self.timing, "outcome": self.outcome,
                "cross_engine": self.cross_engine,
                "engines": {"baseline": self.engines[0], "candidate": self.engines[1]},
                "reason": self.reason, "goodput": {"baseline": self.goodput[0], "candidate": self.goodput[1]},
                "ratio": self.ratio, "ratio_bound": self.ratio_bound, "separated": self.separated,
                "repeats": self.repeats, "limits": {"baseline": self.limits[0], "candidate": self.limits[1]},
                "misses": {"itl": {"baseline": self.itl_misses[0], "candidate": self.itl_misses[1]},
                           "ttft": {"baseline": self.ttft_misses[0], "candidate": self.ttft_misses[1]}},
                "capacity_change": self.capacity_change,
                "ttft_p50_ms": None if self.ttft_p50_ms is None else {"baseline": self.ttft_p50_ms[0],
                                                                      "candidate": self.ttft_p50_ms[1]},
                "open_above": list(self.open_above), "open_below": list(self.open_below)}


def kind_of(base: Side, row: Side) -> str:
    if base.engine != row.engine:
        return "engine"
    if base.layout != row.layout:
        return "disaggregation"
    if (base.token_budget, base.chunked) != (row.token_budget, row.chunked):
        return "step_budget"
    return "deployment"


def timing_of(base: Side, row: Side) -> str:
    """measured only when both are; simulated when both are; modelled otherwise."""
    if base.timing == row.timing and base.timing in WHERE:
        return base.timing
    return "modelled"


def _who(kind: str, base: Side, row: Side) -> str:
    if kind == "disaggregation":
        return "disaggregation" if row.layout == "disagg" else "the unified layout"
    if kind == "step_budget" and base.token_budget and row.token_budget:
        size = "smaller" if row.token_budget < base.token_budget else "larger"
        chunk = ", chunked" if row.chunked and not base.chunked else ""
        return f"the {size} step budget ({row.token_budget} against {base.token_budget} tokens{chunk})"
    return row.label


def ratio_of(base: Side, row: Side) -> tuple[Optional[float], Optional[str]]:
    """Goodput of `row` over `base`'s, and its bound type (exact, lower, upper, unknown); (None, None) without one."""
    if not base.goodput.mean or row.goodput.mean is None:
        return None, None
    lower = (row.bound == "lower", base.bound == "lower")
    bound = {(False, False): "exact", (True, False): "lower", (False, True): "upper", (True, True): "unknown"}[lower]
    return row.goodput.mean / base.goodput.mean, bound


def _capacity(base: Side, row: Side) -> Optional[float]:
    a, b = base.throughput, row.throughput
    if a is None or b is None or not a.mean or b.mean is None:
        return None
    return (b.mean - a.mean) / a.mean


def _ttft(base: Side, row: Side) -> Optional[tuple[float, float]]:
    a, b = base.ttft_p50, row.ttft_p50
    if a is None or b is None or not a.mean or not b.mean:
        return None
    if separated(a, b) or max(a.mean, b.mean) / min(a.mean, b.mean) >= TTFT_NOTABLE:
        return a.mean, b.mean
    return None


def _text(s: Side) -> str:
    if s.bound == "below":
        return "0 (below the lowest rate tried)"
    return ("≥ " if s.bound == "lower" else "") + format_estimate(s.goodput)


def _zero(s: Side) -> bool:
    return s.goodput.mean == 0


def _outcome(base: Side, row: Side, kind: str) -> tuple[str, Optional[str], bool]:
    for s in (row, base):
        if not s.ran:
            return "no_verdict", f"{s.label} did not run", False
        if s.partial:
            return "no_verdict", f"the run of {s.label} was cut short (partial)", False
        if s.goodput.mean is None:
            return "no_verdict", f"{s.label} has no goodput (no finite rate measured)", False
    if _zero(base) and _zero(row):
        return "neither_serves", None, False
    if _zero(base):
        return "baseline_fails", None, False
    if _zero(row):
        return "candidate_fails", None, False
    sep = separated(row.goodput, base.goodput)
    if sep:
        return ("better" if row.goodput.mean > base.goodput.mean else "worse"), None, True
    if (kind == "disaggregation" and base.layout == "unified" and base.itl_misses == 0
            and base.prefill_interruptions == 0):
        return "unified_enough", None, False
    return "not_distinguishable", None, False


def judge(base: Side, row: Side) -> Verdict:
    """The verdict on `row` against `base`; see the module docstring for the rules."""
    kind = kind_of(base, row)
    outcome, reason, sep = _outcome(base, row, kind)
    ratio, bound = ratio_of(base, row) if outcome != "no_verdict" else (None, None)
    return Verdict(
        baseline=base.label, candidate=row.label, kind=kind, timing=timing_of(base, row), outcome=outcome,
        cross_engine=kind == "engine", engines=(base.engine, row.engine), reason=reason,
        goodput=(base.goodput.mean, row.goodput.mean), goodput_text=(_text(base), _text(row)),
        ratio=ratio, ratio_bound=bound, separated=sep, repeats=min(base.goodput.n, row.goodput.n),
        limits=(base.limit, row.limit), itl_misses=(base.itl_misses, row.itl_misses),
        ttft_misses=(base.ttft_misses, row.ttft_misses), capacity_change=_capacity(base, row),
        ttft_p50_ms=_ttft(base, row), open_above=tuple(s.label for s in (row, base) if s.bound == "lower"
                                                         and s.open_above),
        open_below=tuple(s.label for s in (row, base) if s.open_below), who=_who(kind, base, row))
