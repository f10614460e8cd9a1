"""The recipe's `model.timing` section: a modelled step time (a "model double").

When a model has a timing, every engine step still runs the real forward (so outputs are exactly the
model's), then waits until its modelled time has passed since the step began:

    step time = fixed_ms + prefill_token_ms * prefill tokens + decode_seq_ms * decode sequences
                + context_token_ms * context tokens attended by the decode sequences

so a run's step times are known (a test can hold measured TTFT and ITL against queueing theory), and later a
profiled timing can make a small box stand in for a big one. A step whose real compute takes longer than its
model is not shortened: it takes what it takes. Runs with a timing are *modelled* (`ModelSpec.modelled`):
their times are not the hardware's.

    model: {preset: tiny-llama, timing: {fixed_ms: 5, prefill_token_ms: 0.5, decode_seq_ms: 1}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdlab.fields import RecipeError, Section, spec, to_float

MS = "a number of milliseconds >= 0"
_non_negative = to_float(0.0, lo_open=False)


def _ms(v: Any) -> float:
    v = _non_negative(v)
    if not math.isfinite(v):
        raise ValueError
    return v


@dataclass(frozen=True)
class StepTiming(Section):
    """A step's modelled time, linear in what the step computes (all terms in milliseconds)."""

    fixed_ms: float = spec(0.0, f"{MS} (per step)", _ms)
    prefill_token_ms: float = spec(0.0, f"{MS} (per prefill token in the step)", _ms)
    decode_seq_ms: float = spec(0.0, f"{MS} (per decode sequence in the step)", _ms)
    context_token_ms: float = spec(0.0, f"{MS} (per context token attended by the step's decode sequences)", _ms)

    def check(self, where: str) -> None:
        if not any(getattr(self, k) > 0 for k in self.keys()):
            raise RecipeError(f"{where}: every term is 0; expected at least one of {', '.join(self.keys())} > 0 "
                              "(or timing: null for the real step time)")

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """The modelled time of a step, in seconds."""
        return (self.fixed_ms + self.prefill_token_ms * prefill_tokens + self.decode_seq_ms * decode_seqs
                + self.context_token_ms * context_tokens) / 1000.0
