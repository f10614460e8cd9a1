"""Plots across runs (`pdlab compare --plot DIR`): attainment vs rate for every row of the comparison
(compare_goodput.png) and, after `--slo-scale`, goodput against the SLO scale (goodput_vs_slo_scale.png).
Tagged MODELLED and PARTIAL as the run plots are (pdlab.report.plot_style)."""

from __future__ import annotations

import os
from typing import Any

from pdlab.report.plot_style import figure, fit_title, legend_below, pyplot, save, tags
from pdlab.report.plots import attainment_figure, plot_tags

MARKS = {"open_above": "^", "open_below": "v", "capped": "s"}
MARK_LABELS = {"open_above": "lower bound (no rate tried failed)", "open_below": "lowest rate tried already failed",
               "capped": "held to the saturation throughput"}


def write_compare_plots(result: dict, runs: Any, out_dir: str) -> list[str]:
    """compare_goodput.png (and goodput_vs_slo_scale.png with `result["slo_scale"]`) in `out_dir`; `runs` is
    not read (the result carries every row), kept for callers that pass it."""
    plt = pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    out = [save(plt, attainment_figure(plt, result, "SLO attainment vs rate across runs"),
                os.path.join(out_dir, "compare_goodput.png"))]
    if "slo_scale" in result:
        out.append(save(plt, slo_scale_figure(plt, result["slo_scale"], result),
                        os.path.join(out_dir, "goodput_vs_slo_scale.png")))
    return out


def write_slo_scale_plot(rescored: dict, out_dir: str) -> list[str]:
    """goodput_vs_slo_scale.png from pdlab.report.rescore's result; [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    return [save(plt, slo_scale_figure(plt, rescored), os.path.join(out_dir, "goodput_vs_slo_scale.png"))]


def slo_scale_figure(plt: Any, rescored: dict, result: Any = None) -> Any:
    """Goodput (mean, error bars from the 95% interval) against SLO scale, one line per variant, side by side. A
    point that is only a lower bound is an upward triangle, one below the rates tried a downward triangle, one
    held to the saturation throughput a hollow square."""
    # deferred: matplotlib (optional)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, axes = figure(plt, 8.0, 5.0)
    ax = axes[0, 0]
    n = len(rescored["variants"])
    for i, (v, cells) in enumerate(rescored["variants"].items()):
        color = f"C{i % 10}"
        dodge = 2 ** (0.03 * (i - (n - 1) / 2))  # side by side, so error bars at one scale stay apart
        pts = [(c["scale"] * dodge, c["goodput"]) for c in cells if c["goodput"]["mean"] is not None]
        if not pts:
            continue
        ys = [g["mean"] for _, g in pts]
        lo = [g["mean"] - g["lo"] if g["lo"] is not None else 0.0 for _, g in pts]
        hi = [g["hi"] - g["mean"] if g["hi"] is not None else 0.0 for _, g in pts]
        ax.errorbar([s for s, _ in pts], ys, yerr=[lo, hi], color=color, marker="o", ms=5, capsize=3, label=v)
        for key, m in MARKS.items():
            sel = [(s, g["mean"]) for s, g in pts if g[key]]
            if sel:
                ax.plot([s for s, _ in sel], [y for _, y in sel], ls="none", marker=m, ms=10, mfc="none", color=color)
    for key, m in MARKS.items():
        if any(c["goodput"][key] for cs in rescored["variants"].values() for c in cs):
            ax.plot([], [], ls="none", marker=m, mfc="none", color="grey", label=MARK_LABELS[key])
    scales = rescored["scales"]
    if len(scales) > 1 and max(scales) / min(scales) >= 4:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(scales))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}×"))
    ax.xaxis.set_minor_locator(NullLocator())
    slo = rescored["slo"]
    ax.set(xlabel=f"SLO scale (TTFT and ITL targets × scale; 1× = TTFT {slo['ttft_ms']:g} ms, ITL {slo['itl_stat']} "
                  f"{slo['itl_ms']:g} ms)", ylabel="goodput (req/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fit_title(fig, "goodput vs SLO scale (bars: 95% interval over repeats)", ax)
    legend_below(fig, ax)
    if result is not None:
        tags(fig, *plot_tags(result))
    return fig
