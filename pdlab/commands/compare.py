"""`pdlab compare RUN [RUN ...]`: table (or --json) and optional plots across runs; with --slo-scale, goodput
re-scored from the records at tighter and looser SLOs (pdlab.report.rescore).

Exit codes: 0 the comparison; 2 bad input (one line, nothing printed); 3 the comparison was printed, but a run
it read was cut short or failed (PARTIAL, with the reason, heads the output): its numbers cover only what ran.
"""

from __future__ import annotations

import sys
from typing import Optional

from pdlab.measure.records import RunDirError, dumps

PARTIAL_EXIT = 3


def _error(msg: str) -> int:
    print(f"pdlab compare: error: {msg}", file=sys.stderr)
    return 2


def main(runs: list[str], baseline: Optional[str], json_: bool, plot: Optional[str], rate: Optional[float] = None,
         slo_scale: Optional[str] = None) -> int:
    # deferred: numpy
    from pdlab.report.compare import compare, render
    from pdlab.report.load import load
    from pdlab.report.rescore import parse_scales, rescore_runs

    scales = None
    if slo_scale is not None:
        try:
            scales = parse_scales(slo_scale)
        except ValueError as e:
            return _error(f"--slo-scale {slo_scale!r}: {e}")
    if rate is not None and not (rate > 0):  # NaN fails this too
        return _error(f"--rate {rate:g}: expected a rate > 0 (req/s) that the runs measured, or inf")
    try:
        loaded = [load(p) for p in runs]
        result = compare(loaded, baseline, rate)
        if rate is not None and result["mode"] == "grid" and result["focus_rate"] not in result["rates"]:
            return _error(f"--rate {rate:g}: no run measured this rate; rates: {', '.join(result['rates'])}")
        if scales is not None:
            result["slo_scale"] = rescore_runs([lr.run for lr in loaded], scales)
    except (RunDirError, ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e) if isinstance(e, (RunDirError, ValueError)) else f"unexpected summary format ({e})"
        return _error(msg)
    if rate is not None and result["mode"] == "search":
        print(f"note: --rate {rate:g} is not used: with a rate search the latencies are at each row's goodput",
              file=sys.stderr)
    if plot:
        # deferred: numpy
        from pdlab.report.plots_compare import write_compare_plots

        written = write_compare_plots(result, loaded, plot)
        if not json_:
            for p in written:
                print(f"wrote {p}")
    if json_:
        print(dumps(result, indent=2))
    else:
        render(result)
        if scales is not None:
            # deferred: numpy
            from pdlab.report.rescore import render as render_scales

            render_scales(result["slo_scale"])
    for p in result["partial"]:
        print(f"pdlab compare: {p['run']} is partial: {p['reason']} (exit {PARTIAL_EXIT})", file=sys.stderr)
    return PARTIAL_EXIT if result["partial"] else 0
