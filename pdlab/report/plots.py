"""PNG plots of a run: attainment/goodput vs rate, TTFT and ITL CDFs, and the ITL timeline with the
producing worker's prefill steps shaded: the picture of prefill interference.

matplotlib is optional (the `plots` extra): without it the plots are skipped with a note.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Any, Optional

from pdlab.measure.attribution import attribute_gaps
from pdlab.measure.metrics import as_rate
from pdlab.measure.records import Run, load_run
from pdlab.workload import rate_tag


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install 'pdlab[plots]')", file=sys.stderr)
        return None


def _focus_rate(run: Run) -> Optional[float]:
    """The highest finite rate every variant measured."""
    by: dict[str, set] = defaultdict(set)
    for r in run.requests:
        by[r["variant"]].add(as_rate(r["rate"]))
    common = set.intersection(*by.values()) if by else set()
    finite = sorted(r for r in common if r != float("inf"))
    return finite[-1] if finite else None


def _attainment_plot(plt: Any, series: list[tuple[str, list[tuple[float, float]], Optional[float]]],
                     target: float, path: str, title: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts, good in series:
        pts = sorted(p for p in pts if p[0] != float("inf"))
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
        if good:
            ax.axvline(good, color=line.get_color(), ls=":", lw=1)
    ax.axhline(100 * target, color="grey", ls="--", lw=1, label=f"target {100 * target:.0f}%")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-2, 102), title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax: Any, values: list[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)


def write_plots(run_dir: str, run: Optional[Run] = None) -> list[str]:
    """Write goodput.png, latency_cdf.png and itl_timeline.png into the run directory; returns their paths."""
    plt = _plt()
    if plt is None:
        return []
    run = run or load_run(run_dir)
    slo = run.summary.get("slo") or run.recipe.get("slo") or {}
    target = slo.get("attainment", 0.9)
    out = []
    variants = run.summary.get("variants") or {}
    series = []
    for v, vs in variants.items():
        pts = [(as_rate(x["rate"]), x["attainment"]) for x in vs["rates"].values() if x.get("attainment") is not None]
        g = vs["goodput"]
        series.append((f"{v} (goodput {'≥' if g.get('open_above') else ''}{g.get('mean') or 0:.2f})", pts,
                       g.get("mean")))
    if series:
        out.append(_attainment_plot(plt, series, target, os.path.join(run_dir, "goodput.png"),
                                    "SLO attainment vs rate (dotted: goodput)"))

    focus = _focus_rate(run)
    if focus is None:
        return out
    reqs = [r for r in run.requests if as_rate(r["rate"]) == focus and r.get("ok") and not r.get("warmup")
            and not r.get("repeat")]  # the first repeat: one timeline per variant
    by_v: dict[str, list[dict]] = defaultdict(list)
    for r in reqs:
        by_v[r["variant"]].append(r)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v, rs in by_v.items():
        _cdf(a1, [1000 * r["ttft"] for r in rs if r.get("ttft") is not None], v)
        _cdf(a2, [1000 * g for r in rs for g in (r.get("itl") or [])], v)
    for ax, name, lim in ((a1, "TTFT (ms)", slo.get("ttft_ms")), (a2, "ITL gap (ms)", slo.get("itl_ms"))):
        if lim:
            ax.axvline(lim, color="grey", ls="--", lw=1)
        ax.set(xlabel=name, ylabel="fraction of requests" if ax is a1 else "fraction of gaps", xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"latency distributions at {rate_tag(focus)} req/s (dashed: SLO)")
    fig.tight_layout()
    out.append(os.path.join(run_dir, "latency_cdf.png"))
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    out.append(_timeline(plt, run, by_v, focus, slo, os.path.join(run_dir, "itl_timeline.png")))
    return out


def _timeline(plt: Any, run: Run, by_v: dict[str, list[dict]], focus: float, slo: dict, path: str) -> str:
    names = list(by_v)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.6 * len(names) + 0.6), sharex=False, squeeze=False)
    itl_ms = slo.get("itl_ms", 50.0)
    for ax, v in zip(axes[:, 0], names):
        rs = by_v[v]
        t0 = min(r["arrival"] for r in rs)
        workers = {r.get("decode_worker") for r in rs}
        steps = [s for s in run.steps if s["variant"] == v and as_rate(s["rate"]) == focus and s["worker"] in workers
                 and not s.get("repeat")]
        for s in steps:
            if int(s.get("prefill_tokens") or 0) > 0:
                ax.axvspan(s["start"] - t0, s["end"] - t0, color="tab:orange", alpha=0.15, lw=0)
        xs, ys = [], []
        for r in rs:
            tt = r.get("token_times") or []
            for a, b in zip(tt, tt[1:]):
                xs.append(b - t0)
                ys.append(1000 * (b - a))
        ax.scatter(xs, ys, s=4, color="tab:blue", label="ITL gap")
        slow = attribute_gaps(rs, steps, itl_ms)
        hit = [g for g in slow if g["cause"] == "prefill"]
        ax.scatter([g["end"] - t0 for g in hit], [1000 * g["gap"] for g in hit], s=10, color="tab:red",
                   label=f"prefill interruption ({len(hit)})")
        ax.axhline(itl_ms, color="grey", ls="--", lw=1)
        ax.set(ylabel="gap (ms)", title=f"{v}: ITL gaps over time (shaded: prefill steps of the decoding worker)")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel(f"seconds since the first arrival at {rate_tag(focus)} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_compare_plots(result: dict, runs: list[Run], out_dir: str) -> list[str]:
    """Attainment vs rate for every row of a comparison, in one figure."""
    plt = _plt()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    by_label = {}
    for run in runs:
        for v, vs in (run.summary.get("variants") or {}).items():
            by_label[v if len(runs) == 1 else f"{run.name}/{v}"] = vs
    series = []
    for row in result["rows"]:
        vs = by_label.get(row["label"])
        if vs:
            pts = [(as_rate(x["rate"]), x["attainment"]) for x in vs["rates"].values() if x.get("attainment") is not None]
            series.append((row["label"], pts, row["goodput"].get("mean")))
    target = (result.get("slo") or {}).get("attainment", 0.9)
    return [_attainment_plot(plt, series, target, os.path.join(out_dir, "compare_goodput.png"),
                             "SLO attainment vs rate across runs")]
