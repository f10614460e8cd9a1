"""The mixed phase's prompt lengths (--lengths-from FILE): a user's own prompt-length mix.

FILE is either plain text, one prompt length (tokens) per line, or a pdlab `requests.jsonl` (any run's
records: each line's `prompt_len`; warm-up requests included, they were traffic too). Blank lines and `#`
comments are skipped. The lengths are replayed in a seeded random order, so that a file sorted by length
does not become a ramp.
"""

from __future__ import annotations

import json
import os
import random

from pdlab.diagnose.plan import PlanError


def read_lengths(path: str, seed: int = 0) -> tuple[int, ...]:
    if not os.path.isfile(path):
        raise PlanError(f"--lengths-from {path}: no such file")
    out: list[int] = []
    with open(path) as f:
        for i, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("{") else raw.strip()
            if not line:
                continue
            out.append(_length(line, f"{path}:{i}"))
    if not out:
        raise PlanError(f"--lengths-from {path}: no prompt lengths in it")
    random.Random(seed).shuffle(out)
    return tuple(out)


def _length(line: str, where: str) -> int:
    if line.startswith("{"):
        try:
            rec = json.loads(line)
        except ValueError:
            raise PlanError(f"--lengths-from {where}: not valid JSON") from None
        value = rec.get("prompt_len")
        if value is None:
            raise PlanError(f"--lengths-from {where}: a JSON line without `prompt_len` (expected a pdlab "
                            "requests.jsonl record)")
    else:
        value = line
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise PlanError(f"--lengths-from {where}: {str(value)[:40]!r} is not a prompt length in tokens") from None
    if n < 1:
        raise PlanError(f"--lengths-from {where}: prompt length {n}: expected >= 1")
    return n
