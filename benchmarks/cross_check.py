"""pdlab's client against the benchmark clients people already use (issue 19, item 4).

`pdlab serve` serves a recipe variant (a subprocess on a free loopback port); then, one after the other, each
client drives it at the same Poisson rate, well below saturation, with fixed-length random prompts (greedy,
EOS ignored): (a) pdlab's endpoint backend (`pdlab run` of a generated endpoint recipe), (b) `vllm bench serve`
from vLLM's environment (.venv-vllm, scripts/vllm-env.sh), (c) AIPerf from its own (.venv-aiperf). The table
puts each client's TTFT, ITL and TPOT p50/p99 beside what pdlab serve stamped for the same requests (its run
directory's requests.jsonl: worker token stamps, from the request's arrival at the server). A client whose
environment is absent is skipped with the reason.

Nothing is downloaded: the model directory (benchmarks/cross_check_model.py) holds a preset's seeded weights
and a word-level tokenizer of its vocabulary, which `pdlab serve` loads and the clients take as --tokenizer.
The served variant defaults to one unified pdlab worker on cpu:0 (long-input's engine, no prefix cache: the
prompts share nothing), and the clients run on the other cores (--client-cores), beside pdlab serve's HTTP
side (which keeps off its workers' cores); --recipe/--variant serve another (its model is replaced by that
directory; the clients then run anywhere unless --client-cores says).

Target: pdlab's client and each external client within 10% on TTFT p50 and ITL p50. What may differ:
- TTFT: pdlab counts from the request's *scheduled* arrival, vLLM from just before its POST, AIPerf from its
  request start, which includes opening the connection (a new one per request: its http_req_connecting);
  the server counts from the request's arrival at the server (no network, no HTTP client).
- ITL: every client has one gap per streamed chunk (tok/chunk says how many tokens a chunk carried; pdlab
  serve sends what the engine produced since its last send), the server one per token.
- TPOT: (E2EL - TTFT) / (tokens - 1) per request everywhere (AIPerf calls it inter_token_latency).
- Each client draws its own prompts and arrival times, and runs at another time: p99s over ~100 requests
  move between runs, and so does everything when something else uses the machine. The server rows show
  how much of a difference between clients was the server's own (the same in its stamps), and each
  client's p50 minus its server's p50 is that client's own overhead.

    python benchmarks/cross_check.py [--rate 0.5] [--requests 100] [--input-len 512] [--output-len 128]
        [--clients pdlab,vllm,aiperf] [--recipe R --variant V] [--out DIR]

Run it on a quiet machine: the server and the clients share its cores. Writes DIR/cross_check.json beside
every client's own output and logs. Exit 0 when it ran (agreement is reported, not enforced), 2 when the
server or a client could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from cross_check_clients import CLIENTS, ClientFailed, Load, Missing, Sample  # noqa: E402
from cross_check_model import build  # noqa: E402
from cross_check_server import SERVED_NAME, Failed, serve, server_sample, settled, stop  # noqa: E402

TARGET = 0.10
COLUMNS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "tpot_p99")
# one unified worker on cpu:0 (the clients have the other core), long-input's engine without the prefix cache
SERVE_RECIPE = {"name": "cross-check", "seed": 0,
                "engine": {"block_size": 16, "kv_blocks": "auto", "token_budget": 2048, "chunked_prefill": False,
                           "prefix_caching": False, "max_running": 32},
                "workload": {"requests": 1, "input_len": {"kind": "fixed", "value": 16},
                             "output_len": {"kind": "fixed", "value": 4}},
                "rates": [1], "slo": {"ttft_ms": 60000, "itl_ms": 10000},
                "variants": {"unified": {"deployment": {"unified": {"devices": ["cpu:0"]}}}}}


# ---- figures ----
def stats(s: Sample) -> dict:
    def pct(xs: tuple[float, ...], q: float) -> Optional[float]:
        return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None  # ms, linear as vLLM's

    return {"sent": s.sent, "ok": len(s.ttft), "tok_per_chunk": s.tokens / s.chunks if s.chunks else None,
            "ttft_p50": pct(s.ttft, 50), "ttft_p99": pct(s.ttft, 99), "itl_p50": pct(s.itl, 50),
            "itl_p99": pct(s.itl, 99), "tpot_p50": pct(s.tpot, 50), "tpot_p99": pct(s.tpot, 99)}


def agreement(rows: dict) -> dict:
    """Each external client's TTFT p50 and ITL p50 against pdlab's client: relative difference, within TARGET."""
    if "pdlab" not in rows:
        return {}
    ref = rows["pdlab"]["client"]
    out = {}
    for name, r in rows.items():
        if name == "pdlab":
            continue
        d = {k: (r["client"][k] / ref[k] - 1) if r["client"][k] and ref[k] else None for k in ("ttft_p50", "itl_p50")}
        out[name] = {**d, "within": all(v is not None and abs(v) <= TARGET for v in d.values())}
    return out


def table(rows: dict, load: Load, served: str, versions: dict, skipped: dict) -> str:
    def num(v: Optional[float], fmt: str = "9.2f") -> str:
        return f"{v:{fmt}}" if v is not None else f"{'-':>{int(fmt.split('.')[0].lstrip('+') or 1)}}"

    lines = [f"cross-check: pdlab serve {served}, {load.requests} requests per client at {load.rate:g} req/s "
             f"(Poisson), {load.input_len} -> {load.output_len} tokens, greedy, EOS ignored, clients on "
             f"{'cores ' + ','.join(map(str, load.cores)) if load.cores else 'any core'}; times in ms",
             f"{'':18}{'':8}{'ok/sent':>9}{'tok/chunk':>10}" + "".join(f"{c.replace('_', ' '):>10}" for c in COLUMNS)]
    for name, r in rows.items():
        for side in ("client", "server"):
            s = r[side]
            lines.append(f"{CLIENTS[name].label if side == 'client' else '':18}{side:8}"
                         f"{s['ok']:>4}/{s['sent']:<4}{num(s['tok_per_chunk'], '10.2f')}"
                         + "".join(num(s[c], "10.2f") for c in COLUMNS))
    for name, r in rows.items():
        c, s = r["client"], r["server"]
        lines.append(f"{CLIENTS[name].label} p50 - the server's p50 for its requests: TTFT "
                     f"{num(minus(c['ttft_p50'], s['ttft_p50']), '+.2f')} ms, ITL "
                     f"{num(minus(c['itl_p50'], s['itl_p50']), '+.2f')} ms")
    for name, a in agreement(rows).items():
        lines.append(f"{CLIENTS[name].label} vs pdlab's client: TTFT p50 {fmt_pct(a['ttft_p50'])}, ITL p50 "
                     f"{fmt_pct(a['itl_p50'])}: {'within' if a['within'] else 'NOT within'} {TARGET:.0%}")
    lines.append("versions: " + "; ".join(f"{CLIENTS[n].label}: {v}" for n, v in versions.items()))
    lines += [f"skipped {CLIENTS[n].label}: {why}" for n, why in skipped.items()]
    return "\n".join(lines)


def minus(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a - b if a is not None and b is not None else None


def fmt_pct(v: Optional[float]) -> str:
    return f"{v:+.1%}" if v is not None else "-"


def client_cores(spec: Optional[str], default_variant: bool) -> tuple[int, ...]:
    """The clients' cores: `spec` ("1", "1-3", "1,3"), else every core but the default variant's worker's."""
    mine = sorted(os.sched_getaffinity(0))
    if spec is None:
        rest = [c for c in mine if c != 0]
        return tuple(rest) if default_variant and rest else ()
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    if not cores or not set(cores) <= set(mine):
        raise ValueError(f"expected cores of this machine ({mine[0]}-{mine[-1]})")
    return tuple(cores)


# ---- main ----
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson), for every client")
    p.add_argument("--requests", type=int, default=100, help="measured requests per client")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests per client, before its measured ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"any of {','.join(CLIENTS)}, in this order")
    p.add_argument("--recipe", default=None, help="serve this recipe's --variant (default: one unified worker)")
    p.add_argument("--variant", default="unified")
    p.add_argument("--client-cores", default=None,
                   help="cores for the clients, e.g. 1 or 1-3 (default: all but cpu:0 when serving the default "
                        "variant, anywhere with --recipe)")
    p.add_argument("--preset", default="cpu-demo", help="the model's preset (its weights, its vocabulary)")
    p.add_argument("--out", default=None, help="default runs/cross-check-<time>")
    p.add_argument("--json", action="store_true", help="print cross_check.json instead of the table")
    a = p.parse_args()
    names = [n for n in a.clients.split(",") if n]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown or a.rate <= 0 or a.requests < 1 or a.output_len < 2:
        print(f"cross_check: --clients {','.join(unknown)}: unknown (known: {','.join(CLIENTS)})" if unknown else
              "cross_check: --rate must be > 0, --requests >= 1, --output-len >= 2", file=sys.stderr)
        return 2
    try:
        cores = client_cores(a.client_cores, a.recipe is None)
    except ValueError as e:
        print(f"cross_check: --client-cores {a.client_cores}: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(a.out or os.path.join(ROOT, "runs", f"cross-check-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(out, exist_ok=True)

    versions, skipped = {}, {}
    for n in names:
        try:
            versions[n] = CLIENTS[n].version(CLIENTS[n].tool)
        except Missing as e:
            skipped[n] = str(e)
    model_dir = build(os.path.join(ROOT, "runs", "models", f"cross-check-{a.preset}-seed{a.seed}"), a.preset, a.seed)
    recipe = a.recipe
    if recipe is None:
        recipe = os.path.join(out, "serve.yaml")
        with open(recipe, "w") as f:
            yaml.safe_dump(SERVE_RECIPE | {"seed": a.seed}, f)
    served = f"{os.path.relpath(recipe, ROOT) if a.recipe else 'one unified worker (cpu:0)'} --variant {a.variant}"

    rows: dict = {}
    server_dir = os.path.join(out, "serve")
    try:
        proc, url = serve(recipe, a.variant, model_dir, server_dir)
    except Failed as e:
        print(f"cross_check: {e}", file=sys.stderr)
        return 2
    load = Load(url, SERVED_NAME, model_dir, a.rate, a.requests, a.input_len, a.output_len, a.warmup, a.seed,
                cores)
    try:
        for n in names:
            if n in skipped:
                continue
            before = len(settled(server_dir))
            print(f"cross_check: {CLIENTS[n].label} ({a.requests} requests at {a.rate:g} req/s)", file=sys.stderr,
                  flush=True)
            try:
                sample = CLIENTS[n].run(load, CLIENTS[n].tool, out)
            except ClientFailed as e:
                skipped[n] = f"failed: {e}"
                continue
            server = server_sample(settled(server_dir)[before:], sample.sent)
            rows[n] = {"client": stats(sample), "server": stats(server)}
    finally:
        stop(proc)

    result = {"load": {k: v for k, v in vars(load).items() if k != "url"}, "served": served, "versions": versions,
              "skipped": skipped, "rows": rows, "agreement": agreement(rows), "target": TARGET}
    with open(os.path.join(out, "cross_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if a.json else table(rows, load, served, versions, skipped))
    print(f"cross_check: written to {out}", file=sys.stderr)
    return 0 if rows and not any(why.startswith("failed") for why in skipped.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
