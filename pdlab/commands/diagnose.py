"""`pdlab diagnose URL --model NAME`: is prefill interference what breaks a live service's ITL? And
`pdlab diagnose RUN_DIR`: the same analysis on the records of any pdlab run (pdlab.diagnose).

Exit codes: 0 a verdict; 2 bad input or an endpoint that fails its checks (one line, nothing measured);
3 a verdict on what was measured before a cap or a server error cut the plan short; 130 Ctrl-C (what was
measured is written first).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any, Optional

from pdlab.diagnose.lengths import read_lengths
from pdlab.diagnose.plan import Caps, Options, PlanError, build_plan, render
from pdlab.measure.records import RunDir, RunDirError, default_run_path, dumps, load_run

PARTIAL_EXIT = 3
INTERRUPTED_EXIT = 130


def _error(msg: str) -> int:
    print(f"pdlab diagnose: error: {msg}", file=sys.stderr)
    return 2


def _html_ok(html: Optional[str]) -> Optional[str]:
    if html is not None and (os.path.isdir(html) or not os.path.isdir(os.path.dirname(os.path.abspath(html)))):
        return f"--html {html}: expected a file path in an existing directory"
    return None


def parse_lengths(text: str, option: str = "--lengths") -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"{option} {text}: expected comma-separated prompt lengths in tokens, e.g. 500,1000,2000") \
            from None
    if not out:
        raise PlanError(f"{option} {text!r}: no prompt length in it")
    return out


def options(target: str, kw: dict) -> Any:
    """The diagnosis' Options from the command line's values (PlanError, one line, for a bad one)."""

    d = Options("", "")
    caps = Caps(kw["max_concurrency"], kw["max_rate"], kw["max_tokens_total"], kw["max_duration"])
    mixed = read_lengths(kw["lengths_from"], kw["seed"]) if kw["lengths_from"] else ()
    return Options(target, kw["model"] or "", kw["itl_ms"] if kw["itl_ms"] is not None else d.itl_ms,
                   kw["concurrency"], parse_lengths(kw["lengths"]), kw["repeats"], kw["max_model_len"], mixed,
                   kw["mixed_rate"], kw["mixed_requests"], kw["steady_s"], kw["probe_gap_s"], seed=kw["seed"],
                   api_key_env=kw["api_key_env"], metrics=kw["metrics"], caps=caps)


def main(target: str, **kw: Any) -> int:
    """`target`: a run directory (offline) when one exists there, else the URL of a server (online). `kw`: the
    command line's options by name (pdlab.cli.diagnose)."""
    if os.path.isdir(target):
        return offline(target, kw["itl_ms"], kw["out"], kw["html"], kw["json_"], kw["steps_from"])

    try:
        opts = options(target, kw)
    except PlanError as e:
        return _error(str(e))
    return online(opts, kw["out"], kw["html"], kw["dry_run"], kw["json_"], kw["steps_from"])


def _show(json_: bool) -> Any:
    stream = sys.stderr if json_ else sys.stdout
    return lambda text: print(text, file=stream, flush=True)


RECORDS_WAIT_S = 15.0  # --steps-from: how long the server may take to record the streams the diagnosis cut


def _server_run(steps_from: Optional[str], responses: tuple[str, ...] = ()) -> Any:
    """The server's run directory; with `responses` (the diagnosis' response ids), read once the server has
    recorded all of them (it records a stream its client cut only once its engine let go of it), or after
    RECORDS_WAIT_S."""
    # deferred: numpy
    from pdlab.diagnose.agreement import CHOICE_SUFFIX

    deadline = time.monotonic() + RECORDS_WAIT_S
    while True:
        run = load_run(steps_from)
        have = {CHOICE_SUFFIX.sub("", str(r.get("id"))) for r in run.requests}
        if all(r in have for r in responses) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not run.steps:
        raise ValueError(f"--steps-from {steps_from}: no steps.jsonl records there (a pdlab serve or run directory "
                         "of pdlab's own engine has them)")
    return run


def online(opts: Any, out: Optional[str], html: Optional[str], dry_run: bool, json_: bool,
           steps_from: Optional[str]) -> int:
    # deferred: aiohttp, numpy
    from pdlab.diagnose.connect import DiagnoseError, check_url

    show = _show(json_)
    try:
        opts = replace(opts, url=check_url(opts.url))
        if not opts.model:
            raise PlanError("--model: the served model's name is needed (as the server's /v1/models lists it)")
        plan = build_plan(opts)  # every option checked before anything is sent
        if (why := _html_ok(html)) is not None:
            raise PlanError(why)
        if steps_from is not None and not os.path.isdir(steps_from):
            raise PlanError(f"--steps-from {steps_from}: not a directory (the run directory of the pdlab serve that "
                            "serves the URL)")
    except (DiagnoseError, PlanError) as e:
        return _error(str(e))
    if dry_run:
        show(render(plan))
        show("dry run: nothing was sent")
        return 0
    path = out or default_run_path("diagnose")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        return _error(f"--out {path}: exists and is not an empty directory")
    # deferred: aiohttp, numpy
    from pdlab.diagnose.session import measure

    try:
        m = measure(opts, show)
    except (DiagnoseError, PlanError) as e:
        return _error(str(e))
    except KeyboardInterrupt:
        print("pdlab diagnose: interrupted before measuring; nothing was written", file=sys.stderr)
        return INTERRUPTED_EXIT
    try:  # the server wrote its steps while it was measured: read them now
        ids = tuple(r["response_id"] for r in m.records if r.get("response_id"))
        server = _server_run(steps_from, ids) if steps_from else None
    except (RunDirError, ValueError) as e:
        print(f"pdlab diagnose: --steps-from: {e}; the diagnosis is written without the agreement", file=sys.stderr)
        server = None
    code = _write_online(m, path, html, json_, server, show)
    return INTERRUPTED_EXIT if m.interrupted else code


def _write_online(m: Any, path: str, html: Optional[str], json_: bool, server: Any, show: Any) -> int:
    # deferred: aiohttp, numpy
    from pdlab.diagnose.analysis import analyse, with_agreement
    from pdlab.diagnose.output import client_env, describe, online_summary, write_results
    from pdlab.diagnose.streams import group_records

    rd = RunDir(path)
    rd.write_env({**client_env(), "diagnose": m.target.to_dict()})
    rd.append("requests", list(m.records))
    rd.close()
    streams = group_records(list(m.records)).get("diagnose", [])
    a = analyse("diagnose", streams, m.plan.options.itl_ms, probes_phase=m.phases.get("probes"),
                load=(m.load or {}).get("samples"))
    if server is not None:
        try:
            a = with_agreement(a, server.steps, server.requests)
        except ValueError as e:  # another machine's clock, or no steps
            print(f"pdlab diagnose: --steps-from: {e}; the diagnosis is written without the agreement",
                  file=sys.stderr)
    summary = online_summary(m, [a], render(m.plan))
    write_results(path, summary, [a], html)
    if json_:
        print(dumps(summary, indent=2))
    else:
        show(describe(a))
    if m.skipped:
        show(f"note: {m.skipped}; longer probes were skipped")
    if m.partial:
        print(f"pdlab diagnose: partial: {m.partial}", file=sys.stderr)
    show(f"run directory: {path}" + (f"; HTML: {html}" if html else ""))
    return PARTIAL_EXIT if m.partial and not m.interrupted else 0


def _offline_target(run: Any) -> Optional[float]:
    """The ITL target the run was judged by, when it was an absolute one."""
    for a in run.summary.get("analyses") or []:
        return float(a["itl_target_ms"])
    for slo in (run.summary.get("slo"), run.recipe.get("slo")):
        if isinstance(slo, dict) and isinstance(slo.get("itl_ms"), (int, float)):
            return float(slo["itl_ms"])
    return None


def offline(run_dir: str, itl_ms: Optional[float], out: Optional[str], html: Optional[str], json_: bool,
            steps_from: Optional[str]) -> int:
    # deferred: aiohttp, numpy
    from pdlab.diagnose.analysis import analyse, with_agreement
    from pdlab.diagnose.output import describe, offline_summary, write_results
    from pdlab.diagnose.streams import group_records

    show = _show(json_)
    try:
        if (why := _html_ok(html)) is not None:
            raise ValueError(why)
        run = load_run(run_dir)
        server = _server_run(steps_from) if steps_from else None
    except (RunDirError, ValueError) as e:
        return _error(str(e))
    groups = group_records(run.requests)
    if not groups:
        return _error(f"{run_dir}: no request with a token in its requests.jsonl: nothing to diagnose")
    if itl_ms is not None and not itl_ms > 0:
        return _error(f"--itl-ms {itl_ms}: expected a number > 0")
    target_ms = itl_ms or _offline_target(run) or Options("", "").itl_ms
    phases = run.summary.get("phases") or {}
    load = (run.summary.get("server_load") or {}).get("samples")
    analyses = []
    for label, streams in groups.items():
        a = analyse(label, streams, target_ms, probes_phase=phases.get("probes"), load=load)
        truth = server or run
        steps = [s for s in truth.steps if truth is server or s.get("variant") == label]
        if steps:  # the server's own steps (an engine pdlab cannot see, vLLM, has none)
            try:
                a = with_agreement(a, steps, truth.requests if truth is server else None)
            except ValueError as e:
                return _error(str(e))
        analyses.append(a)
    path = out or os.path.join(run_dir, "diagnose")
    summary = offline_summary(os.path.abspath(run_dir), analyses, steps_from)
    write_results(path, summary, analyses, html)
    if json_:
        print(dumps(summary, indent=2))
    else:
        for a in analyses:
            show(describe(a))
        show(f"written: {path}" + (f"; HTML: {html}" if html else ""))
    return 0
