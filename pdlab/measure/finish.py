"""The end of a run (complete or cut short): summary.json, trace.json and plots, all from the records on
disk, so `summary.json` is by construction what anyone recomputes from requests.jsonl."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

from pdlab.measure.records import RunDir, load_run
from pdlab.measure.summary import run_info, summarize_run
from pdlab.measure.trace import build_trace
from pdlab.recipe.slo import SLO
from pdlab.report.plots import write_plots


def finalize(rd: RunDir, slo: SLO, grid: Optional[dict[str, Any]] = None, partial: bool = False,
             reason: Optional[str] = None, plots: bool = True, **facts: Any) -> dict:
    """Write summary.json (with `partial`/`reason` when cut short), trace.json and the PNG plots.

    `grid`: variant -> planned rates (see summarize_run); `facts`: what else summarize_run takes (alone,
    relative, prefill_workers, floors, warnings). Returns the summary. Plot failures are reported on stderr
    and never lose the summary or the trace.
    """
    rd.close()  # flush and close the record files before reading them back
    rd.update_env(ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    run = load_run(rd.path)
    summary = summarize_run(run.requests, run.steps, run.transfers, slo, grid=grid, partial=partial, reason=reason,
                            run=run_info(run), **facts)
    rd.write_summary(summary)
    rd.write_trace(build_trace(run.requests, run.steps, run.transfers))
    if plots:
        try:
            run.summary = summary
            write_plots(rd.path, run)
        except Exception as e:  # noqa: BLE001 - plots are a convenience; the measurements are already saved
            print(f"note: plots failed: {e.__class__.__name__}: {e}", file=sys.stderr)
    return summary
