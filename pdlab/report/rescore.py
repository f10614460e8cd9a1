"""Goodput at other SLOs, re-scored from the records without re-running (DistServe's "SLO scale").

At scale s, the TTFT and ITL targets are both multiplied by s; the ITL statistic and the attainment target
stay as declared. Every measured request (warm-up left out) is judged again with
`pdlab.measure.slo.request_slo` from its raw fields (arrival, token_times, ok), attainment is recomputed per
(variant, repeat, rate), goodput per repeat with `pdlab.measure.search.goodput_of` (the all-at-once rate is
saturation, not a point on the curve, as everywhere; its request throughput caps goodput as in the summary,
the same cap at every scale since it does not depend on the SLO), and goodput per variant is the mean and 95%
interval over repeats (`pdlab.measure.confidence.estimate`). Scale 1 therefore reproduces the summary's own
goodput.

The rates are the ones the run measured: a rate search chose its trials at scale 1, so at another scale the
bracket may be coarser, or open (every rate tried passes: `open_above`; the lowest already fails:
`open_below`). A search's floor (the rate at which "fails at the lowest rate" means "cannot be met at all")
is the one the harness used: the default fraction of the repeat's saturation request rate.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, Iterable, Optional, Union

from pdlab.measure.metrics import as_rate, summarize_rate, timings
from pdlab.measure.records import Run
from pdlab.measure.search import RateSearch, goodput_of
from pdlab.measure.slo import request_slo
from pdlab.measure.summary import bounded_estimate
from pdlab.recipe.slo import SLO
from pdlab.report.load import LoadedRun, from_run
from pdlab.report.rows import Goodput

WIDTH = 100


def _groups(requests: Iterable[dict]) -> dict[str, dict[int, dict[float, list[dict]]]]:
    """variant -> repeat -> rate -> measured records (warm-up left out), in the order first seen."""
    g: dict[str, dict[int, dict[float, list[dict]]]] = {}
    for r in requests:
        if "warmup" in r and r["warmup"]:  # written only on warm-up records
            continue
        g.setdefault(r["variant"], {}).setdefault(int(r["repeat"] or 0), {}).setdefault(
            as_rate(r["rate"]), []).append(r)
    return g


def _verdicts(records: list[dict]) -> list[tuple[bool, Optional[float], list[float], Optional[float]]]:
    """(ok, ttft, gaps, tpot) of each record, recomputed from its raw fields as the summary does."""
    out = []
    for r in records:
        ok = bool(r["ok"]) and bool(r["token_times"])
        t = timings(r["arrival"], r["token_times"], r["chunks"] if "chunks" in r else None)  # chunks: HTTP clients
        out.append((ok, t["ttft"], t["itl"], t["tpot"]))
    return out


def attainment(judged: list[tuple[bool, Optional[float], list[float], Optional[float]]], slo: SLO) -> Optional[float]:
    """Requests meeting `slo` / requests sent (failed requests stay in the denominator); None when none."""
    if not judged:
        return None
    return sum(1 for ok, ttft, gaps, tpot in judged if request_slo(ok, ttft, gaps, slo, tpot)["slo_ok"]) / len(judged)


def _estimate(gs: list[dict]) -> dict:
    """Goodput over repeats: the estimate dict, with how far it can be trusted (as in summary.json)."""
    e = bounded_estimate(g["goodput"] for g in gs)
    e.update(open_above=any(g["open_above"] for g in gs), open_below=any(g["open_below"] for g in gs),
             closed=bool(gs) and all(g["closed"] for g in gs), monotonic=all(g["monotonic"] for g in gs),
             capped=any(g["capped"] for g in gs),
             brackets=[[g["last_pass"], g["first_fail"]] for g in gs])
    return e


def _cap(saturation: Optional[list[dict]], slo: SLO) -> Optional[float]:
    """The saturation request throughput of one (variant, repeat), computed as the summary computes it (it
    caps goodput); None without an all-at-once measurement."""
    return summarize_rate(saturation, [], [], slo, math.inf)["request_throughput"] if saturation else None


def rescore(requests: Iterable[dict], slo: SLO, scales: Iterable[float], variants: Optional[list[str]] = None,
            floors: Optional[dict[tuple[str, int], float]] = None) -> dict:
    """Goodput of every variant at every SLO scale, from request records.

    `slo`: the absolute SLO the run applied; `variants`: the order (default: as found in the records; a
    variant without records gets an empty estimate); `floors`: (variant, repeat) -> a rate search's floor.
    Returns {"scales": [...], "slo": {...}, "targets": [{scale, ttft_ms, itl_ms}], "variants": {v: [{"scale",
    "ttft_ms", "itl_ms", "goodput": estimate dict + open_above/open_below/closed/monotonic/capped/brackets,
    "repeats": [per-repeat goodput dicts]}]}}.
    """
    if slo.ttft_ms is None or slo.itl_ms is None:
        raise ValueError("SLO scale needs absolute targets (ttft_ms and itl_ms); this SLO is relative and was "
                         "never resolved")
    scales = [float(s) for s in scales]
    for s in scales:
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"an SLO scale must be a number > 0, got {s:g}")
    groups = _groups(requests)
    names = list(variants) if variants is not None else list(groups)
    judged = {v: {i: {r: _verdicts(recs) for r, recs in reps.items()} for i, reps in groups.get(v, {}).items()}
              for v in names}
    caps = {(v, i): _cap(reps.get(math.inf), slo) for v in names for i, reps in groups.get(v, {}).items()}
    out: dict[str, list[dict]] = {v: [] for v in names}
    targets = []
    for s in scales:
        sl = slo.scaled(s)
        targets.append({"scale": s, "ttft_ms": sl.ttft_ms, "itl_ms": sl.itl_ms})
        for v in names:
            reps = []
            for i in sorted(judged[v]):
                points = [(r, a) for r, recs in judged[v][i].items() if (a := attainment(recs, sl)) is not None]
                reps.append(goodput_of(points, sl.attainment, (floors or {}).get((v, i)), caps[(v, i)]).to_dict())
            out[v].append({"scale": s, "ttft_ms": sl.ttft_ms, "itl_ms": sl.itl_ms, "goodput": _estimate(reps),
                           "repeats": reps})
    return {"scales": scales, "slo": {k: x for k, x in slo.to_raw().items() if k not in ("ttft", "itl")},
            "targets": targets, "variants": out}


def search_floors(summary: dict, target: float) -> dict[tuple[str, int], float]:
    """(variant, repeat) -> the floor of its rate search, for the search-mode variants of a summary: the
    harness's (RateSearch's default fraction of the repeat's saturation request rate)."""
    floors = {}
    for v, vs in summary["variants"].items():
        for rep in vs["repeats"] if vs["mode"] == "search" else []:
            sat = rep["saturation"]["request_throughput"] if rep["saturation"] else None
            if sat and math.isfinite(sat) and sat > 0:
                floors[(v, int(rep["repeat"] or 0))] = RateSearch(target, sat).floor
    return floors


def run_slo(lr: LoadedRun) -> SLO:
    """The absolute SLO a run applied: summary.json's `slo` (resolved), else the recipe's when absolute."""
    raw = lr.summary["slo"]
    slo = SLO.from_raw({k: v for k, v in raw.items() if k in SLO.keys()}, "slo") if raw else (
        lr.recipe.slo if lr.recipe else None)
    if slo is None:
        raise ValueError(f"{lr.name}: no SLO recorded (summary.json and recipe.yaml have none)")
    if slo.relative and (slo.ttft_ms is None or slo.itl_ms is None):
        raise ValueError(f"{lr.name}: the SLO is relative and the run recorded no resolved targets; "
                         "SLO scale needs summary.json's slo")
    return slo.replace(ttft=None, itl=None)


def rescore_run(run: Union[Run, LoadedRun], scales: Iterable[float]) -> dict:
    """`rescore` of one run directory: its SLO, its variants in order, its searches' floors."""
    lr = run if isinstance(run, LoadedRun) else from_run(run)
    slo = run_slo(lr)
    return rescore(lr.run.requests, slo, scales, list(lr.summary["variants"]) or None,
                   search_floors(lr.summary, slo.attainment))


def rescore_runs(runs: list[Union[Run, LoadedRun]], scales: Iterable[float]) -> dict:
    """`rescore` of several runs (of one recipe, as `pdlab compare` requires), rows labelled as compare's:
    `variant` for one run, `run/variant` for several."""
    scales = list(scales)
    result: Optional[dict] = None
    for run in runs:
        one = rescore_run(run, scales)
        if result is None:
            result = {**one, "variants": {}}
        for v, cells in one["variants"].items():
            result["variants"][v if len(runs) == 1 else f"{run.name}/{v}"] = cells
    if result is None:
        raise ValueError("no runs to re-score")
    return result


def parse_scales(text: Optional[str]) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0] (sorted, duplicates dropped). ValueError naming the bad item otherwise."""
    items = [x.strip() for x in (text or "").split(",")]
    if not any(items):
        raise ValueError("expected a comma-separated list of numbers > 0, such as 0.5,1,2; got nothing")
    out = set()
    for x in items:
        try:
            s = float(x)
        except ValueError:
            raise ValueError(f"{x!r} is not a number; expected a comma-separated list of numbers > 0, such as "
                             "0.5,1,2") from None
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"{x!r}: a scale must be a number > 0 and finite (1 = the recipe's SLO)")
        out.add(s)
    return sorted(out)


def cell(g: dict) -> str:
    """'1.40 ± 0.12', '≥ 4.00' (no rate tried failed), '0.00*' (the lowest rate tried failed), '3.90 sat' (held
    to the saturation throughput), '—'; marked † and ‡ as compare's tables are (pdlab.report.stats)."""
    e = Goodput.of(g)
    if e.stat.mean is None:
        return "—"
    return (("≥ " if g["open_above"] else "") + e.stat.cell() + ("*" if g["open_below"] else "")
            + (" sat" if g["capped"] else ""))


def render(result: dict, console: Any = None) -> None:
    """The table: one row per variant, one column per scale."""

    # deferred: rich
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else WIDTH)
    slo = result["slo"]
    console.print(f"SLO scale s: TTFT and ITL targets × s (ITL {slo['itl_stat']}, attainment ≥ "
                  f"{slo['attainment'] * 100:g}% kept), from the records")
    t = Table(box=box.SIMPLE_HEAD, title_justify="left",
              title="goodput by SLO scale (req/s, mean ± 95% interval over repeats)")
    t.add_column("variant")
    for tg in result["targets"]:
        t.add_column(f"×{tg['scale']:g}\n{tg['ttft_ms']:.0f}/{tg['itl_ms']:.4g} ms", justify="right")
    below = capped = False
    for v, cells in result["variants"].items():
        below |= any(c["goodput"]["open_below"] for c in cells)
        capped |= any(c["goodput"]["capped"] for c in cells)
        t.add_row(escape(v), *[cell(c["goodput"]) for c in cells])
    console.print(t)
    console.print("  column heads: TTFT/ITL targets (ms); ≥: no rate tried failed (a lower bound)")
    if below:
        console.print("  *: the lowest rate tried already failed (goodput lies below the rates tried)")
    if capped:
        console.print("  sat: held to the saturation throughput (capacity, not the SLO, limits it)")


def by_scale(result: dict) -> dict[str, dict[float, dict]]:
    """variant -> scale -> goodput dict: a lookup for tests and plots."""
    out: dict[str, dict[float, dict]] = defaultdict(dict)
    for v, cells in result["variants"].items():
        for c in cells:
            out[v][c["scale"]] = c["goodput"]
    return dict(out)
