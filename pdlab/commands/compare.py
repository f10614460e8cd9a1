"""`pdlab compare RUN [RUN ...]`: table (or --json) and optional plots across runs."""

from __future__ import annotations

import sys
from typing import Optional


def main(runs: list[str], baseline: Optional[str], json_: bool, plot: Optional[str]) -> int:
    from pdlab.measure.records import RunDirError, dumps, load_run
    from pdlab.report.compare import compare, render

    try:
        loaded = [load_run(p) for p in runs]
        result = compare(loaded, baseline)
    except (RunDirError, ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e) if isinstance(e, (RunDirError, ValueError)) else f"unexpected summary format ({e})"
        print(f"pdlab compare: error: {msg}", file=sys.stderr)
        return 2
    if plot:
        from pdlab.report.plots import write_compare_plots

        written = write_compare_plots(result, loaded, plot)
        if not json_:
            for p in written:
                print(f"wrote {p}")
    if json_:
        print(dumps(result, indent=2))
    else:
        render(result)
    return 0
