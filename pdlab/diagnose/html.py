"""`--html FILE`: a diagnosis as one self-contained page a user can attach to a ticket: the verdict, the numbers
it rests on, the two figures (PNG inlined as base64), the plan and what was sent, the endpoint (never its key),
and how a stall is defined. Built from summary.json alone, so an offline diagnosis writes the same page."""

from __future__ import annotations

import base64
from html import escape
from typing import Any, Optional

from pdlab.diagnose.tagging import __doc__ as TAGGING_DOC

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:.9em}th{background:#f4f4f4}
.verdict{padding:.8em 1em;border-left:6px solid #888;background:#fafafa}.prefill_interference{border-color:#c0392b}
.not_prefill_stalls{border-color:#27ae60}.inconclusive{border-color:#999}.partial{background:#fdecea;color:#b00020;
padding:.5em 1em;font-weight:bold}img{max-width:100%}pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap;
font-size:.85em}"""


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _table(rows: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(_fmt(v))}</td></tr>" for k, v in rows) + \
        "</table>"


def _grid(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{escape(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _analysis(a: dict, images: list[tuple[str, bytes]]) -> str:
    v, itl, m, fit, th = a["verdict"], a["itl"], a["misses"], a["fit"], a["threshold"] or {}
    line = fit.get("line") or {}
    corr = a["correlation"]
    out = [f"<h2>{escape(a['label'])}</h2>",
           f"<div class='verdict {escape(v['kind'])}'><b>{escape(v['kind'].replace('_', ' '))}</b>"
           + "".join(f"<p>{escape(s)}</p>" for s in v["sentences"]) + "</div>",
           "<h3>The numbers</h3>",
           _table([("ITL target (ms)", a["itl_target_ms"]), ("steady ITL p50 (ms)", itl["steady_itl_p50_ms"]),
                   ("steady ITL p99 (ms)", itl["steady_itl_p99_ms"]),
                   ("ITL p99 with the probes (ms)", itl["itl_p99_with_probes_ms"]),
                   ("gaps / outside every window", f"{itl['gaps']} / {itl['steady_gaps']}"),
                   ("stall gaps", itl["stall_gaps"]), ("outliers (stand out, in no window)", itl["outliers"]),
                   ("stands out above (ms)", th.get("value_ms")), ("ITL misses", m["misses"]),
                   ("misses in prefill windows", m["in_windows"]), ("share explained by windows", m["explained_share"]),
                   ("miss rate in windows / outside", f"{_fmt(m['miss_rate_in_windows'])} / "
                                                      f"{_fmt(m['miss_rate_outside'])}"),
                   ("stall per 1k prompt tokens (ms)", line.get("stall_ms_per_1k_tokens")),
                   ("fit intercept (ms), R²", f"{_fmt(line.get('intercept_ms'))}, {_fmt(line.get('r2'))}"),
                   ("stalls level off from (tokens), at (ms)", f"{_fmt(fit.get('levels_off_from'))}, "
                                                              f"{_fmt(fit.get('plateau_ms'))}"),
                   (f"misses outside windows vs {corr['with']} (r)", corr["r"])]),
           "<h3>By prompt length</h3>",
           _grid(["prompt tokens", "windows", "median stall (ms)", "stalled", "median TTFT (ms)"],
                 [[r["prompt_tokens"], r["points"], r["stall_ms_p50"], r["stalled"], r["ttft_ms_p50"]]
                  for r in fit.get("by_length", [])])]
    ag = a.get("agreement")
    if ag:
        sp = ag.get("server_prefill") or {}
        out += ["<h3>Against the server's steps</h3>",
                _table([("stall gaps on a server prefill (precision)", f"{ag['stall_gaps_on_server_prefill']} of "
                                                                       f"{ag['stall_gaps']} ({_fmt(ag['precision'])})"),
                        ("prefill-interrupted gaps tagged stall (recall)", f"{ag['prefill_interrupted_tagged_stall']} "
                         f"of {ag['prefill_interrupted_gaps']} ({_fmt(ag['recall'])})"),
                        ("server prefill per 1k tokens (ms)", sp.get("prefill_ms_per_1k_tokens")),
                        ("client stall / server prefill, per 1k", ag["stall_over_prefill_per_1k"])])]
    for title, data in images:
        out.append(f"<h3>{escape(title)}</h3><img alt='{escape(title)}' src='data:image/png;base64,"
                   f"{base64.b64encode(data).decode()}'>")
    return "\n".join(out)


def render_html(summary: dict, images: dict[str, list[tuple[str, bytes]]], plan_text: Optional[str] = None) -> str:
    """`images`: per analysis label, its (title, PNG bytes)."""
    where = (summary.get("target") or {}).get("url") or summary.get("source") or "a pdlab run"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>pdlab diagnose: {escape(where)}</title>"
             f"<style>{STYLE}</style></head><body>", f"<h1>Is prefill interference breaking the ITL of "
             f"{escape(where)}?</h1>"]
    if summary.get("partial"):
        parts.append(f"<div class='partial'>PARTIAL: {escape(str(summary.get('reason')))}</div>")
    for a in summary.get("analyses", []):
        parts.append(_analysis(a, images.get(a["label"], [])))
    if summary.get("target"):
        parts += ["<h2>Endpoint</h2>", _table(list(summary["target"].items()))]
    if plan_text:
        parts += ["<h2>Plan</h2>", f"<pre>{escape(plan_text)}</pre>"]
    if summary.get("sent"):
        s = summary["sent"]
        parts.append(_table([("requests sent", s["requests"]), ("tokens asked for (prompt + max)", s["tokens"]),
                             ("most in flight", s["max_in_flight"]), ("by kind", s["by_kind"])]))
    parts += ["<h2>How gaps are tagged</h2>", f"<pre>{escape(TAGGING_DOC or '')}</pre>", "</body></html>"]
    return "\n".join(parts)
