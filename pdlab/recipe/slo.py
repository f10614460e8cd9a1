"""The recipe's `slo` section: the per-request targets every variant is judged by.

Targets are absolute (`ttft_ms: 2000`) or relative to the machine (`ttft: 5x`): a multiple of what one
request takes alone on one unified worker, measured at the start of the run (its TTFT, and the median
gap between its tokens). A relative SLO means the same on a fast box and a slow one; the absolute
targets it resolved to are recorded with the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import STATS
from pdlab.fields import RecipeError, Section, as_mapping, one_of, optional, spec, to_float

DEFAULT_TTFT_MS, DEFAULT_ITL_MS = 1000.0, 50.0


def _multiple(v: Any) -> float:
    """'5x' -> 5.0 (a number > 0 followed by x)."""
    if not isinstance(v, str) or not v.strip().lower().endswith("x"):
        raise ValueError
    return to_float(0.0)(float(v.strip()[:-1]))


@dataclass(frozen=True)
class SLO(Section):
    ttft_ms: Optional[float] = spec(None, "a number > 0 (milliseconds)", optional(to_float(0.0)))
    itl_ms: Optional[float] = spec(None, "a number > 0 (milliseconds)", optional(to_float(0.0)))
    ttft: Optional[float] = spec(None, "a multiple such as 5x (of one request's TTFT alone on one unified "
                                       "worker)", optional(_multiple))
    itl: Optional[float] = spec(None, "a multiple such as 5x (of one request's median ITL alone on one "
                                      "unified worker)", optional(_multiple))
    # the statistic of one request's ITL gaps compared with the ITL target (mean = TPOT)
    itl_stat: str = spec("p99", f"one of {', '.join(STATS)}", one_of(STATS))
    attainment: float = spec(0.9, "a fraction in (0, 1]", to_float(0.0, 1.0))

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "SLO":
        raw = dict(as_mapping(raw, where, cls.keys()))
        for k in ("ttft", "itl"):
            if raw.get(k) is not None and raw.get(f"{k}_ms") is not None:
                raise RecipeError(f"{where}.{k}: give {k}_ms (absolute) or {k} (relative, e.g. 5x), not both")
        slo = super().from_raw(raw, where)
        if slo.ttft is None and slo.ttft_ms is None:
            slo = slo.replace(ttft_ms=DEFAULT_TTFT_MS)
        if slo.itl is None and slo.itl_ms is None:
            slo = slo.replace(itl_ms=DEFAULT_ITL_MS)
        return slo

    def to_raw(self) -> dict:
        raw = super().to_raw()
        for k in ("ttft", "itl"):  # written as a recipe says it, so recipe.yaml loads back
            if raw[k] is not None:
                raw[k] = f"{raw[k]:g}x"
        return raw

    @property
    def relative(self) -> bool:
        """Some target is a multiple of a measurement still to be made."""
        return self.ttft is not None or self.itl is not None

    def resolved(self, alone_ttft_ms: float, alone_itl_ms: float) -> "SLO":
        """The absolute SLO a relative one means, given what one request took alone (milliseconds)."""
        return self.replace(ttft_ms=self.ttft * alone_ttft_ms if self.ttft is not None else self.ttft_ms,
                            itl_ms=self.itl * alone_itl_ms if self.itl is not None else self.itl_ms,
                            ttft=None, itl=None)

    def scaled(self, factor: float) -> "SLO":
        """Both targets times `factor` (DistServe's SLO scale); needs absolute targets."""
        return self.replace(ttft_ms=self.ttft_ms * factor, itl_ms=self.itl_ms * factor)

    def describe(self) -> str:
        rel = lambda x: f" ({x:g}x alone)" if x is not None else ""  # noqa: E731
        ttft = f"{self.ttft_ms:g} ms" if self.ttft_ms is not None else f"{self.ttft:g}x alone"
        itl = f"{self.itl_ms:g} ms" if self.itl_ms is not None else f"{self.itl:g}x alone"
        return (f"TTFT ≤ {ttft}{rel(self.ttft) if self.ttft_ms is not None else ''}, per-request ITL "
                f"{self.itl_stat} ≤ {itl}{rel(self.itl) if self.itl_ms is not None else ''}, "
                f"attainment ≥ {self.attainment * 100:g}%")
