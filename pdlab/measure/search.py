"""Goodput over request rates, and a search that finds it with few trials.

Goodput is the highest request rate at which SLO attainment (the fraction of requests meeting both the
TTFT and the ITL target) is at least the target. Measured attainment is noisy and not always monotonic in
rate, so the definition pins down which crossing counts: the *first* rate (ascending) that fails bounds
goodput. A pass above that failure is noise or a regime change, not capacity one can rely on: it does not
raise goodput, it flags the result `monotonic = False`. Between the last pass below the first failure and
that failure, goodput is interpolated linearly where attainment crosses the target.

The result says how far it can be trusted: `open_above` when no rate failed (goodput is a lower bound),
`open_below` when the lowest rate failed and was not low enough to say "never" (goodput 0 is then a
statement about the rates tried, not about the deployment).

Goodput never exceeds the saturation throughput (`cap`: requests completed per second with every request
sent at once). Above it the queue grows without bound; a finite run that still passes there only says
the run was short. A goodput held to the cap is `capped`: capacity, not latency, limits it.

A fixed rate grid wastes trials far from the crossing and resolves it coarsely. `RateSearch` brackets the
crossing from the saturation throughput (every request sent at once) and bisects it. Each trial is a real
load run of seconds to minutes, so the search is a plain object the harness steps (`next_rate`, then
`record`), never something that calls into the harness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable


@dataclass(frozen=True)
class Goodput:
    """Goodput of a set of (rate, attainment) trials; see the module docstring for the rules.

    `trials` are the finite points sorted by rate. `goodput` is None only when there are none.
    `last_pass`/`first_fail` bracket the crossing (None where that side is missing).
    """

    goodput: float | None
    target: float
    last_pass: float | None
    first_fail: float | None
    open_above: bool
    open_below: bool
    monotonic: bool
    trials: tuple[tuple[float, float], ...]
    capped: bool = False  # held to the saturation throughput

    @property
    def closed(self) -> bool:
        """Both sides bracketed: goodput is a value, not a bound."""
        return not self.open_above and not self.open_below

    def to_dict(self) -> dict[str, Any]:
        # `closed` is derived, written for readers without pdlab; from_dict ignores it.
        return {"goodput": self.goodput, "target": self.target, "last_pass": self.last_pass,
                "first_fail": self.first_fail, "open_above": self.open_above, "open_below": self.open_below,
                "monotonic": self.monotonic, "closed": self.closed, "capped": self.capped,
                "trials": [{"rate": r, "attainment": a} for r, a in self.trials]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Goodput:
        return cls(goodput=d["goodput"], target=float(d["target"]), last_pass=d["last_pass"],
                   first_fail=d["first_fail"], open_above=bool(d["open_above"]),
                   open_below=bool(d["open_below"]), monotonic=bool(d["monotonic"]),
                   trials=tuple((float(t["rate"]), float(t["attainment"])) for t in d["trials"]),
                   capped=bool(d.get("capped", False)))


def goodput_of(points: Iterable[tuple[float, float]], target: float, floor: float | None = None,
               cap: float | None = None) -> Goodput:
    """Goodput of (rate, attainment) points at an attainment `target`; a rate passes when attainment >= target.

    - inf (all at once) is the saturation point, not a rate: it is left out.
    - first_fail = the lowest failing rate; last_pass = the highest rate below it (all of which pass);
      goodput = r_p + (a_p - target) / (a_p - a_f) * (r_f - r_p). A pass above first_fail sets
      monotonic False and changes nothing else.
    - No rate fails: goodput = the highest rate, open_above (a lower bound).
    - The lowest rate fails: goodput 0.0. It is closed when `floor` is given and that rate is at or below
      it (the SLO cannot be met even at negligible load); otherwise open_below.
    - With `cap` (the saturation throughput), goodput is at most cap; a result held to it is `capped`, and
      passing at or above the cap closes the bracket (no higher rate is sustainable).
    """
    g = _goodput_of(points, target, floor)
    if cap is None or g.goodput is None:
        return g
    if g.open_above and g.goodput >= cap * (1 - CAP_TOL):
        return replace(g, goodput=min(g.goodput, cap), open_above=False, capped=True)
    if g.goodput > cap:
        return replace(g, goodput=cap, capped=True)
    return g


CAP_TOL = 0.01  # a trial within 1% of the saturation rate counts as reaching it (rates are rounded)


def _goodput_of(points: Iterable[tuple[float, float]], target: float, floor: float | None) -> Goodput:
    trials = tuple(sorted((float(r), float(a)) for r, a in points if not math.isinf(float(r))))
    if not trials:
        return Goodput(goodput=None, target=target, last_pass=None, first_fail=None, open_above=False,
                       open_below=False, monotonic=True, trials=())
    fail = next((i for i, (_, a) in enumerate(trials) if a < target), None)
    if fail is None:
        top = trials[-1][0]
        return Goodput(goodput=top, target=target, last_pass=top, first_fail=None, open_above=True,
                       open_below=False, monotonic=True, trials=trials)
    r_f, a_f = trials[fail]
    monotonic = all(a < target for _, a in trials[fail + 1:])
    if fail == 0:
        at_floor = floor is not None and r_f <= floor
        return Goodput(goodput=0.0, target=target, last_pass=None, first_fail=r_f, open_above=False,
                       open_below=not at_floor, monotonic=monotonic, trials=trials)
    r_p, a_p = trials[fail - 1]
    value = r_p + (a_p - target) / (a_p - a_f) * (r_f - r_p)
    return Goodput(goodput=value, target=target, last_pass=r_p, first_fail=r_f, open_above=False,
                   open_below=False, monotonic=monotonic, trials=trials)


def round_rate(rate: float) -> float:
    """`rate` to 3 significant figures, so proposed rates print cleanly and repeat exactly across runs."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be positive and finite, got {rate}")
    return float(f"{rate:.3g}")


class RateSearch:
    """The rate at which attainment crosses `target`, found by bracketing then bisection.

    Use: `while (r := s.next_rate()) is not None: s.record(r, attainment_measured_at(r))`, then `s.result()`.

    Rules (every proposal rounded to 3 significant figures; `max_trials` counts every recorded rate):
    1. First trial: start_fraction * saturation_rps.
    2. While nothing has failed: go up to saturation_rps; once that passes, stop: goodput is capped there
       (no higher rate is sustainable).
    3. While nothing has passed: halve the lowest rate, but not below the floor
       (floor_fraction * saturation_rps); once the floor has failed, stop: goodput 0, closed.
    4. Then bisect between last_pass and first_fail (as goodput_of defines them, so a pass above a fail
       does not move the bracket) until (first_fail - last_pass) / first_fail <= rel_tol.
    A rate already measured is never proposed: if rounding makes the midpoint collide with an end of the
    bracket, the bracket is as narrow as 3 significant figures allow and the search stops.
    """

    def __init__(self, target: float, saturation_rps: float, max_trials: int = 6, rel_tol: float = 0.15,
                 start_fraction: float = 0.5, floor_fraction: float = 1 / 32) -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target}")
        if not (math.isfinite(saturation_rps) and saturation_rps > 0):
            raise ValueError(f"saturation_rps must be positive and finite, got {saturation_rps}")
        if max_trials < 1:
            raise ValueError(f"max_trials must be >= 1, got {max_trials}")
        if not 0.0 < rel_tol < 1.0:
            raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
        if not (math.isfinite(start_fraction) and start_fraction > 0):
            raise ValueError(f"start_fraction must be positive and finite, got {start_fraction}")
        if not 0.0 < floor_fraction <= start_fraction:
            raise ValueError(f"floor_fraction must be in (0, start_fraction={start_fraction}], got {floor_fraction}")
        self.target = target
        self.saturation_rps = saturation_rps
        self.max_trials = max_trials
        self.rel_tol = rel_tol
        self.start = round_rate(start_fraction * saturation_rps)
        self.floor = round_rate(floor_fraction * saturation_rps)
        self._trials: list[tuple[float, float]] = []

    @property
    def trials(self) -> list[tuple[float, float]]:
        """(rate, attainment) in the order measured (a copy)."""
        return list(self._trials)

    def record(self, rate: float, attainment: float) -> None:
        """The attainment measured at `rate`. One value per rate: aggregate repeats before recording."""
        rate, attainment = float(rate), float(attainment)
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be positive and finite, got {rate}")
        if not 0.0 <= attainment <= 1.0:
            raise ValueError(f"attainment must be in [0, 1], got {attainment}")
        if any(r == rate for r, _ in self._trials):
            raise ValueError(f"rate {rate} was already recorded")
        self._trials.append((rate, attainment))

    def result(self) -> Goodput:
        return goodput_of(self._trials, self.target, self.floor, cap=self.saturation_rps)

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is done."""
        if len(self._trials) >= self.max_trials:
            return None
        if not self._trials:
            return self.start
        g = self.result()
        if g.first_fail is None:  # nothing failed yet: climb to saturation, and no further
            top = max(r for r, _ in self._trials)
            if top >= self.saturation_rps * (1 - CAP_TOL):
                return None
            proposal = self.saturation_rps
        elif g.last_pass is None:  # nothing passed below the first failure: descend toward the floor
            low = g.first_fail
            if low <= self.floor:
                return None
            proposal = max(low / 2.0, self.floor)
        else:
            lo, hi = g.last_pass, g.first_fail
            if (hi - lo) / hi <= self.rel_tol:
                return None
            # Arithmetic, not geometric, midpoint: once bracketed the ends are at most a factor of 2 apart
            # (with the default start_fraction), where the two differ by a few percent; the reported goodput
            # is a linear interpolation in rate, so its error is the bracket's absolute width, which the
            # arithmetic midpoint halves; and it keeps 3-significant-figure rates round (3, 3.5, 3.25).
            proposal = (lo + hi) / 2.0
        rate = round_rate(proposal)
        if any(r == rate for r, _ in self._trials):
            return None
        return rate
