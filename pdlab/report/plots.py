"""PNG plots of a run: attainment/goodput vs rate, TTFT and ITL CDFs, and the ITL timeline with the
producing worker's prefill steps shaded: the picture of prefill interference. Across runs: attainment vs
rate per row and, after `pdlab compare --slo-scale`, goodput against the SLO scale.

Reading them:
- goodput.png: attainment per rate; the all-at-once rate (saturation) sits at the right edge, apart from the
  rate axis (it is not a point on the goodput curve), with each variant's saturation request rate in the
  legend. Goodput is a dotted vertical line at its mean, shaded over its 95% interval when there are two or
  more repeats. A rate search shows each repeat's trials as markers (one marker shape per repeat).
- latency_cdf.png, itl_timeline.png: at the focus rate (grid: the highest rate every variant measured;
  search: each variant's own last passing rate), first repeat.
- Log axes are labelled in plain numbers (10, 100, 1000), a few ticks per axis.

matplotlib is optional (the `plots` extra): without it the plots are skipped with a note.
"""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from typing import Any, Optional

from pdlab.measure.attribution import attribute_gaps
from pdlab.measure.confidence import Estimate, format_estimate
from pdlab.measure.metrics import as_rate
from pdlab.measure.records import Run, load_run
from pdlab.workload import rate_tag

REPEAT_MARKERS = ("o", "^", "s", "D", "v", "P", "X", "*")


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install 'pdlab[plots]')", file=sys.stderr)
        return None


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- axes ----

def _plain(x: float, _pos: Any = None) -> str:
    """10, 100, 1000, 0.5: never 10^3 or 1e+03."""
    if x <= 0 or not math.isfinite(x):
        return ""
    if x >= 1 and abs(x - round(x)) < 1e-9 * x:
        return f"{round(x):d}"
    return f"{x:.3g}"


def plain_log_axis(axis: Any) -> None:
    """A log axis with a few plainly labelled ticks that do not overlap: powers of ten over wide ranges,
    1-2-5 within about a decade, 1-1.5-2-3-5-7 within less, evenly spaced values when even that gives fewer
    than two; minor ticks unlabelled.
    Call it after the data is drawn (it reads the axis' view limits)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 1.0
    subs = (1.0,) if decades >= 1.6 else (1.0, 2.0, 5.0) if decades >= 0.5 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    major: Any = LogLocator(base=10, subs=subs, numticks=7)
    if sum(1 for t in major.tick_values(lo, hi) if lo <= t <= hi) < 2:  # a narrow range: evenly spaced values
        major = MaxNLocator(nbins=4)
    axis.set_major_locator(major)
    axis.set_major_formatter(FuncFormatter(_plain))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=12))
    axis.set_minor_formatter(NullFormatter())


# ---- goodput / attainment vs rate ----

def _mean(x: Any) -> Optional[float]:
    """An estimate dict's mean, or a plain number (older summaries)."""
    if isinstance(x, dict):
        return x.get("mean")
    return x


def goodput_series(label: str, vs: dict, goodput: Optional[dict] = None) -> dict:
    """What the attainment plot draws for one variant's summary `vs`: the finite (rate, attainment) points
    pooled over repeats, attainment at the all-at-once rate, saturation request rate, each repeat's search
    trials (search mode only) and goodput (an estimate dict; default the variant's own)."""
    rates = vs.get("rates") or {}
    pts = sorted((as_rate(x.get("rate", t)), x["attainment"]) for t, x in rates.items()
                 if x.get("attainment") is not None and not math.isinf(as_rate(x.get("rate", t))))
    sat = rates.get("inf") or {}
    trials = []
    if vs.get("mode") == "search":
        trials = [[(float(t["rate"]), float(t["attainment"])) for t in (rep.get("goodput") or {}).get("trials", [])]
                  for rep in vs.get("repeats") or []]
    return {"label": label, "points": pts, "saturation_attainment": sat.get("attainment"),
            "saturation_rps": _mean((vs.get("saturation") or {}).get("request_throughput")),
            "trials": trials, "goodput": goodput if goodput is not None else (vs.get("goodput") or {})}


def _goodput_text(g: dict) -> str:
    if not g or g.get("mean") is None:
        return "no goodput"
    e = Estimate.from_dict({"lo": None, "hi": None, "n": 0, "values": [], **g})
    return (("≥ " if g.get("open_above") else "") + format_estimate(e) + " req/s"
            + (", held to saturation" if g.get("capped") else ""))


def _attainment_plot(plt: Any, series: list[dict], target: float, path: str, title: str) -> str:
    """Attainment (%) against rate, one colour per series. Saturation (all at once) at the right edge as a
    hollow square, beyond a thin separator; goodput dotted, its interval shaded (n >= 2)."""
    fig, ax = plt.subplots(figsize=(7.8, 4.8))
    finite = [r for s in series for r, _ in s["points"]] + [r for s in series for tr in s["trials"] for r, _ in tr]
    top = max(finite, default=1.0)
    has_sat = any(s["saturation_attainment"] is not None for s in series)
    x_sat = top * 1.22
    x_sep = (top + x_sat) / 2
    repeats_shown = 0
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        label = f"{s['label']}: goodput {_goodput_text(s['goodput'])}"
        if s["saturation_rps"]:
            label += f"; saturation {s['saturation_rps']:.3g} req/s"
        if s["trials"]:  # a rate search: each repeat's trials, one marker shape per repeat
            for j, tr in enumerate(s["trials"]):
                tr = sorted(tr)
                if tr:
                    ax.plot([r for r, _ in tr], [100 * a for _, a in tr], ls="none", color=color, alpha=0.85,
                            marker=REPEAT_MARKERS[j % len(REPEAT_MARKERS)], ms=6, mfc="none" if j else color)
            repeats_shown = max(repeats_shown, len(s["trials"]))
            ax.plot([], [], color=color, marker="o", ls="none", label=label)
        else:
            pts = s["points"]
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", color=color, label=label)
        if s["saturation_attainment"] is not None:  # side by side, so equal attainments stay visible
            dx = (i - (len(series) - 1) / 2) * 0.025 * top
            ax.plot([x_sat + dx], [100 * s["saturation_attainment"]], marker="s", ms=8, mfc="none", mew=1.6,
                    color=color, ls="none")
        g = s["goodput"] or {}
        if g.get("mean") is not None:
            ax.axvline(g["mean"], color=color, ls=":", lw=1.4)
            if (g.get("n") or 0) >= 2 and g.get("lo") is not None and g.get("hi") is not None:
                ax.axvspan(max(0.0, g["lo"]), min(g["hi"], x_sep if has_sat else g["hi"]), color=color, alpha=0.12,
                           lw=0)
    ax.axhline(100 * target, color="grey", ls="--", lw=1, label=f"target {100 * target:.0f}%")
    if repeats_shown > 1:
        for j in range(repeats_shown):
            ax.plot([], [], color="grey", ls="none", marker=REPEAT_MARKERS[j % len(REPEAT_MARKERS)],
                    mfc="none" if j else "grey", label=f"repeat {j + 1} trials")
    if has_sat:
        ax.plot([], [], color="grey", ls="none", marker="s", mfc="none", label="all at once (saturation)")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-2, 102), title=title)
    ax.set_xlim(0, (x_sat if has_sat else top) * 1.06)
    if has_sat:
        ax.axvline(x_sep, color="lightgrey", lw=1)
        ticks = [t for t in ax.get_xticks() if 0 <= t <= top * 1.02]
        ax.set_xticks(ticks + [x_sat])
        ax.set_xticklabels([f"{t:g}" for t in ticks] + ["all at\nonce"])
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


# ---- latencies at one rate ----

def _cdf(ax: Any, values: list[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)


def focus_rates(run: Run) -> dict[str, float]:
    """variant -> the rate its latency plots show. Grid: the highest finite rate every variant measured
    (the same for all). Search: each variant's own last passing rate in the first repeat (else its lowest
    rate tried), since searches try different rates."""
    by: dict[str, set] = defaultdict(set)
    for r in run.requests:
        if not r.get("warmup") and not r.get("repeat"):
            by[r["variant"]].add(as_rate(r["rate"]))
    variants = (run.summary or {}).get("variants") or {}
    search = bool(variants) and all(vs.get("mode") == "search" for vs in variants.values())
    if not search:
        common = set.intersection(*by.values()) if by else set()
        finite = sorted(r for r in common if not math.isinf(r))
        return {v: finite[-1] for v in by} if finite else {}
    out = {}
    for v, rates in by.items():
        finite = sorted(r for r in rates if not math.isinf(r))
        reps = (variants.get(v) or {}).get("repeats") or []
        g = (reps[0].get("goodput") or {}) if reps else {}
        pick = g.get("last_pass") if g.get("last_pass") in rates else None
        if pick is None and finite:
            pick = finite[0]
        if pick is not None:
            out[v] = pick
    return out


def timeline_steps(run: Run, variant: str, rate: float, workers: set, repeat: int = 0) -> list[dict]:
    """The steps the ITL timeline draws for (variant, rate, repeat): those of the workers that produced the
    requests' tokens. Warm-up steps (`warmup: true`) are left out: they ran before the first measured arrival
    (they used to show up at negative time) and no measured gap can overlap them."""
    return [s for s in run.steps if s["variant"] == variant and as_rate(s["rate"]) == rate
            and s["worker"] in workers and int(s.get("repeat") or 0) == repeat and not s.get("warmup")]


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
    series = [goodput_series(v, vs) for v, vs in variants.items() if vs.get("rates")]
    if series:
        modelled = " [MODELLED timing: not this machine's]" if run.summary.get("modelled") else ""
        out.append(_attainment_plot(plt, series, target, os.path.join(run_dir, "goodput.png"),
                                    "SLO attainment vs rate (dotted: goodput; shaded: its 95% interval)" + modelled))

    focus = focus_rates(run)
    if not focus:
        return out
    by_v: dict[str, list[dict]] = defaultdict(list)
    for r in run.requests:  # the first repeat: one timeline per variant
        if r["variant"] in focus and as_rate(r["rate"]) == focus[r["variant"]] and r.get("ok") \
                and not r.get("warmup") and not r.get("repeat"):
            by_v[r["variant"]].append(r)
    if not by_v:
        return out
    same = len(set(focus[v] for v in by_v)) == 1
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v, rs in by_v.items():
        label = v if same else f"{v} @ {rate_tag(focus[v])} req/s"
        _cdf(a1, [1000 * r["ttft"] for r in rs if r.get("ttft") is not None], label)
        _cdf(a2, [1000 * g for r in rs for g in (r.get("itl") or [])], label)
    for ax, name, lim in ((a1, "TTFT (ms)", slo.get("ttft_ms")), (a2, "ITL gap (ms)", slo.get("itl_ms"))):
        if lim:
            ax.axvline(lim, color="grey", ls="--", lw=1)
        ax.set(xlabel=name, ylabel="fraction of requests" if ax is a1 else "fraction of gaps", xscale="log")
        plain_log_axis(ax.xaxis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    where = f"at {rate_tag(next(iter(focus.values())))} req/s" if same else "at each variant's goodput"
    fig.suptitle(f"latency distributions {where} (dashed: SLO)"
                 + (" [MODELLED timing]" if run.summary.get("modelled") else ""))
    out.append(_save(plt, fig, os.path.join(run_dir, "latency_cdf.png")))
    repeats = int((run.summary or {}).get("repeats") or 1)
    out.append(_timeline(plt, run, by_v, focus, slo, os.path.join(run_dir, "itl_timeline.png"), repeats > 1))
    return out


def _timeline(plt: Any, run: Run, by_v: dict[str, list[dict]], focus: dict[str, float], slo: dict, path: str,
              first_of_many: bool = False) -> str:
    names = list(by_v)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.6 * len(names) + 0.6), sharex=False, squeeze=False)
    itl_ms = slo.get("itl_ms", 50.0)
    for ax, v in zip(axes[:, 0], names):
        rs, rate = by_v[v], focus[v]
        t0 = min(r["arrival"] for r in rs)
        steps = timeline_steps(run, v, rate, {r.get("decode_worker") for r in rs})
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
        # per rate (and first repeat), unlike the compare table's count, which sums the finite rates
        ax.scatter([g["end"] - t0 for g in hit], [1000 * g["gap"] for g in hit], s=10, color="tab:red",
                   label=f"prefill interruptions at {rate_tag(rate)} req/s"
                         f"{' (first repeat)' if first_of_many else ''}: {len(hit)}")
        ax.axhline(itl_ms, color="grey", ls="--", lw=1)
        ax.set(ylabel="gap (ms)", title=f"{v} @ {rate_tag(rate)} req/s: ITL gaps over time (shaded: prefill steps "
                                        "of the decoding worker; dashed: ITL target)")
        ax.set_yscale("log")
        ax.set_xlim(left=0)  # measured requests only: nothing before the first arrival
        plain_log_axis(ax.yaxis)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the first measured arrival")
    return _save(plt, fig, path)


# ---- across runs ----

def write_compare_plots(result: dict, runs: list[Run], out_dir: str) -> list[str]:
    """Attainment vs rate for every row of a comparison, in one figure (compare_goodput.png); with
    `result["slo_scale"]` (pdlab compare --slo-scale), also goodput_vs_slo_scale.png."""
    plt = _plt()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    by_label = {}
    for run in runs:
        for v, vs in (run.summary.get("variants") or {}).items():
            by_label[v if len(runs) == 1 else f"{run.name}/{v}"] = vs
    series = [goodput_series(row["label"], by_label[row["label"]], row.get("goodput"))
              for row in result["rows"] if by_label.get(row["label"])]
    target = (result.get("slo") or {}).get("attainment", 0.9)
    out = [_attainment_plot(plt, series, target, os.path.join(out_dir, "compare_goodput.png"),
                            "SLO attainment vs rate across runs (dotted: goodput)")]
    if result.get("slo_scale"):
        out.append(_slo_scale_plot(plt, result["slo_scale"], os.path.join(out_dir, "goodput_vs_slo_scale.png")))
    return out


def write_slo_scale_plot(rescored: dict, out_dir: str) -> list[str]:
    """goodput_vs_slo_scale.png from pdlab.report.rescore's result; [] without matplotlib."""
    plt = _plt()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    return [_slo_scale_plot(plt, rescored, os.path.join(out_dir, "goodput_vs_slo_scale.png"))]


def _slo_scale_plot(plt: Any, rescored: dict, path: str) -> str:
    """Goodput (mean, error bars from the 95% interval) against SLO scale, one line per variant. A point that
    is only a lower bound (no rate tried failed) is an upward triangle, one below the rates tried a downward
    triangle, one held to the saturation throughput a hollow square."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    marks = {"open_above": "^", "open_below": "v", "capped": "s"}
    n = len(rescored["variants"])
    for i, (v, cells) in enumerate(rescored["variants"].items()):
        color = f"C{i % 10}"
        dodge = 2 ** (0.03 * (i - (n - 1) / 2))  # side by side, so error bars at one scale stay apart
        pts = [(c["scale"] * dodge, c["goodput"]) for c in cells if c["goodput"].get("mean") is not None]
        if not pts:
            continue
        xs = [s for s, _ in pts]
        ys = [g["mean"] for _, g in pts]
        lo = [g["mean"] - g["lo"] if g.get("lo") is not None else 0.0 for _, g in pts]
        hi = [g["hi"] - g["mean"] if g.get("hi") is not None else 0.0 for _, g in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], color=color, marker="o", ms=5, capsize=3, label=v)
        for key, m in marks.items():
            sel = [(s, g["mean"]) for s, g in pts if g.get(key)]
            if sel:
                ax.plot([s for s, _ in sel], [y for _, y in sel], ls="none", marker=m, ms=10, mfc="none",
                        color=color)
    if any(c["goodput"].get("open_above") for cs in rescored["variants"].values() for c in cs):
        ax.plot([], [], ls="none", marker="^", mfc="none", color="grey", label="lower bound (no rate tried failed)")
    if any(c["goodput"].get("open_below") for cs in rescored["variants"].values() for c in cs):
        ax.plot([], [], ls="none", marker="v", mfc="none", color="grey", label="lowest rate tried already failed")
    if any(c["goodput"].get("capped") for cs in rescored["variants"].values() for c in cs):
        ax.plot([], [], ls="none", marker="s", mfc="none", color="grey", label="held to the saturation throughput")
    scales = rescored["scales"]
    if len(scales) > 1 and max(scales) / min(scales) >= 4:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(scales))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}×"))
    ax.xaxis.set_minor_locator(NullLocator())
    slo = rescored.get("slo") or {}
    base = f"1× = TTFT {slo.get('ttft_ms', 0):g} ms, ITL {slo.get('itl_stat', '?')} {slo.get('itl_ms', 0):g} ms"
    ax.set(xlabel=f"SLO scale (TTFT and ITL targets × scale; {base})", ylabel="goodput (req/s)",
           title="goodput vs SLO scale (bars: 95% interval over repeats)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
