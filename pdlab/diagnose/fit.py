"""Stall length against prompt tokens: a least-squares line through one point per isolated prefill window.

A point is a window alone in time (a probe, or in another run's records any request): no other window with at
least a quarter of its prompt tokens overlaps it (a background stream renewed meanwhile, a short prompt, does
not make a long probe's window shared; a comparable prefill beside it would): x its prompt tokens (the server's
count where it gave one), y the longest background gap that overlaps it, stall-tagged or not (a window that
stalled nothing still says so: a flat line). Its slope per 1000 tokens is what a prefill of 1000 more tokens
adds to the longest gap a running decode sees.

A server that splits long prefills (chunked prefill) stalls decodes for one chunk at a time: past the chunk
size the stall stops growing. When the points of a length fall below 0.7 of the line fitted to the shorter
lengths, the stalls *level off* there: the line is fitted to the shorter lengths only, and the median stall
from that length on is the *plateau* (about one chunk's stall). When the line grows by less than a fifth of
the median stall from the shortest length to the longest, the stalls are *flat*: they level off from the
shortest length (chunks smaller than every probe), and the plateau is the median stall of all points.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from pdlab.diagnose.streams import Stream
from pdlab.diagnose.tagging import Tagging, WindowIndex

LEVEL_RATIO = 0.7  # a length whose median stall is below this share of the line's prediction levels off
FLAT_SHARE = 0.2  # a line that grows less than this share of the median stall across the lengths is flat
MIN_POINTS = 3
ALONE_SHARE = 0.25  # a window overlapped only by windows of fewer prompt tokens than this share of its own is alone


@dataclass(frozen=True)
class Point:
    window: str
    prompt_tokens: int
    stall_ms: float
    stalled: bool  # the longest overlapping gap was tagged stall
    ttft_ms: float  # the window's length
    levelled: bool = False

    def to_dict(self) -> dict:
        return {"window": self.window, "prompt_tokens": self.prompt_tokens, "stall_ms": self.stall_ms,
                "stalled": self.stalled, "ttft_ms": self.ttft_ms, "levelled": self.levelled}


@dataclass(frozen=True)
class Line:
    slope_ms_per_token: float
    intercept_ms: float
    r2: Optional[float]  # None when every y is the same
    n: int

    @property
    def per_1k_ms(self) -> float:
        return 1000.0 * self.slope_ms_per_token

    def at(self, tokens: float) -> float:
        return self.intercept_ms + self.slope_ms_per_token * tokens

    def to_dict(self) -> dict:
        return {"stall_ms_per_1k_tokens": self.per_1k_ms, "intercept_ms": self.intercept_ms, "r2": self.r2,
                "points": self.n}


@dataclass(frozen=True)
class Fit:
    points: tuple[Point, ...]
    line: Optional[Line]  # None: fewer than MIN_POINTS points or one length only
    levels_off_from: Optional[int] = None  # prompt tokens from which stalls stop growing
    plateau_ms: Optional[float] = None
    flat: bool = False  # no growth with prompt length over the whole range

    def to_dict(self) -> dict:
        return {"line": self.line.to_dict() if self.line else None, "levels_off_from": self.levels_off_from,
                "plateau_ms": self.plateau_ms, "flat": self.flat, "points": [p.to_dict() for p in self.points],
                "by_length": by_length(self.points)}


def isolated_points(tagging: Tagging, streams: list[Stream], phase: Optional[str]) -> list[Point]:
    """A point per window of `phase` (None: any phase) that is alone (see the module's docstring)."""
    index = WindowIndex(list(tagging.windows))
    by_stream: dict[str, list] = defaultdict(list)
    for g in tagging.gaps:
        for w in g.windows:
            by_stream[w].append(g)
    out = []
    for w in tagging.windows:
        if phase is not None and w.phase != phase:
            continue
        if any(o.prompt_tokens >= ALONE_SHARE * w.prompt_tokens for o in index.overlapping(w.start, w.end, but=w.id)):
            continue
        gaps = by_stream.get(w.id)
        if not gaps:
            continue  # no background stream was decoding while it prefilled
        worst = max(gaps, key=lambda g: g.ms)
        out.append(Point(w.id, w.prompt_tokens, worst.ms, worst.tag == "stall", w.ms))
    return sorted(out, key=lambda p: (p.prompt_tokens, p.window))


def fit_line(points: list[Point]) -> Optional[Line]:
    x = np.asarray([p.prompt_tokens for p in points], dtype=float)
    y = np.asarray([p.stall_ms for p in points], dtype=float)
    if len(points) < MIN_POINTS or len(set(x.tolist())) < 2:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - (slope * x + intercept)) ** 2).sum())
    return Line(float(slope), float(intercept), 1.0 - ss_res / ss_tot if ss_tot > 0 else None, len(points))


def fit_stalls(points: list[Point]) -> Fit:
    lengths = sorted({p.prompt_tokens for p in points})
    for k in range(2, len(lengths)):
        line = fit_line([p for p in points if p.prompt_tokens < lengths[k]])
        if line is None or line.slope_ms_per_token <= 0:
            continue
        median = float(np.median([p.stall_ms for p in points if p.prompt_tokens == lengths[k]]))
        if median < LEVEL_RATIO * line.at(lengths[k]):
            level = [replace(p, levelled=p.prompt_tokens >= lengths[k]) for p in points]
            plateau = float(np.median([p.stall_ms for p in level if p.levelled]))
            return Fit(tuple(level), line, lengths[k], plateau)
    line = fit_line(points)
    if line is not None:
        median = float(np.median([p.stall_ms for p in points]))
        if line.slope_ms_per_token * (lengths[-1] - lengths[0]) < FLAT_SHARE * median:
            return Fit(tuple(points), line, lengths[0], median, flat=True)
    return Fit(tuple(points), line)


def by_length(points: tuple[Point, ...]) -> list[dict]:
    """Per prompt length: points, median stall, how many stalled, median TTFT (the window)."""
    groups: dict[int, list[Point]] = defaultdict(list)
    for p in points:
        groups[p.prompt_tokens].append(p)
    return [{"prompt_tokens": n, "points": len(ps), "stall_ms_p50": float(np.median([p.stall_ms for p in ps])),
             "stalled": sum(p.stalled for p in ps), "ttft_ms_p50": float(np.median([p.ttft_ms for p in ps]))}
            for n, ps in sorted(groups.items())]
