"""What compare shows, as data: header lines, tables with their footnotes, the M/D/1 lines and the verdicts,
built once from the compare result (pdlab.report.compare) and written by two renderers: the terminal (rich, at
100 columns: pdlab.report.terminal) and the HTML report (pdlab.report.html).

Tables keep to figures; what a row *is* goes in a footnote keyed by the variant (its devices, transport,
engine knobs), and every abbreviation or mark used in a table is defined in one line under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdlab.report.stats import Stat, legend

MISS_LEGEND = ("TTFT only / ITL only: missed that target alone; both: missed both; failed: an error or no token; "
               "prefill intr.: ITL gaps over target that overlap a prefill step of the decoding worker")
GOODPUT_LEGEND = ("≥: a lower bound (no rate tried failed); < r: every rate tried failed, the lowest was r; "
                  "sat: held to the saturation throughput; rel.: against the row's baseline (?: both are lower "
                  "bounds, no ratio)")


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()  # lines under the table: legends, then footnotes keyed by variant


@dataclass(frozen=True)
class Line:
    """A header line; `kind` says how loud: partial, box, modelled, info."""

    kind: str
    text: str


def _f(x: Optional[float], fmt: str = "{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def goodput_cell(g: dict) -> str:
    """A row's goodput dict (pdlab.report.rows.Goodput.to_dict) as its table cell."""
    if g["bound"] == "below" and g["lowest_fail"] is not None:
        return f"< {g['lowest_fail']:.2f}"
    return ("≥ " if g["bound"] == "lower" else "") + Stat.of(g).cell() + (" sat" if g["capped"] else "")


def _ratio_cell(r: dict) -> str:
    x, bound = r["relative_goodput"], r["relative_bound"]
    if x is None or r["baseline"] == r["label"]:
        return "—" if x is None else "1.00×"
    return "?" if bound == "unknown" else {"lower": "≥ ", "upper": "≤ "}.get(bound, "") + f"{x:.2f}×"


def header(result: dict) -> list[Line]:
    out = [Line("partial", f"PARTIAL {p['run']}: {p['reason']}") for p in result["partial"]]
    out += [Line("box", "BOX: " + x.replace("the box: ", "", 1)) for x in result["box"]]
    same: dict[str, list[str]] = {}  # one line per timing model, naming the variants it times
    for label, what in result["modelled"].items():
        same.setdefault(what, []).append(label)
    out += [Line("modelled", f"MODELLED {', '.join(labels)}: {what}; its times are not this machine's")
            for what, labels in same.items()]
    for run in result["runs"]:
        facts = [f"recipe {run['recipe'] or '?'}", f"{run['started'] or '?'} → {run['ended'] or '?'}",
                 f"CPU {run['cpu_model'] or '?'}", f"summary schema {run['schema_version']}"]
        out.append(Line("info", f"{run['name']}: " + ", ".join(facts) + (", simulated" if run["simulated"] else "")))
    kernels: dict[str, list[str]] = {}  # one line per set of kernels, naming the variants that ran it
    for label, what in result["kernels"].items():
        kernels.setdefault(what, []).append(label)
    out += [Line("info", f"CPU kernels of {', '.join(labels)}: {what}") for what, labels in kernels.items()]
    out += [Line("info", t) for t in result["traces"]]
    if result["plan"]:
        p = result["plan"]
        best = ", ".join(f"{r['candidate']} {_f(r['goodput']['mean'], '{:.2f}')}" for r in p["ranking"][:3])
        out.append(Line("info", f"planned by pdlab plan: {len(p['ranking'])} deployments ranked for {p['devices']} "
                                f"devices (plan.json; simulated req/s: {best}, ...)"))
    slo = result["slo"] or {}
    if slo:
        out.append(Line("info", f"SLO per request: TTFT ≤ {_f(slo['ttft_ms'])} ms and ITL {slo['itl_stat']} ≤ "
                                f"{_f(slo['itl_ms'])} ms; goodput: the highest rate at which ≥ "
                                f"{slo['attainment'] * 100:.0f}% of requests meet both"))
    bases = sorted(set(result["baselines"].items()))
    out.append(Line("info", "baseline: " + ", ".join(f"{b} ({e})" if len(bases) > 1 else b for e, b in bases)
                    if bases else "nothing was measured: no variant has results"))
    return out


def _label(r: dict) -> str:
    return r["label"] + ("" if r["ran"] and not r["partial"] else " (not run)" if not r["ran"] else " (partial)")


def _goodput(result: dict) -> Table:
    rows = tuple((_label(r), goodput_cell(r["goodput"]), _ratio_cell(r), _f(r["goodput_per_device"], "{:.2f}"),
                  goodput_cell(r["goodput_tpot"]),
                  Stat.of(r["saturation_tok_s"]).cell("{:.0f}") if r["saturation_tok_s"] else "—")
                 for r in result["rows"])
    stats = [Stat.of(r[k]) for r in result["rows"] for k in ("goodput", "goodput_tpot", "saturation_tok_s")]
    notes = (GOODPUT_LEGEND, *legend(stats), *[f"{r['label']}: {r['config']}" for r in result["rows"]])
    return Table("goodput (req/s, mean ± 95% interval over repeats)",
                 ("variant", "goodput", "rel.", "/device", "TPOT goodput", "out tok/s @sat"), rows, notes)


def _latency(result: dict) -> Table:
    where = ("at each row's goodput" if result["mode"] == "search" else f"at {result['focus_rate']} req/s"
             if result["focus_rate"] else "no finite rate measured by every row")
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "worst_gap_p90_ms")
    rows = tuple((r["label"], *[Stat.of(r["latencies"][k]).cell("{:.0f}") if r["latencies"] else "—" for k in keys])
                 for r in result["rows"])
    return Table(f"latency (ms, mean ± 95% interval over repeats, {where})",
                 ("variant", "TTFT p50", "TTFT p99", "ITL p99", "stall p90"), rows,
                 ("stall: each request's longest gap, p90 over requests",
                  *legend(Stat.of(r["latencies"][k]) for r in result["rows"] if r["latencies"] for k in keys)))


def _misses(result: dict) -> Table:
    rows = tuple((r["label"], str(r["sent"]), *[str(r["misses"][k]) for k in ("ttft_only", "itl_only", "both",
                                                                               "failed")],
                  str(r["prefill_interruptions"])) for r in result["rows"])
    return Table("misses (requests, summed over the finite rates and all repeats)",
                 ("variant", "sent", "TTFT only", "ITL only", "both", "failed", "prefill intr."), rows, (MISS_LEGEND,))


def _attainment(result: dict) -> Table:
    if result["mode"] == "search":
        rows = tuple((r["label"], "; ".join(", ".join(f"{x:g}" for x, _ in t) for t in r["trials"]) or "—")
                     for r in result["rows"])
        return Table("rates tried by each search (req/s, per repeat)", ("variant", "rates tried"), rows)
    rows = tuple((r["label"], *[f"{r['met'][t][0]}/{r['met'][t][1]}" if t in r["met"] else "—"
                                for t in result["rates"]]) for r in result["rows"])
    return Table("SLO met / sent by rate (all repeats)", ("variant", *[f"@{t}" for t in result["rates"]]), rows)


def tables(result: dict) -> list[Table]:
    """The four tables; none when nothing was measured."""
    if not result["rows"]:
        return []
    return [_goodput(result), _latency(result), _misses(result), _attainment(result)]


def routes(result: dict) -> list[str]:
    """Where prompts were prefilled, for rows that prefilled anywhere but where their layout says."""
    return [f"{r['label']}: " + ", ".join(f"{k} {n}" for k, n in r["prefill_routes"].items())
            for r in result["rows"] if set(r["prefill_routes"]) - {"unified", "remote"}]


def mdl1_lines(result: dict) -> list[str]:
    """One M/D/1 line per row: the check, or why there is none."""
    out = []
    for r in result["rows"]:
        m = r["mdl1"]
        if m is None:
            why = ("did not run" if not r["ran"] else "no finite rate measured" if not r["met"] or set(r["met"]) ==
                   {"inf"} else "an endpoint: how many servers prefill behind it is not known here"
                   if r["engine"] == "endpoint" else "no one-request-alone figure for it (simulated runs measure none)"
                   if r["timing"] == "simulated" else "no one-request-alone figure for it")
            out.append(f"{r['label']}: no check: {why}")
        elif m["predicted_ms"] is None:
            out.append(f"{r['label']}: {m['rate']:g} req/s, ρ {m['rho']:.2f}: no check: load too high for it")
        else:
            flag = ("" if not m["flag"] else "  FLAG: the harness or interference sets TTFT" if m["deviation"] > 0
                    else "  FLAG: below D alone: D does not describe this load")
            out.append(f"{r['label']}: {m['rate']:g} req/s, D {m['alone_ttft_ms']:.0f} ms, ρ {m['rho']:.2f}: "
                       f"predicted {m['predicted_ms']:.0f} ms, measured {_f(m['measured_ms'])} ms "
                       f"({_f(None if m['deviation'] is None else 100 * m['deviation'], '{:+.0f}')}%){flag}")
    return out
