"""What a diagnosis leaves: summary.json (the analyses, and online the endpoint, plan, counts and phases), the
figures, and the HTML page where asked. The records (`requests.jsonl`, one line per request sent) are written
by the caller as a run writes its own (pdlab.measure.records.RunDir), so `pdlab diagnose RUN_DIR` reads a
diagnosis back like any run."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from dataclasses import asdict
from typing import Optional

import aiohttp
import numpy

import pdlab
from pdlab.diagnose.analysis import Analysis
from pdlab.diagnose.html import render_html
from pdlab.diagnose.plots import figures, save
from pdlab.diagnose.session import Measured
from pdlab.measure.records import atomic_write, cpu_model, dumps

SCHEMA = 1


def client_env() -> dict:
    """env.json of a diagnosis: the client's machine and versions (a run's collect_env imports torch and probes
    GPUs, seconds a client that only talks HTTP should not wait; the server's facts are its own)."""

    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
            "platform": platform.platform(), "host": socket.gethostname(), "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(), "argv": list(sys.argv), "pdlab_version": getattr(pdlab, "__version__", None),
            "aiohttp_version": aiohttp.__version__, "numpy_version": numpy.__version__}


def online_summary(m: Measured, analyses: list[Analysis], plan_text: str) -> dict:
    plan = asdict(m.plan)
    plan["options"]["lengths_from"] = len(m.plan.options.lengths_from)  # how many; the mixed phase's are in `mixed`
    return {"kind": "diagnose", "schema": SCHEMA, "target": m.target.to_dict(), "plan": plan, "plan_text": plan_text,
            "max_requests": m.plan.max_requests, "sent": m.sent, "phases": m.phases, "server_load": m.load,
            "partial": m.partial is not None, "reason": m.partial, "skipped_probes": m.skipped,
            "analyses": [a.to_dict() for a in analyses]}


def offline_summary(source: str, analyses: list[Analysis], steps_from: Optional[str]) -> dict:
    return {"kind": "diagnose", "schema": SCHEMA, "source": source, "steps_from": steps_from, "partial": False,
            "analyses": [a.to_dict() for a in analyses]}


def write_results(out: str, summary: dict, analyses: list[Analysis], html: Optional[str]) -> list[str]:
    """summary.json and the figures into `out`, the page to `html`; the paths written."""
    os.makedirs(out, exist_ok=True)
    written = [os.path.join(out, "summary.json")]
    atomic_write(written[0], dumps(summary, indent=2))
    images: dict[str, list[tuple[str, bytes]]] = {}
    for a in analyses:
        suffix = "" if len(analyses) == 1 else f"-{a.label}"
        for name, fig in figures(a, suffix):
            path = os.path.join(out, name)
            data = save(fig, path, keep=html is not None)
            written.append(path)
            if data is not None:
                images.setdefault(a.label, []).append((name, data))
    if html is not None:
        atomic_write(html, render_html(summary, images, summary.get("plan_text")))
        written.append(html)
    return written


def describe(a: Analysis) -> str:
    """The verdict as printed: a header line, then the sentences."""
    head = f"verdict ({a.label}): {a.verdict.kind.replace('_', ' ')}"
    ag = a.agreement
    lines = [head, *[f"  {s}" for s in a.verdict.sentences]]
    if ag:
        lines.append(f"  against the server's steps: {ag['stall_gaps_on_server_prefill']} of {ag['stall_gaps']} stall "
                     f"gaps on a server prefill, {ag['prefill_interrupted_tagged_stall']} of "
                     f"{ag['prefill_interrupted_gaps']} prefill-interrupted gaps tagged stall"
                     + (f"; client stall / server prefill per 1k tokens {ag['stall_over_prefill_per_1k']:.2f}"
                        if ag["stall_over_prefill_per_1k"] is not None else ""))
    return "\n".join(lines)
