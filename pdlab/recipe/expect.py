"""The recipe's `expect` section: what the box the recipe was written for does, so a run can say when this box
is another one (pdlab.measure.box).

    expect: {alone_ttft_ms: 190, tolerance: 2}

`alone_ttft_ms`: one request alone's TTFT (the calibration at the start of a run) on the machine the rates and
SLO were chosen for. A run whose calibration is more than `tolerance` times slower or faster says so in one
line, in the run output and in summary.json (`box`, `warnings`). Without it, nothing is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdlab.fields import Section, optional, spec, to_float


@dataclass(frozen=True)
class Expect(Section):
    alone_ttft_ms: Optional[float] = spec(None, "a number > 0 (ms: one request alone's TTFT on the box the recipe "
                                                "was written for)", optional(to_float(0.0)))
    tolerance: float = spec(2.0, "a factor > 1 (say so when one request alone is this many times slower or faster)",
                            to_float(1.0))
