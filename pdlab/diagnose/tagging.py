"""Every inter-token gap of the background streams, tagged **steady** or **stall**, from the client's view only.

A request's *prefill window* runs from its send to its first token: its prefill happened somewhere inside (the
client cannot see where; the window includes queueing, so it is an upper bound). A gap is *in a window* when
it overlaps the window of any other request. The *steady* distribution is that of the gaps in no window.

A gap **stands out** when it is longer than the threshold

    max(p50 + K * 1.4826 * MAD,  the steady gaps' 99.9th percentile,  FLOOR * p50)

of the steady gaps (p50 their median, MAD the median absolute deviation from it; 1.4826 * MAD estimates a
standard deviation robustly, unmoved by the long tail that stalls would be). The percentile term keeps the
steady distribution's own rare hiccups (a collection pause, a busy host) from being called stalls; the floor
keeps a near-constant gap (MAD about 0) from making every small wobble stand out.

A gap is a **stall** when it is in a window and stands out; every other gap is steady. A gap that stands
out in no window is kept as an *outlier*: slow for some reason no prefill window explains.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pdlab.diagnose.streams import Stream

K_SIGMA = 6.0
MAD_TO_SIGMA = 1.4826
STEADY_QUANTILE = 99.9
FLOOR = 1.5
MIN_STEADY_GAPS = 50  # fewer gaps outside every window: the steady distribution is not known


@dataclass(frozen=True)
class Window:
    id: str
    phase: str
    start: float  # send
    end: float  # first token
    prompt_tokens: int

    @property
    def ms(self) -> float:
        return 1000.0 * (self.end - self.start)


@dataclass(frozen=True)
class Gap:
    stream: str
    index: int  # the delivery that ended it (1: the gap after the first)
    start: float
    end: float
    windows: tuple[str, ...]  # ids of the other requests whose window it overlaps
    tag: str  # steady | stall
    stands_out: bool

    @property
    def ms(self) -> float:
        return 1000.0 * (self.end - self.start)

    @property
    def in_window(self) -> bool:
        return bool(self.windows)


@dataclass(frozen=True)
class Threshold:
    steady_gaps: int
    p50_ms: float
    mad_ms: float
    quantile_ms: float  # the steady gaps' STEADY_QUANTILE-th percentile
    value_ms: float

    def to_dict(self) -> dict:
        return {"steady_gaps": self.steady_gaps, "p50_ms": self.p50_ms, "mad_ms": self.mad_ms,
                "p99_9_ms": self.quantile_ms, "value_ms": self.value_ms,
                "rule": f"max(p50 + {K_SIGMA:g} * {MAD_TO_SIGMA} * MAD, p{STEADY_QUANTILE:g}, {FLOOR:g} * p50) of "
                        "the gaps outside every prefill window"}


@dataclass(frozen=True)
class Tagging:
    windows: tuple[Window, ...]
    gaps: tuple[Gap, ...]
    threshold: Optional[Threshold]  # None: too few steady gaps; then no gap is called a stall

    def of(self, tag: str) -> list[Gap]:
        return [g for g in self.gaps if g.tag == tag]


def windows_of(streams: list[Stream]) -> list[Window]:
    return sorted((Window(s.id, s.phase, s.send, s.first, s.prompt_tokens) for s in streams if s.first is not None),
                  key=lambda w: w.start)


class WindowIndex:
    """Windows sorted by start, for "which windows overlap (t0, t1)" queries."""

    def __init__(self, windows: list[Window]):
        self.windows = windows
        self.starts = [w.start for w in windows]
        self.longest = max((w.end - w.start for w in windows), default=0.0)

    def overlapping(self, t0: float, t1: float, but: Optional[str] = None) -> list[Window]:
        lo = bisect.bisect_left(self.starts, t0 - self.longest)
        hi = bisect.bisect_left(self.starts, t1)
        return [w for w in self.windows[lo:hi] if w.end > t0 and w.start < t1 and w.id != but]


def threshold_of(steady_ms: list[float]) -> Optional[Threshold]:
    if len(steady_ms) < MIN_STEADY_GAPS:
        return None
    v = np.asarray(steady_ms, dtype=float)
    p50 = float(np.median(v))
    mad = float(np.median(np.abs(v - p50)))
    q = float(np.percentile(v, STEADY_QUANTILE))
    return Threshold(len(v), p50, mad, q, max(p50 + K_SIGMA * MAD_TO_SIGMA * mad, q, FLOOR * p50))


def tag(streams: list[Stream]) -> Tagging:
    windows = windows_of(streams)
    index = WindowIndex(windows)
    raw = []
    for s in streams:
        if not s.background:
            continue
        for i, (t0, t1) in enumerate(zip(s.times, s.times[1:]), 1):
            raw.append((s.id, i, t0, t1, tuple(w.id for w in index.overlapping(t0, t1, but=s.id))))
    th = threshold_of([1000.0 * (t1 - t0) for _, _, t0, t1, over in raw if not over])
    gaps = []
    for sid, i, t0, t1, over in raw:
        out = th is not None and 1000.0 * (t1 - t0) > th.value_ms
        gaps.append(Gap(sid, i, t0, t1, over, "stall" if out and over else "steady", out))
    return Tagging(tuple(windows), tuple(gaps), th)
