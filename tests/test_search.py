"""Goodput over rates (goodput_of) and the rate search that finds it (RateSearch), as specifications."""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest

from pdlab.measure.search import Goodput, RateSearch, goodput_of, round_rate

INF = float("inf")


# ---- goodput_of ---------------------------------------------------------------------------------------------

# (name, points, target, floor, expected fields). Goodput values are checked to float rounding.
CASES = [
    ("monotonic crossing, interpolated: 2 + (0.95 - 0.9) / (0.95 - 0.85) * (4 - 2) = 3",
     [(8.0, 0.4), (1.0, 1.0), (4.0, 0.85), (2.0, 0.95)], 0.9, None,
     dict(goodput=3.0, last_pass=2.0, first_fail=4.0, open_above=False, open_below=False, monotonic=True)),
    ("every rate passes: the highest rate, a lower bound",
     [(1.0, 1.0), (2.0, 0.97), (4.0, 0.91)], 0.9, None,
     dict(goodput=4.0, last_pass=4.0, first_fail=None, open_above=True, open_below=False, monotonic=True)),
    ("the lowest rate fails, no floor: 0, open below",
     [(1.0, 0.5), (2.0, 0.2)], 0.9, None,
     dict(goodput=0.0, last_pass=None, first_fail=1.0, open_above=False, open_below=True, monotonic=True)),
    ("the lowest rate fails above the floor: still open below",
     [(1.0, 0.5), (2.0, 0.2)], 0.9, 0.5,
     dict(goodput=0.0, last_pass=None, first_fail=1.0, open_above=False, open_below=True, monotonic=True)),
    ("the lowest rate fails at the floor: 0, closed (the SLO is out of reach at negligible load)",
     [(0.25, 0.5), (2.0, 0.2)], 0.9, 0.25,
     dict(goodput=0.0, last_pass=None, first_fail=0.25, open_above=False, open_below=False, monotonic=True)),
    ("the lowest rate fails below the floor: closed",
     [(0.2, 0.5)], 0.9, 0.25,
     dict(goodput=0.0, last_pass=None, first_fail=0.2, open_above=False, open_below=False, monotonic=True)),
    ("a pass above the first fail does not raise goodput: 2 + 0.05 / 0.15 * 2",
     [(1.0, 1.0), (2.0, 0.95), (4.0, 0.8), (6.0, 0.92), (8.0, 0.3)], 0.9, None,
     dict(goodput=2.0 + 0.05 / 0.15 * 2.0, last_pass=2.0, first_fail=4.0, open_above=False, open_below=False,
          monotonic=False)),
    ("the lowest rate fails and a higher one passes: still 0, flagged",
     [(1.0, 0.5), (2.0, 0.95)], 0.9, None,
     dict(goodput=0.0, last_pass=None, first_fail=1.0, open_above=False, open_below=True, monotonic=False)),
    ("a non-increasing attainment among passes is not a monotonicity problem",
     [(1.0, 0.92), (2.0, 0.97), (4.0, 0.5)], 0.9, None,
     dict(goodput=2.0 + 0.07 / 0.47 * 2.0, last_pass=2.0, first_fail=4.0, open_above=False, open_below=False,
          monotonic=True)),
    ("inf is the saturation point, not a rate: ignored",
     [(2.0, 0.95), (INF, 0.1), (4.0, 0.85)], 0.9, None,
     dict(goodput=3.0, last_pass=2.0, first_fail=4.0, open_above=False, open_below=False, monotonic=True)),
    ("inf failing does not close an all-pass grid",
     [(2.0, 0.95), (INF, 0.1)], 0.9, None,
     dict(goodput=2.0, last_pass=2.0, first_fail=None, open_above=True, open_below=False, monotonic=True)),
    ("attainment equal to the target passes: goodput is that rate exactly",
     [(2.0, 1.0), (4.0, 0.9), (8.0, 0.5)], 0.9, None,
     dict(goodput=4.0, last_pass=4.0, first_fail=8.0, open_above=False, open_below=False, monotonic=True)),
    ("attainment equal to the target everywhere: all pass",
     [(2.0, 0.9), (4.0, 0.9)], 0.9, None,
     dict(goodput=4.0, last_pass=4.0, first_fail=None, open_above=True, open_below=False, monotonic=True)),
    ("a target of 1: only perfect attainment passes",
     [(1.0, 1.0), (2.0, 0.99)], 1.0, None,
     dict(goodput=1.0 + 0.0 / 0.01 * 1.0, last_pass=1.0, first_fail=2.0, open_above=False, open_below=False,
          monotonic=True)),
]


@pytest.mark.parametrize("name, points, target, floor, want", CASES, ids=[c[0] for c in CASES])
def test_goodput_of(name, points, target, floor, want):
    g = goodput_of(points, target, floor)
    got = {k: getattr(g, k) for k in want}
    assert got == {**want, "goodput": pytest.approx(want["goodput"], rel=1e-12, abs=1e-12)}
    assert g.target == target
    assert g.trials == tuple(sorted((r, a) for r, a in points if not math.isinf(r)))
    assert g.closed == (not want["open_above"] and not want["open_below"])


def test_goodput_of_monotonic_crossing_is_exactly_three():
    # Exactly representable attainments, so the interpolation is exact: 2 + 0.25 / 0.5 * 2 = 3.
    g = goodput_of([(2.0, 1.0), (4.0, 0.5)], 0.75)
    assert g.goodput == 3.0


@pytest.mark.parametrize("points", [[], [(INF, 0.3)]])
def test_goodput_of_nothing_finite_is_none(points):
    g = goodput_of(points, 0.9)
    assert g == Goodput(goodput=None, target=0.9, last_pass=None, first_fail=None, open_above=False,
                        open_below=False, monotonic=True, trials=())


def test_goodput_dict_round_trip_is_plain_json():
    g = goodput_of([(1.0, 1.0), (2.0, 0.95), (4.0, 0.8), (6.0, 0.92)], 0.9)
    d = json.loads(json.dumps(g.to_dict()))
    assert d["trials"] == [{"rate": 1.0, "attainment": 1.0}, {"rate": 2.0, "attainment": 0.95},
                           {"rate": 4.0, "attainment": 0.8}, {"rate": 6.0, "attainment": 0.92}]
    assert (d["last_pass"], d["first_fail"], d["monotonic"], d["closed"]) == (2.0, 4.0, False, True)
    assert Goodput.from_dict(d) == g
    empty = goodput_of([], 0.9)
    assert Goodput.from_dict(json.loads(json.dumps(empty.to_dict()))) == empty


# ---- RateSearch -------------------------------------------------------------------------------------------

Curve = Callable[[float], float]


def clip(x: float) -> float:
    return min(1.0, max(0.0, x))


def drive(search: RateSearch, att: Curve) -> list[float]:
    """Step the search the way the harness does; returns the rates in the order proposed."""
    proposed = []
    while (rate := search.next_rate()) is not None:
        proposed.append(rate)
        search.record(rate, att(rate))
        assert len(proposed) <= search.max_trials
    return proposed


def eighths(r: float) -> float:
    """Attainment 1 up to rate 2, then down 1/8 per request/s: crosses 0.9 at r = 2.8. At the rates the
    search visits (4, 2, 3, 2.5, 2.75) every value is exact in binary, so no verdict hangs on rounding."""
    return clip(1.0 - (r - 2.0) / 8.0)


def test_search_sequence_for_one_curve():
    s = RateSearch(target=0.9, saturation_rps=8.0)
    # 4 = 0.5 * 8 fails (0.75); halve to 2: passes (1.0); bisect 3 fails (0.875) -> bracket [2, 3];
    # 2.5 passes (0.9375) -> (3 - 2.5) / 3 = 0.167 > 0.15; 2.75 passes (0.90625) -> 0.083 <= 0.15: stop.
    assert drive(s, eighths) == [4.0, 2.0, 3.0, 2.5, 2.75]
    g = s.result()
    assert (g.last_pass, g.first_fail, g.closed, g.monotonic) == (2.75, 3.0, True, True)
    # 2.75 + (0.90625 - 0.9) / (0.90625 - 0.875) * 0.25 = 2.8, the true crossing
    assert g.goodput == pytest.approx(2.8, rel=1e-12)
    assert s.trials == [(4.0, 0.75), (2.0, 1.0), (3.0, 0.875), (2.5, 0.9375), (2.75, 0.90625)]


def test_search_climbs_to_saturation_then_bisects():
    # 1 up to rate 6, then down 1/8 per request/s (crosses 0.9 at 6.8): 4 passes, 8 (= saturation) fails
    # (0.75), 6 passes (1.0), 7 fails (0.875); the bracket [6, 7] is 14% wide: stop.
    s = RateSearch(target=0.9, saturation_rps=8.0)
    assert drive(s, lambda r: clip(1.0 - (r - 6.0) / 8.0)) == [4.0, 8.0, 6.0, 7.0]
    g = s.result()
    assert (g.last_pass, g.first_fail) == (6.0, 7.0)
    assert g.goodput == pytest.approx(6.8, rel=1e-12)


def test_first_step_up_goes_to_saturation_even_from_a_low_start():
    s = RateSearch(target=0.9, saturation_rps=8.0, start_fraction=0.125)
    assert drive(s, lambda r: 1.0) == [1.0, 8.0]


# (saturation_rps, rate at which attainment crosses 0.9)
CURVES = [(8.0, 3.0), (8.0, 5.3), (8.0, 7.9), (8.0, 1.1), (10.0, 0.77), (3.3, 2.9), (100.0, 61.0)]


@pytest.mark.parametrize("sat, crossing", CURVES)
def test_search_brackets_the_true_crossing(sat, crossing):
    def att(r: float) -> float:
        return clip(0.9 - 0.3 * (r - crossing) / crossing)  # 0.9 exactly at the crossing, falling with rate

    s = RateSearch(target=0.9, saturation_rps=sat, max_trials=12)
    rates = drive(s, att)
    g = s.result()
    assert len(rates) == len(set(rates))
    assert g.closed and g.monotonic
    assert g.last_pass <= crossing < g.first_fail
    assert (g.first_fail - g.last_pass) / g.first_fail <= 0.15
    assert g.last_pass <= g.goodput <= g.first_fail
    assert g.goodput == pytest.approx(crossing, rel=1e-9)  # the curve is linear: interpolation is exact


@pytest.mark.parametrize("max_trials", [1, 2, 3, 4, 5])
def test_search_stops_at_max_trials(max_trials):
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=max_trials, rel_tol=0.001)
    rates = drive(s, eighths)
    assert rates == [4.0, 2.0, 3.0, 2.5, 2.75][:max_trials]
    assert s.next_rate() is None


def test_max_trials_counts_every_recorded_rate():
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=3, rel_tol=0.01)
    s.record(5.0, 0.0)
    s.record(2.0, 1.0)
    assert s.next_rate() == 3.5
    s.record(3.5, 1.0)
    assert s.next_rate() is None


def test_a_crossing_above_saturation_is_capped_there():
    """Passing at the saturation rate ends the climb: no higher rate is sustainable, a finite run passing
    there would only say the run was short. Goodput is the saturation rate, closed, capped."""
    s = RateSearch(target=0.9, saturation_rps=8.0)
    assert drive(s, lambda r: clip(0.9 - 0.3 * (r - 11.0) / 11.0)) == [4.0, 8.0]
    g = s.result()
    assert (g.goodput, g.capped, g.closed, g.open_above) == (8.0, True, True, False)


def test_goodput_of_holds_a_grid_to_the_cap():
    g = goodput_of([(1, 1.0), (2, 1.0), (4, 0.95), (8, 0.5)], 0.9, cap=3.0)  # crossing at 4.36, above the cap
    assert (g.goodput, g.capped, g.closed) == (3.0, True, True)
    g = goodput_of([(1, 1.0), (2, 0.95), (4, 0.85)], 0.9, cap=3.5)  # crossing at 3.0, below it: untouched
    assert (g.goodput, g.capped) == (pytest.approx(3.0), False)
    g = goodput_of([(1, 1.0), (2, 1.0)], 0.9, cap=5.0)  # passing below the cap: still a lower bound
    assert (g.goodput, g.open_above, g.capped) == (2.0, True, False)


def test_an_always_failing_curve_ends_at_the_floor_with_goodput_zero_closed():
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=10)
    assert drive(s, lambda r: 0.0) == [4.0, 2.0, 1.0, 0.5, 0.25]  # floor = 8 / 32 = 0.25
    g = s.result()
    assert (g.goodput, g.first_fail, g.last_pass, g.closed, g.open_below) == (0.0, 0.25, None, True, False)


def test_descent_lands_on_the_floor_even_when_halving_would_skip_it():
    s = RateSearch(target=0.9, saturation_rps=10.0, max_trials=10, floor_fraction=0.1)
    assert drive(s, lambda r: 0.0) == [5.0, 2.5, 1.25, 1.0]
    assert s.result().closed


def test_failing_until_trials_run_out_above_the_floor_is_open_below():
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=3)
    assert drive(s, lambda r: 0.0) == [4.0, 2.0, 1.0]
    g = s.result()
    assert (g.goodput, g.open_below, g.closed) == (0.0, True, False)


def test_an_always_passing_curve_climbs_to_saturation_and_is_capped():
    s = RateSearch(target=0.9, saturation_rps=8.0)
    assert drive(s, lambda r: 1.0) == [4.0, 8.0]
    g = s.result()
    assert (g.goodput, g.open_above, g.closed, g.capped) == (8.0, False, True, True)


def test_an_always_passing_search_cut_short_by_its_budget_is_open_above():
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=1)
    assert drive(s, lambda r: 1.0) == [4.0]
    g = s.result()
    assert (g.goodput, g.open_above, g.capped) == (4.0, True, False)


def test_rates_are_rounded_to_three_significant_figures():
    s = RateSearch(target=0.9, saturation_rps=7.77777, max_trials=4)
    assert drive(s, lambda r: 1.0) == [3.89, 7.78]
    assert s.result().goodput == 7.77777  # held to the saturation throughput itself
    assert round_rate(0.0123456) == 0.0123
    assert round_rate(123456.0) == 123000.0


def test_a_pass_above_a_fail_does_not_move_the_bracket():
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=10)
    s.record(4.0, 0.95)
    s.record(8.0, 0.5)
    s.record(6.0, 0.8)
    s.record(7.0, 0.92)  # the caller measured 7 on its own: a pass above the first failure (6)
    assert s.next_rate() == 5.0  # bisects [4, 6], not [7, 8]
    g = s.result()
    assert (g.last_pass, g.first_fail, g.monotonic) == (4.0, 6.0, False)


def test_never_proposes_a_rate_already_measured():
    # [1.01, 1.02] cannot be split at 3 significant figures: the midpoint rounds onto an end, so stop.
    s = RateSearch(target=0.9, saturation_rps=8.0, rel_tol=0.001, max_trials=10)
    s.record(1.01, 1.0)
    s.record(1.02, 0.0)
    assert s.next_rate() is None


@pytest.mark.parametrize("att", [eighths, lambda r: 1.0, lambda r: 0.0, lambda r: 1.0 if r < 2.71 else 0.0])
def test_no_rate_is_proposed_twice(att):
    s = RateSearch(target=0.9, saturation_rps=8.0, max_trials=30, rel_tol=1e-6)
    rates = drive(s, att)
    assert len(rates) == len(set(rates))


def test_recording_the_same_rate_twice_is_refused():
    s = RateSearch(target=0.9, saturation_rps=8.0)
    s.record(4.0, 0.95)
    with pytest.raises(ValueError, match="already recorded"):
        s.record(4.0, 0.90)


@pytest.mark.parametrize("rate, att", [(0.0, 0.5), (-1.0, 0.5), (INF, 0.5), (1.0, 1.5), (1.0, -0.1)])
def test_record_refuses_nonsense(rate, att):
    with pytest.raises(ValueError):
        RateSearch(target=0.9, saturation_rps=8.0).record(rate, att)


@pytest.mark.parametrize("kw", [
    dict(target=0.0), dict(target=1.1), dict(target=-0.5),
    dict(saturation_rps=0.0), dict(saturation_rps=-3.0), dict(saturation_rps=INF), dict(saturation_rps=math.nan),
    dict(max_trials=0), dict(rel_tol=0.0), dict(rel_tol=1.0),
    dict(start_fraction=0.0), dict(floor_fraction=0.0), dict(floor_fraction=0.75),
])
def test_constructor_refuses_nonsense(kw):
    args = dict(target=0.9, saturation_rps=8.0) | kw
    with pytest.raises(ValueError):
        RateSearch(**args)


def test_target_of_one_is_allowed():
    assert RateSearch(target=1.0, saturation_rps=8.0).next_rate() == 4.0
