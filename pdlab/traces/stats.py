"""What a trace holds before it is replayed (`pdlab trace stats`): its size and what was dropped, the request
rate over time, input and output length distributions, burstiness, and prefix reuse where the format says.

Burstiness is the coefficient of variation (std / mean) of the gaps between arrivals: 1 for Poisson
arrivals, above 1 burstier, 0 evenly spaced. The rate over time counts arrivals in fixed bins. Prefix
reuse is the replay's own measure (pdlab.traces.replay.Replay.reuse_ratio) over the whole trace at its
block size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from pdlab.traces.replay import Replay
from pdlab.traces.trace import Trace

PERCENTILES = (50, 90, 99)
BINS = 60  # rate-over-time bins when no bin width is asked for: at most this many ...
PER_BIN = 10  # ... and about this many arrivals in a bin at the mean rate, at least


@dataclass(frozen=True)
class Lengths:
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    min: int

    @classmethod
    def of(cls, x: np.ndarray) -> "Lengths":
        p = np.percentile(x, PERCENTILES)
        return cls(float(x.mean()), float(p[0]), float(p[1]), float(p[2]), int(x.max()), int(x.min()))


@dataclass(frozen=True)
class TraceStats:
    path: str
    format: str
    rows: int  # data rows read
    requests: int  # replayable
    dropped: dict  # reason -> rows
    span_s: float  # first to last arrival
    mean_rate: Optional[float]  # (requests - 1) / span: the nominal rate a replay at its own pace runs at
    bin_s: float
    rate_over_time: tuple[float, ...]  # req/s in each bin from the first arrival
    burstiness: Optional[float]  # CV of inter-arrival gaps
    input_len: Lengths
    output_len: Lengths
    prefix_info: bool
    block_size: Optional[int]
    reuse_ratio: Optional[float]

    @property
    def peak_rate(self) -> float:
        return max(self.rate_over_time, default=0.0)

    def to_dict(self) -> dict:
        return asdict(self)


def burstiness(t: np.ndarray) -> Optional[float]:
    """CV of the gaps between consecutive arrivals; None with fewer than two gaps or all gaps zero."""
    gaps = np.diff(t)
    if len(gaps) < 2 or gaps.mean() <= 0:
        return None
    return float(gaps.std() / gaps.mean())


def rate_over_time(t: np.ndarray, bin_s: float) -> tuple[float, ...]:
    """Arrivals per second in consecutive bins of `bin_s` seconds from the first arrival (the last bin
    holds the last arrival and is divided by its full width)."""
    n = max(1, int(np.floor(t[-1] / bin_s)) + 1)
    counts = np.bincount(np.minimum((t / bin_s).astype(np.int64), n - 1), minlength=n)
    return tuple(float(c) / bin_s for c in counts)


def trace_stats(trace: Trace, bin_s: Optional[float] = None) -> TraceStats:
    """Statistics of the whole trace as read (no window, no scaling)."""
    span = float(trace.t[-1])
    whole = SimpleNamespace(start_s=0.0, duration_s=None, sample=1.0, limit=None, time_scale=1.0, length_scale=1.0)
    replay = Replay(trace, whole, seed=0)
    if bin_s is None:
        rate = replay.nominal_rate
        bin_s = max(span / BINS, PER_BIN / rate) if rate and np.isfinite(rate) else 1.0
    return TraceStats(path=trace.path, format=trace.format, rows=trace.rows, requests=len(trace),
                      dropped=trace.dropped_counts, span_s=span, mean_rate=replay.nominal_rate, bin_s=bin_s,
                      rate_over_time=rate_over_time(trace.t, bin_s), burstiness=burstiness(trace.t),
                      input_len=Lengths.of(trace.input_len), output_len=Lengths.of(trace.output_len),
                      prefix_info=trace.prefix_info, block_size=trace.block_size, reuse_ratio=replay.reuse_ratio())


def plot_stats(stats: TraceStats, trace: Trace, path: str) -> Optional[str]:
    """A PNG beside the table: rate over time, and the input and output length distributions (CDFs).
    None when matplotlib is not installed (the `plots` extra)."""
    try:
        import matplotlib  # deferred: matplotlib (optional; slow to import)

        matplotlib.use("Agg")
        # deferred: matplotlib (optional)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_rate, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    edges = np.arange(len(stats.rate_over_time) + 1) * stats.bin_s
    ax_rate.stairs(stats.rate_over_time, edges)
    ax_rate.set(xlabel="time in the trace (s)", ylabel="requests/s", title=f"rate over time ({stats.bin_s:.3g} s bins)")
    for x, label in ((trace.input_len, "input"), (trace.output_len, "output")):
        v = np.sort(x)
        ax_len.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{label} (p50 {np.median(v):.0f})")
    ax_len.set(xscale="log", xlabel="tokens", ylabel="fraction of requests", title="length CDF")
    ax_len.legend()
    reuse = "" if stats.reuse_ratio is None else f", prefix reuse {stats.reuse_ratio:.0%}"
    fig.suptitle(f"{stats.path} ({stats.format}): {stats.requests} requests{reuse}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def describe(stats: TraceStats) -> list[tuple[str, Any]]:
    """(label, text) rows of the table `pdlab trace stats` prints."""
    def lengths(x: Lengths) -> str:
        return f"mean {x.mean:.0f}, p50 {x.p50:.0f}, p90 {x.p90:.0f}, p99 {x.p99:.0f}, min {x.min}, max {x.max}"

    dropped = ", ".join(f"{n} {r}" for r, n in stats.dropped.items()) or "none"
    rate = "—" if stats.mean_rate is None else f"{stats.mean_rate:.4g} req/s"
    cv = "—" if stats.burstiness is None else f"{stats.burstiness:.2f} (CV of inter-arrival gaps; Poisson 1)"
    per_bin = stats.rate_over_time
    reuse = (f"{stats.reuse_ratio:.1%} of prompt tokens in blocks seen before ({stats.block_size}-token blocks, "
             "one unbounded cache, in order)" if stats.prefix_info else
             f"no prefix information in the {stats.format} format (prompts replay as unique tokens)")
    return [("requests", f"{stats.requests} of {stats.rows} rows; dropped: {dropped}"),
            ("span", f"{stats.span_s:.6g} s"),
            ("mean rate", f"{rate} (the rate of `rates: [trace]`)"),
            ("rate over time", f"min {min(per_bin):.3g}, median {float(np.median(per_bin)):.3g}, max "
                               f"{max(per_bin):.3g} req/s in {stats.bin_s:.3g} s bins"),
            ("burstiness", cv),
            ("input tokens", lengths(stats.input_len)),
            ("output tokens", lengths(stats.output_len)),
            ("prefix reuse", reuse)]
