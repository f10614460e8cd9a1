"""A run's step records as the step model's samples: what `pdlab profile --check`, the replay and the
contention estimate hold a profile against."""

from __future__ import annotations

from pdlab.engine.timed import StepCounts
from pdlab.timing.fit import StepSample

COUNTS = tuple(StepCounts.__dataclass_fields__)


class CheckError(ValueError):
    """Records a profile cannot be checked against (one line)."""


def samples(steps: list[dict]) -> list[StepSample]:
    """The run's steps that computed something and preempted nothing, as StepSamples (ms: end - start)."""
    out = []
    for s in steps:
        if s.get("preempted") or not (s.get("prefill_tokens") or s.get("decode_seqs")):
            continue
        if "context_tokens" not in s:
            raise CheckError("steps.jsonl has no step counts beyond prefill tokens and decode sequences (a run "
                             "recorded before pdlab wrote them): run it again to check a profile against it")
        out.append(StepSample(StepCounts(**{k: int(s.get(k) or 0) for k in COUNTS}), (s["end"] - s["start"]) * 1e3))
    return out
