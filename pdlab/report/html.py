"""`pdlab report --html`: one self-contained HTML file of one or more runs, to attach to a ticket.

Everything compare prints (header, PARTIAL and BOX banners, tables with their footnotes, M/D/1 lines, the
verdicts with their structured fields), every plot as an embedded base64 PNG, the warnings, each run's
environment (env.json) and recipe (recipe.yaml). No file or network reference: it opens anywhere. A few lines
of inline script check that every image decoded and say so on the page (and in `data-images` on <body>).
"""

from __future__ import annotations

import base64
import io
import json
import os
from html import escape
from typing import Any

from pdlab.report.load import LoadedRun
from pdlab.report.tables import Table, header, mdl1_lines, routes, tables

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}th,td{padding:3px 10px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}caption{text-align:left;font-weight:600;padding:4px 0}
.note{color:#555;font-size:12px;margin:2px 0}.banner{padding:8px 12px;margin:6px 0;border-radius:4px;font-weight:600}
.partial{background:#fde7ea;color:#b00020}.box{background:#fff4d6;color:#7a5200}.modelled{background:#eef;color:#223}
.info{margin:2px 0}pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}
img{max-width:100%;border:1px solid #eee}figure{margin:12px 0}.broken{outline:3px solid #b00020}
"""
CHECK = """
window.addEventListener('load', function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; } else { imgs[i].className += ' broken'; }
  }
  document.body.setAttribute('data-images', ok + '/' + imgs.length);
  document.getElementById('image-check').textContent = ok + ' of ' + imgs.length + ' plots decoded';
});
"""


def _table(t: Table) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in t.notes)
    return f"<table><caption>{escape(t.title)}</caption><tr>{head}</tr>{body}</table>{notes}"


def _verdicts(result: dict) -> str:
    items = "".join(f"<li>{escape(v['sentence'])}</li>" for v in result["verdicts"]) or "<li>no pair to judge</li>"
    cols = ("candidate", "baseline", "kind", "timing", "outcome", "ratio", "limits")
    rows = "".join("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in (
        v["candidate"], v["baseline"], v["kind"] + (" (cross-engine)" if v["cross_engine"] else ""), v["timing"],
        v["outcome"], "—" if v["ratio"] is None else f"{v['ratio']:.2f}× ({v['ratio_bound']})",
        f"{v['limits']['baseline']} / {v['limits']['candidate']}")) + "</tr>" for v in result["verdicts"])
    table = f"<table><tr>{''.join(f'<th>{c}</th>' for c in cols)}</tr>{rows}</table>" if rows else ""
    return f"<ul>{items}</ul>{table}"


def figure_png(fig: Any) -> str:
    """A matplotlib Figure as base64 PNG (closed afterwards)."""
    # deferred: matplotlib (optional)
    import matplotlib.pyplot as plt  # plots are optional; the caller has checked matplotlib is there

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _env(lr: LoadedRun) -> str:
    rows = "".join(f"<tr><td>{escape(str(k))}</td><td style='text-align:left'>{escape(json.dumps(v))[:400]}</td></tr>"
                   for k, v in lr.run.env.items())
    return f"<table><caption>{escape(lr.name)}: env.json</caption>{rows}</table>"


def _recipe(lr: LoadedRun) -> str:
    path = os.path.join(lr.run.path, "recipe.yaml")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        text = "(no recipe.yaml)"
    return f"<p class='info'>{escape(lr.name)}: recipe.yaml</p><pre>{escape(text)}</pre>"


def render_html(runs: list[LoadedRun], result: dict, plots: list[tuple[str, str]]) -> str:
    """The report: `result` from pdlab.report.compare, `plots` (caption, base64 PNG)."""
    names = ", ".join(lr.name for lr in runs)
    top = "".join(f'<div class="banner {line.kind}">{escape(line.text)}</div>' if line.kind != "info"
                  else f'<p class="info">{escape(line.text)}</p>' for line in header(result))
    figs = "".join(f'<figure><img alt="{escape(c)}" src="data:image/png;base64,{b}"><figcaption>{escape(c)}'
                   f"</figcaption></figure>" for c, b in plots) or "<p>no plots (matplotlib is not installed)</p>"
    extra = "".join(f"<p class='info'>{escape(x)}</p>" for x in routes(result))
    parts = [
        f"<h1>pdlab report: {escape(names)}</h1>", top,
        "<h2>Verdict</h2>", _verdicts(result),
        "<h2>Tables</h2>", "".join(_table(t) for t in tables(result)), extra,
        "<h2>M/D/1 check at each row's lowest rate</h2>",
        "".join(f"<p class='info'>{escape(x)}</p>" for x in mdl1_lines(result)),
        "<h2>Plots</h2>", '<p class="note" id="image-check">plots not checked (scripts off)</p>', figs,
        "<h2>Warnings</h2>", "<ul>" + ("".join(f"<li>{escape(w)}</li>" for w in result["warnings"]) or
                                       "<li>none</li>") + "</ul>",
        "<h2>Environment</h2>", "".join(_env(lr) for lr in runs),
        "<h2>Recipe</h2>", "".join(_recipe(lr) for lr in runs),
    ]
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>pdlab report: {escape(names)}</title>"
            f"<style>{STYLE}</style></head><body data-images='unchecked'>{''.join(parts)}"
            f"<script>{CHECK}</script></body></html>")
