"""`pdlab profile`'s measure of what a prefill leaves to the decode steps after it, on the same engine.

A unified worker interleaves prefills with its decodes. The prefill's work (its activations, every layer's
weights at prefill shapes) evicts the decode batch's weights and KV from the caches, so the decode steps
right after it run slower than settled ones: on the 2-core Xeon x1.33-1.61 right after, x1.19-1.39 the next,
falling by about x0.7 of the excess a step (BENCHMARKS.md, issue 25). The profile's decode cases record
settled steps (measure.DECODE_LEAD), so the step model leaves that out; the contention block carries it
(`after_prefill_x`, `after_prefill_decay`; pdlab.timing.contention.after_prefill_fit).

Each case: a fresh engine with a decode batch (as measure.run_case sets one up), stepped until settled, then
SETTLED steps timed; a prompt added and prefilled (its steps hold the decodes too, as a unified worker's do);
then contention.AFTER_STEPS decode steps timed. Each timed step over the median of its case's settled ones,
by the decode steps since the prefill: the same batch before and after, so no step model is needed.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from pdlab.timing.contention import AFTER_STEPS
from pdlab.timing.measure import DECODE_LEAD, Case, Limits, PoolSlices, Primer, case_engine

CASES = ((2, 300, 256), (4, 300, 512), (8, 600, 256), (4, 1000, 1024))  # (decode batch, context, prompt)
REPEATS = 2
SETTLED = 8  # settled decode steps timed before the prefill


def cases(lim: Limits) -> list[tuple[Case, int]]:
    """Each measurement's decode case and prompt length, within `lim` (contexts and prompts clipped to the
    model's, as measure.warmup_cases clips its own). The prompt is prefilled in one step beside the decodes
    (the budget holds all of them), in blocks the pool has room for (case_engine's: twice the decoders')."""
    out = []
    for batch, context, prompt in CASES:
        context, prompt = min(context, lim.max_context), min(prompt, lim.max_context)
        steps = SETTLED + AFTER_STEPS + 8  # the decoders hold KV for DECODE_LEAD more too (Case.blocks)
        out.append((Case("decode", prompt + batch, False, (), (context,) * batch, steps), prompt))
    return out


def measure_after_prefill(model: Any, lim: Limits, rng: np.random.Generator, pool: Optional[PoolSlices] = None,
                          primer: Optional[Primer] = None, repeats: int = REPEATS) -> dict:
    """{"by_k": [[ratio, ...] for k in 0..AFTER_STEPS-1], "settled": [ratio, ...]}: decode steps after a
    prefill (by k) and settled ones, each over its case's settled median."""
    import torch

    from pdlab.engine import SamplingParams

    by_k: list[list[float]] = [[] for _ in range(AFTER_STEPS)]
    settled: list[float] = []
    vocab = model.config.vocab_size
    for _ in range(repeats):
        for case, prompt in cases(lim):
            eng = case_engine(model, case, rng, pool=pool, room=1)
            sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)

            def timed() -> float:
                sync()
                t = time.perf_counter()
                eng.step()
                sync()
                return time.perf_counter() - t

            if primer is not None:
                primer()
            for _ in range(DECODE_LEAD):
                eng.step()
            base = [timed() for _ in range(SETTLED)]
            eng.add("p", rng.integers(3, vocab, size=prompt).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
            while "p" in eng.seqs:  # its prefill (beside the decodes), then it ends: max_tokens 1
                eng.step()
            after = [timed() for _ in range(AFTER_STEPS)]
            mid = float(np.median(base))
            settled += [b / mid for b in base]
            for k, a in enumerate(after):
                by_k[k].append(a / mid)
            for rid in list(eng.seqs):
                eng.abort(rid)
    return {"by_k": by_k, "settled": settled}
