"""What every pdlab plot shares: matplotlib (optional: the `plots` extra), titles that fit the figure, legends
beside the data rather than on it, the MODELLED and PARTIAL tags, markers that tell variants apart, and log
axes labelled in plain numbers.

Figures use matplotlib's constrained layout, so a legend placed outside the axes gets room of its own.
"""

from __future__ import annotations

import math
import sys
import textwrap
from typing import Any

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
TAG_COLOR = "#b00020"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; None (with a note) when matplotlib is not installed."""
    try:
        # deferred: matplotlib (optional)
        import matplotlib

        matplotlib.use("Agg")
        # deferred: matplotlib (optional)
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install 'pdlab[plots]')", file=sys.stderr)
        return None


def figure(plt: Any, w: float, h: float, rows: int = 1, cols: int = 1) -> tuple[Any, Any]:
    return plt.subplots(rows, cols, figsize=(w, h), layout="constrained", squeeze=False)


def save(plt: Any, fig: Any, path: str) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fit_title(fig: Any, text: str, ax: Any = None, size: float = 10.0, width: float = 0.96, x: float = 0.5) -> Any:
    """Set `text` as the axes' (or, without `ax`, the figure's, centred at `x`) title, wrapped onto as many lines
    as it takes for each to fit `width` of the figure. Returns the title's Text."""
    limit = width * fig.get_figwidth() * fig.dpi
    renderer = fig.canvas.get_renderer()
    chars = len(text)
    while True:
        wrapped = "\n".join(textwrap.wrap(text, chars)) or text
        t = ax.set_title(wrapped, fontsize=size) if ax is not None else fig.suptitle(wrapped, fontsize=size, x=x)
        if t.get_window_extent(renderer).width <= limit or chars <= 20:
            return t
        chars = max(20, int(chars * 0.85))


def tags(fig: Any, modelled: bool, partial: list[str]) -> list[Any]:
    """MODELLED and PARTIAL in the figure's top-left corner, in a band of their own above the title (the layout
    keeps axes and legends below it): a reader of the PNG alone sees them. Call it after the title is set.
    Returns the Text objects."""
    lines = (["MODELLED timing: not this machine's"] if modelled else []) + [f"PARTIAL: {p}" for p in partial]
    if not lines:
        return []
    band = 0.2 / fig.get_figheight()  # one line of 8-point text, in figure fractions
    out = [fig.text(0.005, 0.996 - band * i, textwrap.shorten(line, 120), ha="left", va="top", fontsize=8,
                    color=TAG_COLOR, weight="bold") for i, line in enumerate(lines)]
    fig.get_layout_engine().set(rect=(0, 0, 1, 1 - band * len(lines) - 0.01))  # the axes below the band
    if fig._suptitle is not None:  # a figure title shares the top with the tags: right of them
        r = fig.canvas.get_renderer()
        right = max(t.get_window_extent(r).x1 for t in out) / fig.bbox.width + 0.02
        fit_title(fig, fig._suptitle.get_text().replace("\n", " "), size=fig._suptitle.get_fontsize(),
                  width=0.98 - right, x=(right + 0.98) / 2)
    return out


def legend_beside(ax: Any, **kw: Any) -> Any:
    """A legend to the right of the axes, outside them (constrained layout makes room)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7, **kw)


def legend_below(fig: Any, ax: Any, notes: Any = ()) -> Any:
    """The axes' legend under the figure, outside the axes; `notes` (the marks' legend, what a count covers)
    head it in small print."""
    handles, labels = ax.get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside lower center", ncols=1 if len(labels) > 4 else 2, fontsize=7,
                      title="\n".join(notes) or None, title_fontsize=7)


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
    than two; minor ticks unlabelled. Call it after the data is drawn (it reads the axis' view limits)."""
    # deferred: matplotlib (optional)
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
