"""A figure over repeats as the report shows it: the mean, its 95% interval clamped at the quantity's physical
bound, and what that interval is worth.

A Student-t interval from two repeats is mean ± 12.7 s / √2: with noisy latencies it easily reaches below zero
(`TTFT p99 578 ± 1525`). Such an interval is not wrong, but it says little, and a negative latency is
impossible. So every figure carries its marks, the same in tables, JSON (`flags`) and plots:

- † the interval comes from fewer than 3 repeats;
- ‡ the interval is wider than the value itself (noise at this many repeats);
- an interval that reached past the bound is shown as its clamped range, `578 (0–2103)`, not as `±`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdlab.measure.confidence import Estimate, estimate

FEW, WIDE = "few_repeats", "wider_than_value"
MARKS = {FEW: "†", WIDE: "‡"}
LEGEND = {FEW: "† interval from fewer than 3 repeats: it means little",
          WIDE: "‡ interval wider than the value: noise at this many repeats"}
MIN_REPEATS = 3


@dataclass(frozen=True)
class Stat:
    """Mean, interval (clamped at [floor, ceiling]) and the unclamped half-width the marks are judged by."""

    mean: Optional[float]
    lo: Optional[float]
    hi: Optional[float]
    n: int
    values: tuple[float, ...]
    half: Optional[float] = None  # the Student-t half-width before clamping
    clamped: bool = False

    @classmethod
    def of(cls, d: Optional[dict], ceiling: Optional[float] = None) -> "Stat":
        """A summary.json estimate dict ({mean, lo, hi, n, values}) of a quantity >= 0 (and <= `ceiling`)."""
        if not d or d["mean"] is None:
            return cls(None, None, None, 0, ())
        return cls.from_values(d["values"], ceiling)

    @classmethod
    def from_values(cls, values: Any, ceiling: Optional[float] = None) -> "Stat":
        e = estimate(values)
        if e.mean is None or e.lo is None:
            return cls(e.mean, None, None, e.n, e.values)
        lo, hi = max(0.0, e.lo), e.hi if ceiling is None else min(ceiling, e.hi)
        return cls(e.mean, lo, hi, e.n, e.values, e.half_width, (lo, hi) != (e.lo, e.hi))

    @property
    def flags(self) -> tuple[str, ...]:
        if self.half is None or self.mean is None:
            return ()
        out = [FEW] if self.n < MIN_REPEATS else []
        return (*out, WIDE) if 2 * self.half > abs(self.mean) else tuple(out)

    @property
    def marks(self) -> str:
        return "".join(MARKS[f] for f in self.flags)

    def estimate(self) -> Estimate:
        """As pdlab.measure.confidence reads it (clamped: what separates is what is possible)."""
        return Estimate(self.mean, self.lo, self.hi, self.n, self.values)

    def cell(self, fmt: str = "{:.2f}") -> str:
        """'1.40 ± 0.12', '578 (0–2103)†‡' (clamped), '4.00' (one value), '—' (none)."""
        if self.mean is None:
            return "—"
        if self.half is None:
            return fmt.format(self.mean)
        if self.clamped:
            return f"{fmt.format(self.mean)} ({fmt.format(self.lo)}–{fmt.format(self.hi)}){self.marks}"
        return f"{fmt.format(self.mean)} ± {fmt.format(self.half)}{self.marks}"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "values": list(self.values),
                "clamped": self.clamped, "flags": list(self.flags)}


def legend(stats: Any) -> list[str]:
    """The legend lines for the marks that `stats` (Stat objects) carry, in a fixed order."""
    seen = {f for s in stats for f in s.flags}
    return [LEGEND[f] for f in (FEW, WIDE) if f in seen]
