"""PNG plots of a run: attainment/goodput vs rate, TTFT and ITL CDFs, and the ITL timeline with the producing
worker's prefill steps shaded: the picture of prefill interference. Each is built as a matplotlib Figure first
(`run_figures`), so what is drawn can be checked from the objects, then saved.

Reading them:
- goodput.png: attainment per rate, one colour and marker per variant, points side by side where rates
  coincide, whiskers the 95% interval over repeats; the all-at-once rate (saturation) at the right edge, apart
  from the rate axis; goodput a dotted line, its interval shaded. With one finite rate: bars per variant at it.
  A rate search shows each repeat's trials (one marker shape per repeat).
- latency_cdf.png, itl_timeline.png: the first repeat at the focus rate (grid: the highest rate every variant
  measured; search: each variant's own last passing rate), labelled so; compare's tables sum all repeats.
- MODELLED and PARTIAL tags top left; the marks † and ‡ (pdlab.report.stats) under the figure.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Optional

from pdlab.measure.attribution import attribute_gaps
from pdlab.measure.metrics import as_rate
from pdlab.measure.records import Run, load_run
from pdlab.report.compare import compare
from pdlab.report.load import LoadedRun, from_run
from pdlab.report.plot_style import (MARKERS, figure, fit_title, legend_below, legend_beside, plain_log_axis,
                                     pyplot, save, tags)
from pdlab.report.stats import Stat, legend
from pdlab.report.tables import goodput_cell
from pdlab.workload import rate_tag


def plot_tags(result: dict) -> tuple[bool, list[str]]:
    """(modelled, partial reasons) of a compare result: what every figure of it is tagged with."""
    return (any(r["timing"] in ("modelled", "simulated") for r in result["rows"]),
            [f"{p['run']}: {p['reason']}" for p in result["partial"]])


def _finite(r: dict) -> list[tuple[float, Stat]]:
    return sorted((as_rate(t), Stat.of(s, ceiling=1.0)) for t, s in r["attainment"].items()
                  if t != "inf" and s["mean"] is not None)


def _label(r: dict) -> str:
    g = r["goodput"]
    sat = f"; saturation {r['saturation_rps']:.3g} req/s" if r["saturation_rps"] else ""
    return f"{r['label']}: goodput {goodput_cell(g)}{' req/s' if g['mean'] is not None else ''}{sat}"


def attainment_figure(plt: Any, result: dict, title: str) -> Any:
    """Attainment (%) against rate for every row of a compare result; bars when every row has one finite rate."""
    rows = [r for r in result["rows"] if r["attainment"]]
    target = (result["slo"] or {"attainment": 0.9})["attainment"]
    fig, axes = figure(plt, 8.0, 5.2)
    ax = axes[0, 0]
    if rows and all(len(_finite(r)) <= 1 for r in rows) and result["mode"] == "grid":
        _bars(ax, rows)
    else:
        _lines(ax, rows)
    ax.axhline(100 * target, color="grey", ls="--", lw=1, label=f"target {100 * target:.0f}%")
    ax.set(ylabel="SLO attainment (%)", ylim=(-2, 104))
    ax.grid(alpha=0.3, axis="y")
    fit_title(fig, title, ax)
    legend_below(fig, ax, legend(Stat.of(r["goodput"]) for r in rows))
    tags(fig, *plot_tags(result))
    return fig


def _bars(ax: Any, rows: list[dict]) -> None:
    """One group per rate (the finite one, then all at once), one bar per variant: mean attainment and its 95%
    interval over repeats."""
    tags_ = sorted({t for r in rows for t in r["attainment"]}, key=as_rate)
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs, ys, lo, hi = [], [], [], []
        for g, t in enumerate(tags_):
            s = Stat.of(r["attainment"][t], ceiling=1.0) if t in r["attainment"] else Stat.of(None)
            if s.mean is None:
                continue
            xs.append(g + (i - (len(rows) - 1) / 2) * width)
            ys.append(100 * s.mean)
            lo.append(100 * (s.mean - s.lo) if s.lo is not None else 0.0)
            hi.append(100 * (s.hi - s.mean) if s.hi is not None else 0.0)
        ax.bar(xs, ys, width * 0.92, yerr=[lo, hi], capsize=4, color=f"C{i % 10}", label=_label(r),
               hatch=("", "//", "..", "xx")[i % 4], edgecolor="white")
    ax.set_xticks(range(len(tags_)), [f"{t} req/s" if t != "inf" else "all at once" for t in tags_])
    ax.set_xlabel("request rate (bars: mean over repeats; whiskers: 95% interval)")


def _lines(ax: Any, rows: list[dict]) -> None:
    finite = [x for r in rows for x, _ in _finite(r)] + [x for r in rows for t in r["trials"] for x, _ in t]
    top = max(finite, default=1.0)
    has_sat = any("inf" in r["attainment"] for r in rows)
    x_sat, n = top * 1.22, len(rows)
    for i, r in enumerate(rows):
        color, marker, dx = f"C{i % 10}", MARKERS[i % len(MARKERS)], (i - (n - 1) / 2) * 0.012 * top
        if r["mode"] == "search":  # each repeat's trials, one marker shape per repeat
            for j, tr in enumerate(r["trials"]):
                tr = sorted(tuple(x) for x in tr)
                ax.plot([x + dx for x, _ in tr], [100 * a for _, a in tr], ls="none", color=color, alpha=0.85,
                        marker=MARKERS[j % len(MARKERS)], ms=6, mfc="none" if j else color)
            ax.plot([], [], color=color, marker=marker, ls="none", label=_label(r))
        else:
            pts = _finite(r)
            ax.errorbar([x + dx for x, _ in pts], [100 * s.mean for _, s in pts], color=color, marker=marker,
                        yerr=[[100 * (s.mean - s.lo) if s.lo is not None else 0.0 for _, s in pts],
                              [100 * (s.hi - s.mean) if s.hi is not None else 0.0 for _, s in pts]],
                        capsize=3, ms=6, label=_label(r))
        if "inf" in r["attainment"]:  # side by side, so equal attainments stay visible
            ax.plot([x_sat + dx * 2], [100 * r["attainment"]["inf"]["mean"]], marker=marker, ms=8, mfc="none",
                    mew=1.6, color=color, ls="none")
        g = r["goodput"]
        if g["mean"] is not None:
            ax.axvline(g["mean"], color=color, ls=":", lw=1.4)
            if g["lo"] is not None and g["hi"] is not None:
                ax.axvspan(g["lo"], min(g["hi"], (top + x_sat) / 2 if has_sat else g["hi"]), color=color,
                           alpha=0.12, lw=0)
    searches = [r for r in rows if r["mode"] == "search"]
    if max((len(r["trials"]) for r in searches), default=0) > 1:
        for j in range(max(len(r["trials"]) for r in searches)):
            ax.plot([], [], color="grey", ls="none", marker=MARKERS[j % len(MARKERS)], mfc="none" if j else "grey",
                    label=f"repeat {j + 1} trials")
    ax.set_xlabel("request rate (req/s; dotted: goodput, shaded: its 95% interval; whiskers: attainment's)")
    ax.set_xlim(0, (x_sat if has_sat else top) * 1.06)
    if has_sat:
        ax.plot([], [], color="grey", ls="none", marker="o", mfc="none", label="all at once (saturation)")
        ax.axvline((top + x_sat) / 2, color="lightgrey", lw=1)
        ticks = [t for t in ax.get_xticks() if 0 <= t <= top * 1.02]
        ax.set_xticks(ticks + [x_sat], [f"{t:g}" for t in ticks] + ["all at\nonce"])


# ---- latencies at one rate ----

def _measured(r: dict) -> bool:
    """A measured record of the first repeat (warm-up requests carry warmup: true)."""
    return not r.get("warmup") and not r["repeat"]


def focus_rates(lr: LoadedRun) -> dict[str, float]:
    """variant -> the rate its latency plots show. Grid: the highest finite rate every variant measured (the same
    for all). Search: each variant's own last passing rate in the first repeat (else its lowest rate tried)."""
    by: dict[str, set] = defaultdict(set)
    for r in lr.run.requests:
        if _measured(r):
            by[r["variant"]].add(as_rate(r["rate"]))
    variants = lr.summary["variants"]
    if not (variants and all(vs["mode"] == "search" for vs in variants.values())):
        finite = sorted(r for r in (set.intersection(*by.values()) if by else set()) if not math.isinf(r))
        return {v: finite[-1] for v in by} if finite else {}
    out = {}
    for v, rates in by.items():
        reps = variants[v]["repeats"] if v in variants else []
        last = reps[0]["goodput"]["last_pass"] if reps else None
        pick = last if last in rates else min((r for r in rates if not math.isinf(r)), default=None)
        if pick is not None:
            out[v] = pick
    return out


def timeline_steps(run: Run, variant: str, rate: float, workers: set, repeat: int = 0) -> list[dict]:
    """The steps the ITL timeline draws for (variant, rate, repeat): those of the workers that produced the
    requests' tokens. Warm-up steps are left out: they ran before the first measured arrival."""
    return [s for s in run.steps if s["variant"] == variant and as_rate(s["rate"]) == rate
            and s["worker"] in workers and int(s["repeat"] or 0) == repeat and not s.get("warmup")]


def cdf_figure(plt: Any, lr: LoadedRun, result: dict, by_v: dict[str, list[dict]], focus: dict[str, float]) -> Any:
    slo = result["slo"] or {"ttft_ms": None, "itl_ms": None}
    fig, axes = figure(plt, 11.0, 4.6, 1, 2)
    same = len(set(focus[v] for v in by_v)) == 1
    for i, (v, rs) in enumerate(by_v.items()):
        label = v if same else f"{v} @ {rate_tag(focus[v])} req/s"
        for ax, values in ((axes[0, 0], [1000 * r["ttft"] for r in rs if r["ttft"] is not None]),
                           (axes[0, 1], [1000 * g for r in rs for g in r["itl"]])):
            v_ = sorted(values)
            if v_:
                ax.plot(v_, [(k + 1) / len(v_) for k in range(len(v_))], label=label, color=f"C{i % 10}",
                        ls=("-", "--", "-.", ":")[i % 4], marker=MARKERS[i % len(MARKERS)], markevery=0.2, ms=4)
    for ax, name, lim in ((axes[0, 0], "TTFT (ms)", slo["ttft_ms"]), (axes[0, 1], "ITL gap (ms)", slo["itl_ms"])):
        if lim:
            ax.axvline(lim, color="grey", ls="--", lw=1)
        ax.set(xlabel=name, ylabel="fraction of requests" if ax is axes[0, 0] else "fraction of gaps", xscale="log")
        plain_log_axis(ax.xaxis)
        ax.grid(alpha=0.3)
    legend_below(fig, axes[0, 0])
    where = f"at {rate_tag(next(iter(focus.values())))} req/s" if same else "at each variant's goodput"
    repeats = f", repeat 1 of {lr.summary['repeats']}" if lr.summary["repeats"] > 1 else ""
    fit_title(fig, f"latency distributions {where}{repeats} (dashed: SLO)")
    tags(fig, *plot_tags(result))
    return fig


def timeline_figure(plt: Any, lr: LoadedRun, result: dict, by_v: dict[str, list[dict]],
                    focus: dict[str, float]) -> Any:
    itl_ms = (result["slo"] or {"itl_ms": 50.0})["itl_ms"]
    n_rep = lr.summary["repeats"]
    total = {r["variant"]: r["prefill_interruptions"] for r in result["rows"]}
    fig, axes = figure(plt, 11.0, 2.7 * len(by_v) + 1.0, len(by_v), 1)
    for ax, (v, rs) in zip(axes[:, 0], by_v.items()):
        rate, t0 = focus[v], min(r["arrival"] for r in rs)
        steps = timeline_steps(lr.run, v, rate, {r["decode_worker"] for r in rs})
        for s in steps:
            if int(s["prefill_tokens"] or 0) > 0:
                ax.axvspan(s["start"] - t0, s["end"] - t0, color="tab:orange", alpha=0.15, lw=0)
        xs = [b - t0 for r in rs for b in r["token_times"][1:]]
        ys = [1000 * (b - a) for r in rs for a, b in zip(r["token_times"], r["token_times"][1:])]
        ax.scatter(xs, ys, s=4, color="tab:blue", label="ITL gap")
        hit = [g for g in attribute_gaps(rs, steps, itl_ms) if g["cause"] == "prefill"]
        rep = f"repeat 1 of {n_rep}" if n_rep > 1 else "the one repeat"
        ax.scatter([g["end"] - t0 for g in hit], [1000 * g["gap"] for g in hit], s=10, color="tab:red",
                   label=f"prefill interruptions at {rate_tag(rate)} req/s, {rep}: {len(hit)}\n(compare's count, "
                         f"all repeats and finite rates: {total.get(v, '—')})")
        ax.axhline(itl_ms, color="grey", ls="--", lw=1)
        ax.set(ylabel="gap (ms)", yscale="log")
        ax.set_xlim(left=0)  # measured requests only: nothing before the first arrival
        plain_log_axis(ax.yaxis)
        fit_title(fig, f"{v} @ {rate_tag(rate)} req/s", ax, size=9)
        legend_beside(ax)
    axes[-1, 0].set_xlabel("seconds since the first measured arrival")
    fit_title(fig, "ITL gaps over time (shaded: prefill steps of the decoding worker; dashed: ITL target)")
    tags(fig, *plot_tags(result))
    return fig


def run_figures(plt: Any, lr: LoadedRun) -> list[tuple[str, Any]]:
    """(file name, Figure) of every plot of a run."""
    try:
        result = compare([lr])
    except ValueError:  # complete, yet no variant has results: nothing to plot
        return []
    if not result["rows"]:  # stopped before anything was measured
        return []
    out = [("goodput.png", attainment_figure(plt, result, "SLO attainment vs rate"))]
    focus = focus_rates(lr)
    by_v: dict[str, list[dict]] = defaultdict(list)
    for r in lr.run.requests:  # the first repeat: one timeline per variant
        if r["variant"] in focus and as_rate(r["rate"]) == focus[r["variant"]] and r["ok"] and _measured(r):
            by_v[r["variant"]].append(r)
    if by_v:
        out += [("latency_cdf.png", cdf_figure(plt, lr, result, by_v, focus)),
                ("itl_timeline.png", timeline_figure(plt, lr, result, by_v, focus))]
    return out


def write_plots(run_dir: str, run: Optional[Run] = None) -> list[str]:
    """Write goodput.png, latency_cdf.png and itl_timeline.png into the run directory; returns their paths."""
    plt = pyplot()
    if plt is None:
        return []
    return [save(plt, fig, os.path.join(run_dir, name)) for name, fig in run_figures(plt, from_run(
        run or load_run(run_dir)))]
