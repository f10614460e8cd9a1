"""`pdlab report RUN [RUN ...] --html OUT`: one self-contained HTML file (tables, verdict, plots, environment,
warnings, recipe) of the runs, as pdlab compare judges them (pdlab.report.html).

Exit codes as pdlab compare's: 0 written; 2 bad input (one line, nothing written); 3 written, but a run was cut
short or failed (the report's PARTIAL banner says why).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from pdlab.commands.compare import PARTIAL_EXIT
from pdlab.measure.records import RunDirError, atomic_write
from pdlab.report.plot_style import pyplot


def _error(msg: str) -> int:
    print(f"pdlab report: error: {msg}", file=sys.stderr)
    return 2


def main(runs: list[str], html: str, baseline: Optional[str] = None, rate: Optional[float] = None) -> int:
    # deferred: numpy
    from pdlab.report.compare import compare
    from pdlab.report.html import figure_png, render_html
    from pdlab.report.load import load

    if rate is not None and not (rate > 0):
        return _error(f"--rate {rate:g}: expected a rate > 0 (req/s) that the runs measured, or inf")
    where = os.path.dirname(os.path.abspath(html))
    if os.path.isdir(html) or not os.path.isdir(where):
        return _error(f"--html {html}: expected a file path in an existing directory")
    try:
        loaded = [load(p) for p in runs]
        result = compare(loaded, baseline, rate)
    except (RunDirError, ValueError, KeyError, TypeError) as e:
        return _error(str(e) if isinstance(e, (RunDirError, ValueError)) else f"unexpected summary format ({e})")
    plots = []

    plt = pyplot()
    if plt is not None:
        # deferred: numpy
        from pdlab.report.plots import attainment_figure, run_figures

        for lr in loaded:
            plots += [(f"{lr.name}: {name}", figure_png(fig)) for name, fig in run_figures(plt, lr)]
        if len(loaded) > 1:
            plots.append(("all runs: attainment vs rate", figure_png(attainment_figure(
                plt, result, "SLO attainment vs rate across runs"))))
    atomic_write(html, render_html(loaded, result, plots))
    print(f"wrote {html}")
    for p in result["partial"]:
        print(f"pdlab report: {p['run']} is partial: {p['reason']} (exit {PARTIAL_EXIT})", file=sys.stderr)
    return PARTIAL_EXIT if result["partial"] else 0
