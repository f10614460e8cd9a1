"""Fitting the step model and the transfer model (numpy only).

The step model (pdlab.recipe.StepTiming) is linear with non-negative terms:

    ms = fixed_ms + prefill_token_ms * prefill tokens + prefill_attention_ms * pairs / 1000
         + decode_seq_ms * decode sequences + context_token_ms * context tokens

It is fitted by non-negative least squares (Lawson-Hanson active set, `nnls`) on *relative* residuals: each
step's row is divided by its measured time, so a 3 ms decode step counts as much as a 300 ms prefill and the
fit minimises percentage error, the error that matters for ITL and TTFT alike. Errors are reported as
percentages of the measured time on held-out steps, overall and per kind (prefill-only, decode-only, mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

TERMS = ("fixed_ms", "prefill_token_ms", "prefill_attention_ms", "decode_seq_ms", "context_token_ms")
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
    """One measured engine step: what it computed (pdlab.engine.timed.step_counts) and how long it took."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    prefill_pairs: int
    ms: float
    case: int = 0  # the designed case it came from (train/test split by case)

    @property
    def kind(self) -> str:
        if self.decode_seqs == 0:
            return "prefill"
        return "decode" if self.prefill_tokens == 0 else "mixed"


def features(samples: Iterable[StepSample]) -> np.ndarray:
    """Rows [1, prefill tokens, pairs / 1000, decode sequences, context tokens]: the StepTiming terms."""
    return np.array([[1.0, s.prefill_tokens, s.prefill_pairs / 1000.0, s.decode_seqs, s.context_tokens]
                     for s in samples], dtype=float).reshape(-1, len(TERMS))


def fit_steps(samples: Sequence[StepSample]) -> dict[str, float]:
    """The StepTiming terms (ms) fitted to `samples` by NNLS on relative residuals."""
    if not samples:
        raise ValueError("no steps to fit")
    x = features(samples)
    y = np.array([s.ms for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nnls(x * w[:, None], np.ones_like(y))  # (x c - y) / y = x/y c - 1
    return {k: float(v) for k, v in zip(TERMS, coef)}


def predict(coef: dict[str, float], samples: Sequence[StepSample]) -> np.ndarray:
    return features(samples) @ np.array([coef[k] for k in TERMS])


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
