"""`pdlab trace stats FILE [--format F]`: what a production trace holds before it is replayed, as a table
(or --json) and a plot."""

from __future__ import annotations

import os
import sys
from typing import Optional

from pdlab.constants import TRACE_FORMATS
from pdlab.measure.records import dumps

PLOT_DIR = os.path.join("runs", "traces")  # where the plot goes unless --plot names a file


def _err(msg: str) -> int:
    print(f"pdlab trace stats: error: {msg}", file=sys.stderr)
    return 2


def stats_main(path: str, fmt: Optional[str], bin_s: Optional[float], plot: Optional[str], no_plot: bool,
               json_: bool) -> int:
    # deferred: numpy
    from pdlab.traces import TraceError, read_trace, sniff_format
    from pdlab.traces.stats import describe, plot_stats, trace_stats

    if fmt is not None and fmt not in TRACE_FORMATS:
        return _err(f"--format {fmt!r}: expected one of {', '.join(TRACE_FORMATS)}")
    if bin_s is not None and not bin_s > 0:
        return _err(f"--bin-s {bin_s:g}: expected a number of seconds > 0")
    if fmt is None:
        if not os.path.isfile(path):
            return _err(f"{path}: trace file not found")
        fmt = sniff_format(path)
        if fmt is None:
            return _err(f"{path}: cannot tell its format from its first line; give --format "
                        f"({', '.join(TRACE_FORMATS)})")
    try:
        trace = read_trace(path, fmt)
    except TraceError as e:
        return _err(str(e))
    stats = trace_stats(trace, bin_s)
    out = None
    if not no_plot:
        out = plot or os.path.join(PLOT_DIR, f"{os.path.splitext(os.path.basename(path))[0]}-stats.png")
        try:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            out = plot_stats(stats, trace, out)
        except OSError as e:
            return _err(f"--plot {out}: cannot write it ({e.strerror})")
    if json_:
        print(dumps({**stats.to_dict(), "plot": out}, indent=2))
        return 0
    # deferred: rich
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 110)
    t = Table(title=escape(f"{path} ({fmt})"), title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for label, text in describe(stats):
        t.add_row(label, escape(text))
    console.print(t)
    if out:
        print(f"plot: {out}")
    elif not no_plot:
        print("note: matplotlib is not installed; no plot (pip install 'pdlab[plots]')", file=sys.stderr)
    return 0
