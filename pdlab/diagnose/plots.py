"""The two figures of a diagnosis (PNG files in its run directory, and in the HTML page):

- the gap timeline: every inter-token gap of the background streams against time, steady in blue and stalls
  in red, the probes' prefill windows shaded (other requests' windows lighter), the ITL target dashed and the
  stand-out threshold dotted;
- stall against prompt length: a point per isolated window, the fitted line and its R², the ITL target, and
  the server's prefill line where steps were held against the tags.

matplotlib is optional (the `plots` extra): without it, figures are skipped with a note. Self-contained here
(pdlab.report's plot helpers belong to the report), in their style: constrained layout, legends beside.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from pdlab.diagnose.analysis import Analysis

COLORS = {"steady": "tab:blue", "stall": "tab:red", "probe": "tab:orange", "mixed": "tab:green",
          "other": "0.6"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; None (with a note) when it is not installed."""
    try:
        import matplotlib  # deferred: matplotlib (optional; heavy)

        matplotlib.use("Agg")
        # deferred: matplotlib (optional)
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install 'pdlab[plots]')", file=sys.stderr)
        return None


def _legend(ax: Any) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7)


def timeline_figure(plt: Any, a: Analysis) -> Any:
    fig, ax = plt.subplots(figsize=(11.0, 4.2), layout="constrained")
    t = a.tagging
    t0 = min((s.send for s in a.streams), default=0.0)
    spans: dict[str, list] = {"other": [], "probe": [], "mixed": []}
    for w in t.windows:
        spans[w.phase if w.phase in ("probe", "mixed") else "other"].append((w.start - t0, w.end - w.start))
    labels = {"probe": "probe prefill windows", "mixed": "mixed-phase windows", "other": "other requests' windows"}
    for kind, xr in spans.items():
        if xr:  # one collection per kind: a run's records may hold thousands of windows
            ax.broken_barh(xr, (0, 1), transform=ax.get_xaxis_transform(), color=COLORS[kind], lw=0,
                           alpha=0.08 if kind == "other" else 0.3, label=labels[kind])
    for tag, size in (("steady", 3), ("stall", 12)):
        gaps = t.of(tag)
        ax.scatter([g.end - t0 for g in gaps], [max(g.ms, 1e-3) for g in gaps], s=size, color=COLORS[tag],
                   label=f"{tag} gaps: {len(gaps)}", zorder=3)
    ax.axhline(a.target_ms, color="grey", ls="--", lw=1, label=f"ITL target {a.target_ms:g} ms")
    if t.threshold:
        ax.axhline(t.threshold.value_ms, color="black", ls=":", lw=1,
                   label=f"stands out above {t.threshold.value_ms:.1f} ms")
    ax.set(yscale="log", xlabel="seconds since the first send", ylabel="gap (ms)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    ax.set_title(f"{a.label}: inter-token gaps of the background streams — {a.verdict.kind.replace('_', ' ')}",
                 fontsize=10)
    return fig


def fit_figure(plt: Any, a: Analysis) -> Any:
    fig, ax = plt.subplots(figsize=(8.0, 4.2), layout="constrained")
    pts = a.fit.points
    for stalled, levelled, label in ((True, False, "stalled"), (False, False, "no stall"),
                                     (True, True, "levelled off (not fitted)"), (False, True, None)):
        sel = [p for p in pts if p.stalled == stalled and p.levelled == levelled]
        if sel:
            ax.scatter([p.prompt_tokens for p in sel], [p.stall_ms for p in sel], s=22, zorder=3,
                       facecolors="none" if levelled else COLORS["stall" if stalled else "steady"],
                       edgecolors=COLORS["stall" if stalled else "steady"], label=label)
    xs = [0, max((p.prompt_tokens for p in pts), default=1)]
    line = a.fit.line
    if line is not None:
        r2 = "" if line.r2 is None else f", R² {line.r2:.2f}"
        ax.plot(xs, [line.at(x) for x in xs], color="black", lw=1,
                label=f"fit: {line.intercept_ms:.1f} ms + {line.per_1k_ms:.1f} ms per 1k tokens{r2}")
    server = (a.agreement or {}).get("server_prefill")
    if server:
        per_1k = server["prefill_ms_per_1k_tokens"]
        ax.plot(xs, [server["intercept_ms"] + per_1k * x / 1000 for x in xs], color="tab:purple", ls="-.", lw=1,
                label=f"server's prefill steps: {per_1k:.1f} ms per 1k tokens")
    ax.axhline(a.target_ms, color="grey", ls="--", lw=1, label=f"ITL target {a.target_ms:g} ms")
    ax.set(xlabel="prompt tokens", ylabel="longest gap beside the prefill (ms)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    ax.set_title(f"{a.label}: stall against prompt length (one point per isolated prefill window)", fontsize=10)
    return fig


def figures(a: Analysis, suffix: str = "") -> list[tuple[str, Any]]:
    """(file name, figure) of one analysis; [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    out = [(f"gap_timeline{suffix}.png", timeline_figure(plt, a))]
    if a.fit.points:
        out.append((f"stall_fit{suffix}.png", fit_figure(plt, a)))
    return out


def close(fig: Any) -> None:
    import matplotlib.pyplot as plt  # deferred: matplotlib (optional; only once a figure exists)

    plt.close(fig)


def save(fig: Any, path: str, keep: bool = False) -> Optional[bytes]:
    """Write `fig` to `path`; its PNG bytes when `keep` (for the HTML page)."""
    fig.savefig(path, dpi=110)
    data = None
    if keep:
        with open(path, "rb") as f:
            data = f.read()
    close(fig)
    return data
