"""Fitting the step model and the transfer model (numpy only).

The step model (pdlab.recipe.StepTiming) is linear with non-negative terms in what a step computes
(pdlab.engine.timed.StepCounts):

    ms = fixed_ms + prefill_token_ms * prefill tokens + prefill_attention_ms * pairs / 1000
         + decode_seq_ms * decode sequences + context_token_ms * context tokens
         + chunk_ms * prefill chunks + fresh_pair_ms * fresh pairs / 1000
         + resumed_pair_ms * resumed pairs / 1000 + resumed_context_ms * resumed context
         + knee_token_ms * min(tokens, knee_tokens)

The last five are kernel regimes and chunk boundaries the first five cannot tell apart (issue 25). A step's
first `knee_tokens` tokens (prefill tokens and decode sequences: the rows of its matrix products) cost
`knee_token_ms` more each: small batches use the weights less well than large ones (on an AVX2 EPYC a
decode step's cost per sequence halved from 1 to 64 sequences); the knee is chosen from a few candidates by
the training fit. A chunk
that starts a prompt runs causal attention over itself (pdlab's prefill kernel or SDPA: fresh pairs), one
that resumes a prompt gathers its context from the pool and runs masked SDPA over the whole rectangle
(tokens x context: resumed pairs, resumed context), and each chunk has a cost of its own (its segment, its
sampled row). prefill_attention_ms prices every causal pair alike, as a fused GPU kernel does; the fresh
and resumed terms price the two CPU paths apart (on an AVX2 EPYC a fresh pair cost 0.22 us, a resumed one
about 0.15, one core).

It is fitted by non-negative least squares (Lawson-Hanson active set, `nnls`) on *relative* residuals: each
step's row is divided by its measured time, so a 3 ms decode step counts as much as a 300 ms prefill and the
fit minimises percentage error, the error that matters for ITL and TTFT alike. Errors are reported as
percentages of the measured time on held-out steps, overall and per kind (prefill-only, decode-only, mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from pdlab.engine.timed import StepCounts

TERMS = ("fixed_ms", "prefill_token_ms", "prefill_attention_ms", "decode_seq_ms", "context_token_ms", "chunk_ms",
         "fresh_pair_ms", "resumed_pair_ms", "resumed_context_ms", "knee_token_ms")
# candidate knee_tokens (0, no knee, is tried too): the small-batch regime only; a knee among long prefill chunks
# would let the fit trade the per-token term for attention pairs on noisy steps and extrapolate badly
KNEES = (8, 16, 32, 64, 128, 256)
KINDS = ("prefill", "decode", "mixed")


def nnls(a: np.ndarray, b: np.ndarray, max_iter: Optional[int] = None) -> np.ndarray:
    """argmin ||a x - b||_2 subject to x >= 0 (Lawson & Hanson, 1974, the active-set method).

    Columns are scaled to unit norm first (the step features differ by six orders of magnitude), so the
    tolerances mean the same for every term. A column of zeros gets coefficient 0."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scale = np.where(live, norms, 1.0)
    a = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(b).max(initial=0.0)))
    max_iter = max_iter or 3 * n + 10
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        free = ~passive & live
        if not free.any() or w[free].max() <= tol:
            break
        j = int(np.argmax(np.where(free, w, -np.inf)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # step from x towards z until the first passive coefficient reaches 0; drop it (and any other at 0)
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
    return x / scale


@dataclass(frozen=True)
class StepSample:
    """One engine step: what it computed and how long it took (ms), measured (pdlab.timing.measure) or read
    from a run's steps.jsonl (pdlab.timing.check)."""

    counts: StepCounts
    ms: float
    case: int = 0  # the designed case it came from (train/test split by case)
    cpu_ms: Optional[float] = None  # the process's CPU time over the step (measured on a CPU): ms less this is
    #                                 time the core spent on other processes

    @property
    def kind(self) -> str:
        return self.counts.kind


def features(samples: Iterable[StepSample], knee: int = 0) -> np.ndarray:
    """One row per step, one column per StepTiming term (TERMS), in the term's unit; `knee`: knee_tokens."""
    return np.array([[1.0, c.prefill_tokens, c.prefill_pairs / 1000.0, c.decode_seqs, c.context_tokens, c.chunks,
                      c.fresh_pairs / 1000.0, c.resumed_pairs / 1000.0, c.resumed_context,
                      min(c.prefill_tokens + c.decode_seqs, knee)]
                     for c in (s.counts for s in samples)],
                    dtype=float).reshape(-1, len(TERMS))


def fit_steps(samples: Sequence[StepSample], knees: Sequence[int] = KNEES) -> dict[str, float]:
    """The StepTiming terms (ms) fitted to `samples` by NNLS on relative residuals, and `knee_tokens`: of no
    knee and each of `knees` below the largest step, the one whose fit leaves the least residual."""
    if not samples:
        raise ValueError("no steps to fit")
    y = np.array([s.ms for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    most = max(s.counts.prefill_tokens + s.counts.decode_seqs for s in samples)
    best: Optional[tuple[float, int, np.ndarray]] = None
    for knee in [0] + [k for k in knees if k < most]:
        x = features(samples, knee) * w[:, None]
        coef = nnls(x, np.ones_like(y))  # (x c - y) / y = x/y c - 1
        rss = float(((x @ coef - 1.0) ** 2).sum())
        if best is None or rss < best[0] * (1 - 1e-9):
            best = (rss, knee, coef)
    assert best is not None
    _, knee, coef = best
    out: dict = {k: float(v) for k, v in zip(TERMS, coef)}
    out["knee_tokens"] = knee if out["knee_token_ms"] > 0 else 0
    return out


def predict(coef: dict[str, float], samples: Sequence[StepSample]) -> np.ndarray:
    """Predicted ms of each step; a term `coef` lacks counts as 0 (a profile written before it existed)."""
    return features(samples, int(coef.get("knee_tokens", 0))) @ np.array([coef.get(k, 0.0) for k in TERMS])


def errors(coef: dict[str, float], samples: Sequence[StepSample]) -> dict:
    """Percentage errors |predicted - measured| / measured: mean (MAPE), p90, max; and R^2 of the times."""
    if not samples:
        return {"steps": 0}
    y = np.array([s.ms for s in samples], dtype=float)
    p = predict(coef, samples)
    pct = 100.0 * np.abs(p - y) / np.maximum(y, 1e-9)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    out = {"steps": len(samples), "mape_pct": float(pct.mean()), "p90_pct": float(np.percentile(pct, 90)),
           "max_pct": float(pct.max())}
    out["r2"] = float(1.0 - ((p - y) ** 2).sum() / ss_tot) if ss_tot > 0 and len(samples) > 1 else None
    return out


def by_kind(coef: dict[str, float], samples: Sequence[StepSample]) -> dict[str, dict]:
    return {k: errors(coef, [s for s in samples if s.kind == k]) for k in KINDS}


def split_by_case(samples: Sequence[StepSample], case_kinds: dict[int, str], test_fraction: float,
                  rng: np.random.Generator) -> tuple[list[StepSample], list[StepSample]]:
    """Held-out steps are whole designed cases (neighbouring steps of one case are alike), a fraction of the
    cases of each kind, at least one of each kind that has two or more."""
    test_cases: set[int] = set()
    for kind in sorted(set(case_kinds.values())):
        cases = sorted(c for c, k in case_kinds.items() if k == kind)
        if len(cases) < 2:
            continue
        n = min(len(cases) - 1, max(1, round(test_fraction * len(cases))))
        test_cases.update(int(c) for c in rng.choice(cases, size=n, replace=False))
    train = [s for s in samples if s.case not in test_cases]
    test = [s for s in samples if s.case in test_cases]
    return train, test


def fit_transfer(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(GB/s, latency ms) of t = latency + bytes / bandwidth, by NNLS on relative residuals; needs two or
    more sizes. A bandwidth term of 0 (time not growing with size) gives infinite GB/s: reported as such."""
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("a transfer fit needs two or more sizes")
    b = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(t, 1e-12)
    lat, per_byte = nnls(np.stack([np.ones_like(b), b], axis=1) * w[:, None], np.ones_like(t))
    gbps = 1.0 / per_byte / 1e9 if per_byte > 0 else float("inf")
    return gbps, lat * 1000.0
