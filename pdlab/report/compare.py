"""`pdlab compare`: runs side by side, in the shape of published PD results, readable at 100 columns.

One row per (run, variant). The headline table: goodput (mean ± 95% interval over repeats, ≥ when the
rates tried never failed), goodput relative to a baseline variant, the TPOT-based goodput, and output
tok/s at saturation. The latency table: TTFT p50/p99, ITL p99 and each request's worst gap (the stall it
saw; 90th percentile over requests) at one rate per row (on a grid the *focus rate*: the highest rate
every row measured at which
every row's median TTFT still meets the TTFT target, i.e. before queues run away; `--rate` picks another;
with a rate search, each row's own goodput, its last passing rate), misses by kind and prefill
interruptions summed over the finite rates. Then attainment per rate (grid) or the rates each search tried.

Runs are compared only when they share the SLO and the workload: anything else would judge unrelated
numbers against each other.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

from pdlab.constants import MISS_KINDS
from pdlab.measure.confidence import Estimate, format_estimate
from pdlab.measure.metrics import as_rate
from pdlab.measure.records import Run
from pdlab.measure.summary import summarize_run
from pdlab.recipe.slo import SLO
from pdlab.report.verdict import Row, verdict
from pdlab.workload import rate_tag

WIDTH = 100


def _interference(x: dict) -> dict:
    """The engine-side attribution; the client-side one for an engine without step records (vLLM)."""
    if not x.get("steps") and x.get("interference_client"):
        return x["interference_client"]
    return x["interference"]


def describe_deployment(dep: Optional[dict], timing: Optional[dict] = None) -> str:
    """`unified 2x[cpu:0|cpu:1]` or `1P[cpu:0] + 1D[cpu:1] shm push`, from recipe.yaml's deployment. A modelled
    run (`timing`, the variant's resolved profile) names what each worker models, not the stand-in devices
    it ran on: `1P[4 dev: mi300x-...-tp4] + 1D[4 dev: mi300x-...-tp4] nixl push (modelled)`."""
    if not dep:
        return "?"
    if dep.get("endpoint"):  # a running service: what the recipe says it is
        ep = dep["endpoint"]
        return f"{ep.get('label') or 'endpoint'} ({ep.get('kind', '?')}, {ep.get('devices', '?')} dev)"
    modelled = f"{int(timing.get('devices') or 1)} dev: {timing.get('name') or 'profile'}" if timing else None

    def group(g: dict) -> str:
        tp = f" TP{g['tp']}" if g.get("tp", 1) > 1 and not timing else ""
        return f"[{modelled or '|'.join(map(str, g.get('devices', [])))}]{tp}"

    note = " (modelled)" if timing else ""
    if dep.get("kind") == "unified":
        u = dep["unified"]
        return f"unified {u.get('replicas', 1)}x{group(u)}{note}"
    p, d = dep.get("prefill", {}), dep.get("decode", {})
    return (f"{p.get('replicas', 1)}P{group(p)} + {d.get('replicas', 1)}D{group(d)} "
            f"{dep.get('transport', '?')} {dep.get('mode', '?')}{note}")


def count_devices(dep: Optional[dict], timing: Optional[dict] = None) -> Optional[int]:
    """Devices a deployment (recipe.yaml's) uses: the denominator of goodput per device. Distinct devices of a
    real run; of a modelled one (`timing`, the variant's resolved profile), its workers times the devices one
    modelled instance spans (the profile's `devices`), whatever stand-in devices the workers ran on."""
    from pdlab.devices import parse_devices

    if not dep:
        return None
    if dep.get("endpoint"):
        return int(dep["endpoint"].get("devices") or 0) or None
    if timing:
        workers = sum(int((dep.get(role) or {}).get("replicas") or 1) for role in ("unified", "prefill", "decode")
                      if dep.get(role))
        return workers * int(timing.get("devices") or 1) or None
    try:
        return len({d for role in ("unified", "prefill", "decode") for spec in (dep.get(role) or {}).get("devices", [])
                    for d in parse_devices(str(spec))}) or None
    except ValueError:
        return None


def _summary(run: Run) -> dict:
    s = run.summary
    if s.get("variants") and "goodput" in next(iter(s["variants"].values())):
        return s
    slo = s.get("slo") or run.recipe.get("slo")  # summary missing (run cut short): recompute from records
    if not slo or not run.requests or slo.get("ttft_ms") is None:
        return {"variants": {}, "partial": True, "slo": slo, "reason": s.get("reason")}
    return summarize_run(run.requests, run.steps, run.transfers, SLO.from_raw(slo, "slo"), partial=True,
                         reason=s.get("reason", "summary recomputed from records"))


def _est(d: Optional[dict]) -> Estimate:
    return Estimate.from_dict(d) if d else Estimate(None, None, None, 0, ())


def _check_comparable(runs: list[Run]) -> None:
    """One line and a refusal when the runs were judged by different SLOs or fed different workloads."""
    first = runs[0]
    for run in runs[1:]:
        for what, a, b in (("SLO", _summary(first).get("slo"), _summary(run).get("slo")),
                           ("workload", first.recipe.get("workload"), run.recipe.get("workload")),
                           ("seed", first.recipe.get("seed"), run.recipe.get("seed"))):
            if a != b:
                raise ValueError(f"cannot compare {first.name} with {run.name}: different {what} "
                                 f"({a} vs {b}); compare runs of one recipe, or rerun with the same {what}")


def rows_of(runs: list[Run], rate: Optional[float] = None) -> list[dict]:
    rows = []
    for run in runs:
        s = _summary(run)
        for v, vs in s["variants"].items():
            entry = (run.recipe.get("variants") or {}).get(v) or {}  # the variant as resolved in recipe.yaml
            dep = entry.get("deployment")
            timing = (entry.get("model") or run.recipe.get("model") or {}).get("timing")
            backend = (entry.get("engine") or {}).get("backend")
            ep, url = (dep or {}).get("endpoint"), (entry.get("engine") or {}).get("url")
            if ep and not ep.get("label") and url:  # unnamed: by its host, as the run's live view named it
                dep = dict(dep, endpoint=dict(ep, label=url.split("//", 1)[-1].split("/", 1)[0]))
            if backend not in (None, "pdlab") and (dep or {}).get("transport"):
                dep = dict(dep, transport="nixl")  # an external engine's own connector (docs/external.md)
            finite = [x for t, x in vs["rates"].items() if t != "inf"]
            misses = {k: sum(x["misses"][k] for x in finite) for k in MISS_KINDS}
            g = vs["goodput"]
            rows.append({
                "label": v if len(runs) == 1 else f"{run.name}/{v}", "run": run.path, "variant": v,
                "config": describe_deployment(dep, timing if isinstance(timing, dict) else None)
                + (f" on {backend}" if backend not in (None, "pdlab", "endpoint") else ""),
                "kind": (dep or {}).get("kind", "?"),
                "ran": bool(vs.get("ran", True)), "partial": bool(s.get("partial")), "slo": s.get("slo"),
                "goodput": g, "goodput_tpot": vs["goodput_tpot"],
                "devices": count_devices(dep, timing if isinstance(timing, dict) else None),
                "saturation_tok_s": (vs.get("saturation") or {}).get("output_tok_s"),
                "met": {t: [x["slo_met"], x["sent"]] for t, x in vs["rates"].items()},
                "attainment": {t: x["over_repeats"]["attainment"] for t, x in vs["rates"].items()},
                "trials": [[t["rate"] for t in rep["goodput"]["trials"]] for rep in vs.get("repeats", [])],
                "misses": misses, "sent": sum(x["sent"] for x in finite),
                "prefill_routes": _sum_counts(x.get("prefill_routes") or {} for x in finite),
                "itl_misses": misses["itl_only"] + misses["both"], "ttft_misses": misses["ttft_only"] + misses["both"],
                "prefill_interruptions": sum(_interference(x)["prefill_interruptions"] for x in finite),
                "mdl1": [m for m in ((vs.get("mdl1") or {}).get("repeats") or [])],
                "_vs": vs,
            })
    return rows


def _sum_counts(counts: Any) -> dict:
    out: dict = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


def _focus(rows: list[dict], slo: Optional[dict]) -> Optional[str]:
    """The highest rate every row measured at which every row's median TTFT meets the TTFT target."""
    common = [t for t in sorted({t for r in rows for t in r["met"]}, key=as_rate)
              if t != "inf" and all(t in r["met"] for r in rows)]
    if not common:
        return None
    target = (slo or {}).get("ttft_ms") or math.inf
    calm = [t for t in common if all((r["_vs"]["rates"][t]["ttft_ms"]["p50"] or math.inf) <= target for r in rows)]
    return (calm or common[:1])[-1]


def _latencies(vs: dict, tag: Optional[str], search: bool) -> Optional[dict]:
    if search:
        a = vs.get("at_goodput")
        return None if not a else {k: a[k] for k in a if k.endswith("_ms")} | {"at": a["rates"]}
    x = vs["rates"].get(tag) if tag else None
    return None if x is None else {k: v for k, v in x["over_repeats"].items() if k.endswith("_ms")} | {"at": [tag]}


def compare(runs: list[Run], baseline: Optional[str] = None, rate: Optional[float] = None) -> dict:
    """The comparison as plain data (what --json prints). Raises ValueError for runs that cannot be compared
    or an unknown baseline."""
    _check_comparable(runs)
    rows = rows_of(runs)
    if not rows:
        raise ValueError("no variants with results in these runs")
    if baseline is not None:
        match = [r for r in rows if baseline in (r["label"], r["variant"])]
        if not match:
            raise ValueError(f"baseline {baseline!r} not found; rows are: {', '.join(r['label'] for r in rows)}")
        base = match[0]
    else:
        base = next((r for r in rows if r["kind"] == "unified" and r["ran"]), rows[0])
    search = all(r["_vs"].get("mode") == "search" for r in rows)
    focus = None if search else (rate_tag(rate) if rate is not None else _focus([r for r in rows if r["ran"]],
                                                                                base["slo"]))
    for r in rows:
        bm, rm = base["goodput"]["mean"], r["goodput"]["mean"]
        r["relative_goodput"] = rm / bm if rm is not None and bm else None
        r["goodput_per_device"] = rm / r["devices"] if rm is not None and r["devices"] else None
        r["latencies"] = _latencies(r.pop("_vs"), focus, search)
    verdicts = [verdict(_row(base), _row(r)) for r in rows if r is not base]
    warnings = [(f"{run.name}: " if len(runs) > 1 else "") + w
                for run in runs for w in _summary(run).get("warnings") or []]
    modelled = {(f"{run.name}/" if len(runs) > 1 else "") + v: d
                for run in runs for v, d in (_summary(run).get("modelled") or {}).items()}
    return {"baseline": base["label"], "mode": "search" if search else "grid", "focus_rate": focus,
            "modelled": modelled,
            "rates": sorted({t for r in rows for t in r["met"]}, key=as_rate), "slo": base["slo"], "rows": rows,
            "verdict": verdicts, "warnings": warnings}


def _row(r: dict) -> Row:
    g = r["goodput"]
    return Row(r["label"], r["kind"], r["ran"], r["partial"], _est(g), open_above=bool(g.get("open_above")),
               open_below=bool(g.get("open_below")), capped=bool(g.get("capped")), itl_misses=r["itl_misses"],
               ttft_misses=r["ttft_misses"], prefill_interruptions=r["prefill_interruptions"],
               throughput=_est(r["saturation_tok_s"]) if r["saturation_tok_s"] else None,
               ttft_p50=_est(r["latencies"]["ttft_p50_ms"]) if r.get("latencies") else None)


def _f(x: Optional[float], fmt: str = "{:.0f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _goodput_cell(g: dict) -> str:
    """'1.40 ± 0.12', '≥ 4.00' (a lower bound), '3.90 ± 0.20 sat' (held to the saturation throughput)."""
    return ("≥ " if g.get("open_above") else "") + format_estimate(_est(g)) + (" sat" if g.get("capped") else "")


def render(result: dict, console: Any = None) -> None:
    """Print the comparison with rich, in tables that read at 100 columns."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else WIDTH)
    for label, what in (result.get("modelled") or {}).items():
        console.print(f"[bold]MODELLED[/bold] {escape(label)}: {escape(what)}; its times are not this machine's")
    slo = result["slo"] or {}
    console.print(f"SLO per request: TTFT ≤ {_f(slo.get('ttft_ms'))} ms and ITL {slo.get('itl_stat', '?')} ≤ "
                  f"{_f(slo.get('itl_ms'))} ms; goodput = highest rate with "
                  f"≥ {_f((slo.get('attainment') or 0) * 100)}% "
                  f"of requests meeting both · baseline {result['baseline']}")
    t = Table(box=box.SIMPLE_HEAD, title="goodput (req/s, mean ± 95% interval over repeats; sat: held to the "
                                         "saturation throughput)", title_justify="left")
    for name, just in (("configuration", "left"), ("goodput", "right"), ("rel.", "right"), ("/device", "right"),
                       ("TPOT goodput", "right"), ("out tok/s @sat", "right")):
        t.add_column(name, justify=just)
    for r in result["rows"]:
        g, gt = r["goodput"], r["goodput_tpot"]
        state = "" if r["ran"] and not r["partial"] else (" (not run)" if not r["ran"] else " (partial)")
        t.add_row(f"[bold]{escape(r['label'])}[/bold]{state}\n{escape(r['config'])}", _goodput_cell(g),
                  _f(r["relative_goodput"], "{:.2f}×"), _f(r["goodput_per_device"], "{:.2f}"), _goodput_cell(gt),
                  format_estimate(_est(r["saturation_tok_s"]), "{:.0f}") if r["saturation_tok_s"] else "—")
    console.print(t)
    where = ("at each row's goodput" if result["mode"] == "search" else f"at {result['focus_rate']} req/s"
             if result["focus_rate"] else "no finite rate measured by every row")
    lt = Table(box=box.SIMPLE_HEAD, title=f"latency (ms, mean ± 95% interval over repeats, {where}; stall: each "
                                          "request's longest gap, p90 over requests) and misses (finite rates)",
               title_justify="left")
    for name in ("variant", "TTFT p50", "TTFT p99", "ITL p99", "stall p90", "misses t/i/b/f", "prefill intr."):
        lt.add_column(name, justify="left" if name == "variant" else "right")
    for r in result["rows"]:
        lat, m = r["latencies"], r["misses"]
        cells = [format_estimate(_est(lat[k]), "{:.0f}") if lat else "—"
                 for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "worst_gap_p90_ms")]
        misses = f"{m['ttft_only']}/{m['itl_only']}/{m['both']}/{m['failed']} of {r['sent']}"
        lt.add_row(escape(r["label"]), *cells, misses, str(r["prefill_interruptions"]))
    console.print(lt)
    routed = [r for r in result["rows"] if set(r.get("prefill_routes") or {}) - {"unified", "remote"}]
    if routed:  # selective routing or recomputed hand-overs: say where the prompts were prefilled
        console.print("where prompts were prefilled (finite rates; local: on the decode worker by choice, "
                      "recompute: there again after a failed hand-over):")
        for r in routed:
            console.print(f"  {escape(r['label'])}: " + ", ".join(f"{k} {n}" for k, n in r["prefill_routes"].items()))
    if result["mode"] == "search":
        for r in result["rows"]:
            tried = "; ".join(", ".join(f"{x:g}" for x in t) for t in r["trials"]) or "—"
            console.print(f"  {escape(r['label'])}: rates tried per repeat: {tried}")
    else:
        at = Table(box=box.SIMPLE_HEAD, title="SLO met / sent by rate (all repeats)", title_justify="left")
        at.add_column("variant")
        for tag in result["rates"]:
            at.add_column(f"@{tag}", justify="right")
        for r in result["rows"]:
            at.add_row(escape(r["label"]), *[f"{r['met'][tag][0]}/{r['met'][tag][1]}" if tag in r["met"] else "—"
                                     for tag in result["rates"]])
        console.print(at)
    md = [(r["label"], m) for r in result["rows"] for m in r["mdl1"][:1] if m.get("predicted_ms") is not None]
    if md:
        console.print("M/D/1 at each row's lowest rate (first repeat; D = one request alone on that deployment):")
        for label, m in md:
            flag = ("" if not m["flag"] else "  [bold]FLAG: the harness or interference sets TTFT[/bold]"
                    if m["deviation"] > 0 else "  [bold]FLAG: below D alone: D does not describe this load[/bold]")
            note = f" ({m['note']})" if m.get("note") else ""
            console.print(f"  {escape(label)} @ {m['rate']:g} req/s, D {m['alone_ttft_ms']:.0f} ms, "
                          f"rho {m['rho']:.2f}: predicted "
                          f"{m['predicted_ms']:.0f} ms, measured {_f(m['measured_ms'])} ms "
                          f"({_f(100 * (m['deviation'] or 0), '{:+.0f}')}%){escape(note)}{flag}")
    for line in result["verdict"]:
        console.print(f"• {escape(line)}")
    for w in result.get("warnings") or []:
        console.print(f"[dim]warning: {escape(w)}[/dim]")
