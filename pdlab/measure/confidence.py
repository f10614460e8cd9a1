"""Repeats and 95% confidence intervals of their mean.

One run of a variant at one rate is one sample of a noisy process: scheduling, the OS and the device all
move TTFT, ITL and goodput from one repeat to the next. A difference between two variants means something
only when it is larger than that noise, so a figure measured over repeats is reported as the mean with a
two-sided 95% Student-t interval of the mean, and two figures are called different only when their
intervals do not overlap (`separated`). That test is conservative on purpose: non-overlapping 95%
intervals imply a difference at well beyond 95%, and a lab that reports "no clear difference" too often is
better than one that reports noise as a win.

scipy is not a dependency, so the t quantiles are a table (level 0.95 only). Only the standard library is
used: `statistics.stdev` is the sample standard deviation (ddof=1).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

LEVEL = 0.95

# t_{0.975, df}: the two-sided 95% quantile of Student's t, by degrees of freedom.
_T95: dict[int, float] = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}
_Z95 = 1.960


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom.

    Between tabulated rows (31..39, 41..59, 61..119) the row for the next *lower* df is used: t falls as
    df grows, so this widens the interval slightly rather than narrowing it. Above 120 the normal 1.960 is
    used (t is within 1% of it there).
    """
    if level != LEVEL:
        raise ValueError(f"only level {LEVEL} is supported (no scipy for other t quantiles), got {level}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df > 120:
        return _Z95
    return _T95[max(k for k in _T95 if k <= df)]


@dataclass(frozen=True)
class Estimate:
    """Mean of per-repeat values with its 95% interval. `n` counts the values kept (None dropped);
    `mean` is None when n == 0, `lo`/`hi` are None when n < 2 (one value has no spread to estimate)."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int
    values: tuple[float, ...]

    @property
    def half_width(self) -> float | None:
        """Half the interval; (hi - lo) / 2, so it also reads an interval that is not symmetric."""
        if self.lo is None or self.hi is None:
            return None
        return (self.hi - self.lo) / 2.0

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "values": list(self.values)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Estimate:
        return cls(mean=d["mean"], lo=d["lo"], hi=d["hi"], n=int(d["n"]),
                   values=tuple(float(v) for v in d["values"]))


def estimate(values: Iterable[float | None], level: float = LEVEL) -> Estimate:
    """Mean and two-sided Student-t interval: mean ± t_{(1+level)/2, n-1} * s / sqrt(n), s with ddof=1.

    None is a repeat that did not produce the figure (e.g. no request passed, so no goodput): it is
    dropped, not counted as zero. NaN is refused: it would silently poison the mean.
    """
    if level != LEVEL:
        raise ValueError(f"only level {LEVEL} is supported (no scipy for other t quantiles), got {level}")
    kept = tuple(float(v) for v in values if v is not None)
    if any(math.isnan(v) for v in kept):
        raise ValueError("estimate() got NaN; drop a missing figure by passing None")
    n = len(kept)
    if n == 0:
        return Estimate(mean=None, lo=None, hi=None, n=0, values=())
    mean = math.fsum(kept) / n
    if n == 1:
        return Estimate(mean=mean, lo=None, hi=None, n=1, values=kept)
    half = t_quantile(n - 1, level) * statistics.stdev(kept) / math.sqrt(n)
    return Estimate(mean=mean, lo=mean - half, hi=mean + half, n=n, values=kept)


def separated(a: Estimate, b: Estimate) -> bool:
    """True only when both intervals exist and do not overlap. Touching edges overlap; with n < 2 on
    either side there is no interval, so the answer is False (cannot tell), never True."""
    if a.lo is None or a.hi is None or b.lo is None or b.hi is None:
        return False
    return a.lo > b.hi or b.lo > a.hi


def format_estimate(e: Estimate, fmt: str = "{:.2f}") -> str:
    """"1.40 ± 0.12" (mean ± half-width), "1.40" for a single value, "—" when there is no value."""
    if e.mean is None:
        return "—"
    half = e.half_width
    if half is None:
        return fmt.format(e.mean)
    return f"{fmt.format(e.mean)} ± {fmt.format(half)}"
