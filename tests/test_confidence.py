"""Repeats and their 95% intervals (pdlab.measure.confidence), on values small enough to check by hand."""

from __future__ import annotations

import json
import math

import pytest

from pdlab.measure.confidence import Estimate, estimate, format_estimate, separated, t_quantile


def test_three_values_mean_and_t_interval_by_hand():
    # mean 2, s = 1 (ddof=1), df = 2 -> t = 4.303, half-width 4.303 / sqrt(3)
    e = estimate([1.0, 2.0, 3.0])
    half = 4.303 / math.sqrt(3)
    assert e.n == 3
    assert e.values == (1.0, 2.0, 3.0)
    assert e.mean == 2.0
    assert e.lo == pytest.approx(2.0 - half, rel=1e-12)
    assert e.hi == pytest.approx(2.0 + half, rel=1e-12)
    assert e.half_width == pytest.approx(2.484338, abs=1e-6)


def test_identical_values_have_a_zero_width_interval():
    e = estimate([2.0, 2.0, 2.0])
    assert (e.mean, e.lo, e.hi, e.n) == (2.0, 2.0, 2.0, 3)


def test_one_value_has_a_mean_but_no_interval():
    assert estimate([1.4]) == Estimate(mean=1.4, lo=None, hi=None, n=1, values=(1.4,))


def test_no_values_have_nothing():
    assert estimate([]) == Estimate(mean=None, lo=None, hi=None, n=0, values=())
    assert estimate([None, None]) == Estimate(mean=None, lo=None, hi=None, n=0, values=())


def test_none_is_a_repeat_without_the_figure_and_is_dropped_not_zeroed():
    # [1, 3]: mean 2, s = sqrt(2), df = 1 -> t = 12.706, half-width 12.706 * sqrt(2) / sqrt(2) = 12.706
    e = estimate([1.0, None, 3.0])
    assert e.n == 2
    assert e.values == (1.0, 3.0)
    assert e.mean == 2.0
    assert e.lo == pytest.approx(2.0 - 12.706, rel=1e-12)
    assert e.hi == pytest.approx(2.0 + 12.706, rel=1e-12)


def test_integers_are_kept_as_floats():
    assert estimate([1, 3]).values == (1.0, 3.0)


@pytest.mark.parametrize("df, t", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228),
                                   (30, 2.042), (35, 2.042), (40, 2.021), (59, 2.021), (60, 2.000),
                                   (119, 2.000), (120, 1.980), (121, 1.960), (10_000, 1.960)])
def test_t_quantiles_come_from_the_table_and_round_df_down_between_rows(df, t):
    assert t_quantile(df) == t


def test_a_large_sample_uses_the_row_below_its_df():
    # n = 36, df = 35 -> the df 30 row (2.042), never the narrower df 40 row
    values = [float(i % 2) for i in range(36)]  # 18 zeros, 18 ones: mean 0.5
    e = estimate(values)
    s = math.sqrt(sum((v - 0.5) ** 2 for v in values) / 35)
    assert e.half_width == pytest.approx(2.042 * s / 6.0, rel=1e-12)


def test_only_the_95_percent_level_is_supported():
    with pytest.raises(ValueError, match="0.95"):
        estimate([1.0, 2.0], level=0.9)
    with pytest.raises(ValueError):
        t_quantile(3, level=0.99)
    with pytest.raises(ValueError):
        t_quantile(0)


def test_nan_is_refused_rather_than_averaged():
    with pytest.raises(ValueError, match="NaN"):
        estimate([1.0, float("nan")])


def E(lo: float, hi: float, n: int = 3) -> Estimate:
    return Estimate(mean=(lo + hi) / 2, lo=lo, hi=hi, n=n, values=())


def test_separated_only_when_intervals_do_not_overlap():
    assert separated(E(1.0, 2.0), E(2.5, 3.0)) is True
    assert separated(E(2.5, 3.0), E(1.0, 2.0)) is True  # either order
    assert separated(E(1.0, 2.0), E(1.5, 3.0)) is False  # overlap
    assert separated(E(1.0, 3.0), E(1.5, 2.0)) is False  # one inside the other


def test_touching_edges_are_not_separated():
    assert separated(E(1.0, 2.0), E(2.0, 3.0)) is False


def test_without_an_interval_on_either_side_separated_cannot_say_yes():
    one = estimate([10.0])
    none = estimate([])
    wide_apart = estimate([1.0, 1.0, 1.0])
    assert separated(one, wide_apart) is False
    assert separated(wide_apart, one) is False
    assert separated(none, wide_apart) is False


def test_separated_on_real_estimates():
    low = estimate([1.0, 1.1, 0.9])  # 1.0 ± 4.303 * 0.1 / sqrt(3) = 1.0 ± 0.248
    high = estimate([2.0, 2.1, 1.9])  # 2.0 ± 0.248
    close = estimate([1.2, 1.3, 1.1])  # 1.2 ± 0.248: overlaps low
    assert separated(low, high) is True
    assert separated(low, close) is False


def test_format_mean_and_half_width():
    assert format_estimate(estimate([1.0, 2.0, 3.0])) == "2.00 ± 2.48"
    assert format_estimate(estimate([1.0, 2.0, 3.0]), "{:.1f}") == "2.0 ± 2.5"


def test_format_uses_half_the_interval_when_it_is_not_symmetric():
    assert format_estimate(Estimate(mean=1.4, lo=1.3, hi=1.7, n=4, values=())) == "1.40 ± 0.20"


def test_format_single_value_and_missing():
    assert format_estimate(estimate([1.4])) == "1.40"
    assert format_estimate(estimate([None])) == "—"


def test_dict_round_trip_is_plain_json():
    e = estimate([1.0, None, 2.0, 4.0])
    d = json.loads(json.dumps(e.to_dict()))
    assert d == {"mean": e.mean, "lo": e.lo, "hi": e.hi, "n": 3, "values": [1.0, 2.0, 4.0]}
    assert Estimate.from_dict(d) == e
    assert Estimate.from_dict(estimate([]).to_dict()) == estimate([])
