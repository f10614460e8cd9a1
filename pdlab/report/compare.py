"""`pdlab compare`: runs side by side, in the shape of published PD results.

One row per (run, variant): configuration, SLO-met requests / sent at each rate, goodput and goodput
relative to a baseline variant, output tok/s at saturation (the `inf` rate; the highest rate when the
grid has none, marked), TTFT and ITL p50/p99 at the *focus rate* (the highest finite rate every row
measured: where the variants differ most), misses by kind and prefill interruptions summed over the
finite rates (the saturation point is left out: there every request queues by construction).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

from pdlab.measure.metrics import as_rate, summarize_run
from pdlab.measure.records import Run
from pdlab.recipe.slo import SLO
from pdlab.workload import rate_tag


def describe_deployment(dep: Optional[dict]) -> str:
    """`unified 2x[cpu:0|cpu:1]` or `1P[cpu:0] + 1D[cpu:1] shm push`, from recipe.yaml's deployment."""
    if not dep:
        return "?"
    if dep.get("kind") == "unified":
        u = dep["unified"]
        return f"unified {u.get('replicas', 1)}x[{'|'.join(map(str, u.get('devices', [])))}]"
    p, d = dep.get("prefill", {}), dep.get("decode", {})
    return (f"{p.get('replicas', 1)}P[{'|'.join(map(str, p.get('devices', [])))}] + "
            f"{d.get('replicas', 1)}D[{'|'.join(map(str, d.get('devices', [])))}] "
            f"{dep.get('transport', '?')} {dep.get('mode', '?')}")


def _summary(run: Run) -> dict:
    s = run.summary
    if s.get("variants"):
        return s
    slo = s.get("slo") or run.recipe.get("slo")  # summary missing (run cut short): recompute from records
    if not slo or not run.requests:
        return {"variants": {}, "partial": True}
    return summarize_run(run.requests, run.steps, run.transfers, SLO.from_raw(slo, "slo"), partial=True,
                         reason=s.get("reason", "summary recomputed from records"))


def rows_of(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        s = _summary(run)
        for v, vs in s["variants"].items():
            dep = ((run.recipe.get("variants") or {}).get(v) or {}).get("deployment")
            label = v if len(runs) == 1 else f"{run.name}/{v}"
            rates = {tag: x for tag, x in vs["rates"].items()}
            finite = [x for t, x in rates.items() if t != "inf"]
            misses = {k: sum(x["misses"][k] for x in finite) for k in ("ttft_only", "itl_only", "both", "failed")}
            sat = rates.get("inf")
            sat_note = "inf"
            if sat is None and finite:
                sat = max(finite, key=lambda x: as_rate(x["rate"]))
                sat_note = rate_tag(as_rate(sat["rate"]))
            rows.append({
                "label": label, "run": run.path, "variant": v, "config": describe_deployment(dep),
                "kind": (dep or {}).get("kind", "?"),  # recipe.yaml records it
                "partial": bool(s.get("partial")), "slo": s.get("slo"),
                "met": {t: [x["slo_met"], x["sent"]] for t, x in rates.items()},
                "goodput": vs["goodput"]["goodput"], "goodput_lower_bound": vs["goodput"]["lower_bound"],
                "output_tok_s": sat["output_tok_s"] if sat else None, "output_tok_s_at": sat_note,
                "misses": misses, "itl_misses": misses["itl_only"] + misses["both"],
                "ttft_misses": misses["ttft_only"] + misses["both"],
                "prefill_interruptions": sum(x["interference"]["prefill_interruptions"] for x in finite),
                "_rates": rates,
            })
    return rows


def _pct(new: Optional[float], old: Optional[float]) -> Optional[float]:
    return None if new is None or not old else (new - old) / old


def verdict(base: dict, row: dict) -> str:
    """One sentence from the numbers: what the candidate bought against the baseline."""
    thr = _pct(row["output_tok_s"], base["output_tok_s"])
    thr_s = "throughput n/a" if thr is None else f"throughput {thr * 100:+.0f}%".replace("-", "−")
    g = row["relative_goodput"]
    g_s = "goodput n/a" if g is None else f"goodput {g:.2f}×"
    nums = (f"ITL misses {base['itl_misses']} → {row['itl_misses']}, "
            f"TTFT misses {base['ttft_misses']} → {row['ttft_misses']}, {thr_s}, {g_s}")
    head = f"{row['label']} vs {base['label']}: "
    if base["itl_misses"] == 0 and base["prefill_interruptions"] == 0:
        return head + f"no ITL problem at these rates: the unified engine is enough ({nums})"
    better = g is not None and g > 1.05
    if row["itl_misses"] < base["itl_misses"] and better:
        what = "predictability and capacity" if thr is not None and thr > 0.05 else "predictability, not capacity"
        who = "disaggregation" if row["kind"] == "disagg" else row["variant"]
        moved = "; the bottleneck moved to TTFT" if row["ttft_misses"] > base["ttft_misses"] else ""
        return head + f"{nums}: {who} bought {what}{moved}"
    if row["itl_misses"] < base["itl_misses"]:
        return head + f"{nums}: fewer ITL misses, but no goodput gain at this SLO"
    return head + f"{nums}: no gain over the baseline here"


def compare(runs: list[Run], baseline: Optional[str] = None) -> dict:
    """The comparison as plain data (what --json prints). Raises ValueError for an unknown baseline."""
    rows = rows_of(runs)
    if not rows:
        raise ValueError("no variants with results in these runs")
    if baseline is not None:
        match = [r for r in rows if baseline in (r["label"], r["variant"])]
        if not match:
            raise ValueError(f"baseline {baseline!r} not found; rows are: {', '.join(r['label'] for r in rows)}")
        base = match[0]
    else:
        base = next((r for r in rows if r["kind"] == "unified"), rows[0])
    tags = sorted({t for r in rows for t in r["met"]}, key=as_rate)
    common = [t for t in tags if t != "inf" and all(t in r["met"] for r in rows)]
    focus = common[-1] if common else None
    for r in rows:
        r["relative_goodput"] = (r["goodput"] / base["goodput"]) if r["goodput"] is not None and base["goodput"] else None
        x = r.pop("_rates").get(focus) if focus else None
        r["focus"] = None if x is None else {"ttft_ms": {k: x["ttft_ms"][k] for k in ("p50", "p99")},
                                             "itl_ms": {k: x["itl_ms"][k] for k in ("p50", "p99")}}
    return {"baseline": base["label"], "rates": tags, "focus_rate": focus, "slo": base["slo"], "rows": rows,
            "verdict": [verdict(base, r) for r in rows if r is not base]}


def _f(x: Optional[float], fmt: str = "{:.0f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render(result: dict, console: Any = None) -> None:
    """Print the comparison table and verdict with rich."""
    from rich.console import Console
    from rich.table import Table

    # Off a terminal (pipes, CI logs) rich would squeeze the table into 80 columns: give it room.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    slo = result["slo"] or {}
    title = (f"SLO: TTFT ≤ {_f(slo.get('ttft_ms'))} ms, ITL {slo.get('itl_stat', '?')} ≤ {_f(slo.get('itl_ms'))} ms, "
             f"attainment ≥ {_f((slo.get('attainment') or 0) * 100)}%   ·   latencies at {result['focus_rate']} req/s   "
             f"·   baseline {result['baseline']}")
    t = Table(title=title, title_justify="left")
    t.add_column("configuration")
    for tag in result["rates"]:
        t.add_column(f"met @{tag}", justify="right")
    for name in ("goodput", "rel.", "out tok/s sat", "TTFT p50/p99", "ITL p50/p99", "misses ttft/itl/both/fail",
                 "prefill intr."):
        t.add_column(name, justify="right")
    for r in result["rows"]:
        met = [f"{r['met'][tag][0]}/{r['met'][tag][1]}" if tag in r["met"] else "—" for tag in result["rates"]]
        m = r["misses"]
        fo = r["focus"] or {"ttft_ms": {"p50": None, "p99": None}, "itl_ms": {"p50": None, "p99": None}}
        sat = _f(r["output_tok_s"], "{:.1f}") + ("" if r["output_tok_s_at"] == "inf" else f" (@{r['output_tok_s_at']})")
        t.add_row(
            f"[bold]{r['label']}[/bold]{' (partial)' if r['partial'] else ''}\n{r['config']}", *met,
            ("≥" if r["goodput_lower_bound"] else "") + _f(r["goodput"], "{:.2f}"),
            _f(r["relative_goodput"], "{:.2f}×"), sat,
            f"{_f(fo['ttft_ms']['p50'])}/{_f(fo['ttft_ms']['p99'])}", f"{_f(fo['itl_ms']['p50'])}/{_f(fo['itl_ms']['p99'])}",
            f"{m['ttft_only']}/{m['itl_only']}/{m['both']}/{m['failed']}", str(r["prefill_interruptions"]))
    console.print(t)
    for line in result["verdict"]:
        console.print(f"• {line}")
