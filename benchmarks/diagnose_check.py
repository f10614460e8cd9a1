"""`pdlab diagnose` against the truth: pdlab serve's own steps (issue 20, item 4).

For each variant of recipes/long-input.yaml asked for, this starts `pdlab serve` on a free loopback port, runs
`pdlab diagnose URL --model cpu-demo` against it with the default caps (timed: the issue wants each under 3
minutes, the server's start not counted), holds the client's tags against the server's steps.jsonl
(`--steps-from`), and stops the server. Criteria:

- unified: the verdict names prefill interference; >= 90% of stall-tagged gaps coincide with a server prefill
  step on their decode worker (precision); >= 90% of prefill-interrupted gaps are tagged stall (recall); and,
  from a second diagnosis whose probes fit within the recipe's step budget (--fit-lengths, default
  500,1000,1500,2000: long-input's engine does not chunk, but runs a prompt over its 2048-token budget in
  budget-sized pieces, and the client then sees one piece's stall against the whole prompt's length), the
  fitted stall per 1k prompt tokens within 15% of the server's prefill time per 1k tokens;
- disagg-pull: the verdict says the misses are not prefill stalls, with a stall share (of the gaps in prefill
  windows) near 0 (at most 5%).

--vllm: vLLM's CPU server (recipes/vllm-check.yaml's vllm-unified, served by pdlab serve) with chunked prefill
at two token budgets (--vllm-budgets, default 256,1024): the stall cap per chunk (the plateau, else the median
stall at the longest probe) must grow with the budget. Skipped, with the reason, without .venv-vllm
(scripts/vllm-env.sh creates it; slow).

    python benchmarks/diagnose_check.py [--variants unified,disagg-pull] [--vllm] [--out DIR] [--json]
        [--set KEY=VALUE ...]     # e.g. one unified replica on cpu:1, so the client and HTTP side keep cpu:0

On a 2-core box long-input's variants take both cores, and the HTTP server and the client share them with the
workers: a decode step slowed by that sharing, while a probe is sent, is a real gap the client sees, but not a
prefill (precision counts it against the tags). --set moves the served workers off a core.

Run it on a quiet machine: both the server and the client time what they see. Exit 0 when every criterion
held, 1 when one did not, 2 when a server or a diagnosis could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdlab.constants import VLLM_PYTHON  # noqa: E402
from pdlab.external.server import free_port  # noqa: E402

RECIPE = "recipes/long-input.yaml"
VLLM_RECIPE = "recipes/vllm-check.yaml"
READY_S = 300.0
STOP_S = 90.0
DONE_WHEN_S = 180.0


class Failed(RuntimeError):
    pass


def serve(recipe: str, variant: str, out: str, sets: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}.log"), "w")
    cmd = [sys.executable, "-m", "pdlab.cli", "serve", recipe, "--variant", variant, "--port", str(port), "--out", out,
           *[x for s in sets for x in ("--set", s)]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_S
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, f"{url}/v1"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise Failed(f"pdlab serve {variant} did not become healthy (log: {log.name})") from None
            time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it drains, stops its workers), SIGKILL when it does not end."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def diagnose(url: str, out: str, steps_from: str | None, *extra: str) -> tuple[dict, float]:
    """One diagnosis (timed); `steps_from`: the server's run directory (None: an engine without steps, vLLM)."""
    cmd = [sys.executable, "-m", "pdlab.cli", "diagnose", url, "--model", "cpu-demo", "--out", out, "--json",
           "--html", f"{out}.html", *(["--steps-from", steps_from] if steps_from else []), *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - t0
    if p.returncode != 0:
        raise Failed(f"pdlab diagnose exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)["analyses"][0], took


def check(name: str, ok: bool, value: object) -> dict:
    return {"criterion": name, "ok": bool(ok), "value": value}


def unified(root: str, fit_lengths: str, sets: tuple[str, ...] = ()) -> list[dict]:
    proc, url = serve(RECIPE, "unified", os.path.join(root, "serve-unified"), sets)
    try:
        a, took = diagnose(url, os.path.join(root, "diagnose-unified"), os.path.join(root, "serve-unified"))
        fit, _ = diagnose(url, os.path.join(root, "diagnose-unified-fit"), os.path.join(root, "serve-unified"),
                          "--lengths", fit_lengths) if fit_lengths else (None, 0.0)
    finally:
        stop(proc)
    ag = a["agreement"] or {}
    out = [check("unified: verdict names prefill interference", a["verdict"]["kind"] == "prefill_interference",
                 a["verdict"]["text"]),
           check(f"unified: diagnosis under {DONE_WHEN_S:.0f} s with default caps", took < DONE_WHEN_S, round(took, 1)),
           check("unified: >= 90% of stall gaps on a server prefill", (ag.get("precision") or 0) >= 0.9,
                 f"{ag.get('stall_gaps_on_server_prefill')} of {ag.get('stall_gaps')}"),
           check("unified: >= 90% of prefill-interrupted gaps tagged stall", (ag.get("recall") or 0) >= 0.9,
                 f"{ag.get('prefill_interrupted_tagged_stall')} of {ag.get('prefill_interrupted_gaps')}")]
    if fit is not None:
        fa = fit["agreement"] or {}
        ratio = fa.get("stall_over_prefill_per_1k")
        out.append(check(f"unified: stall per 1k tokens within 15% of the server's prefill per 1k (--lengths "
                         f"{fit_lengths})", ratio is not None and abs(ratio - 1.0) <= 0.15,
                         {"client_ms_per_1k": fa.get("client_stall_ms_per_1k_tokens"),
                          "server_ms_per_1k": (fa.get("server_prefill") or {}).get("prefill_ms_per_1k_tokens"),
                          "ratio": ratio}))
    return out


def disagg(root: str, sets: tuple[str, ...] = ()) -> list[dict]:
    proc, url = serve(RECIPE, "disagg-pull", os.path.join(root, "serve-disagg-pull"), sets)
    try:
        a, took = diagnose(url, os.path.join(root, "diagnose-disagg-pull"), os.path.join(root, "serve-disagg-pull"))
    finally:
        stop(proc)
    share = a["stall_share"]["of_gaps_in_windows"]
    return [check("disagg-pull: verdict says not prefill stalls", a["verdict"]["kind"] == "not_prefill_stalls",
                  a["verdict"]["text"]),
            check(f"disagg-pull: diagnosis under {DONE_WHEN_S:.0f} s with default caps", took < DONE_WHEN_S,
                  round(took, 1)),
            check("disagg-pull: stall share of gaps in prefill windows <= 5%", share is not None and share <= 0.05,
                  share)]


def vllm(root: str, budgets: list[int], lengths: str) -> list[dict]:
    caps = {}
    for b in budgets:
        sets = ("engine.chunked_prefill=true", f"engine.token_budget={b}")
        where = os.path.join(root, f"serve-vllm-{b}")
        proc, url = serve(VLLM_RECIPE, "vllm-unified", where, sets)
        try:
            a, _ = diagnose(url, os.path.join(root, f"diagnose-vllm-{b}"), None, "--lengths", lengths)
        finally:
            stop(proc)
        fit = a["fit"]
        caps[b] = fit["plateau_ms"] if fit["plateau_ms"] is not None else fit["by_length"][-1]["stall_ms_p50"]
    grows = all(caps[x] < caps[y] for x, y in zip(budgets, budgets[1:]))
    return [check(f"vllm: the stall cap per chunk grows with the budget ({', '.join(map(str, budgets))})", grows,
                  {str(b): c for b, c in caps.items()})]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="unified,disagg-pull", help="of unified, disagg-pull")
    p.add_argument("--fit-lengths", default="500,1000,1500,2000", help="probe lengths of the fit check ('' skips)")
    p.add_argument("--vllm", action="store_true", help="also vLLM's CPU server at two chunked-prefill budgets")
    p.add_argument("--vllm-budgets", default="256,1024")
    p.add_argument("--vllm-lengths", default="500,1000,2000,3000")
    p.add_argument("--out", default=None, help="directory of the servers' and diagnoses' runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for the served variants (pdlab serve --set), e.g. "
                        "'variants.unified.deployment={unified: {devices: [cpu:1]}}' to keep a core for the client")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    root = os.path.abspath(args.out or os.path.join(ROOT, "runs", f"diagnose-check-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(root, exist_ok=True)
    results, notes = [], []
    try:
        for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
            if v == "unified":
                results += unified(root, args.fit_lengths, tuple(args.set))
            elif v == "disagg-pull":
                results += disagg(root, tuple(args.set))
            else:
                raise Failed(f"--variants: {v}: expected unified or disagg-pull")
        if args.vllm:
            if not os.path.isfile(os.path.join(ROOT, VLLM_PYTHON)):
                notes.append(f"vllm: skipped: {VLLM_PYTHON} is absent (create it with scripts/vllm-env.sh)")
            else:
                results += vllm(root, [int(b) for b in args.vllm_budgets.split(",")], args.vllm_lengths)
    except Failed as e:
        print(f"diagnose_check: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"runs": root, "results": results, "notes": notes}, indent=2))
    else:
        for r in results:
            value = r["value"] if isinstance(r["value"], (int, float, str)) else json.dumps(r["value"])
            print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['criterion']}: {value}")
        for n in notes:
            print(n)
        print(f"runs: {root}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
