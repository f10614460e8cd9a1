"""The clients of the cross-check (benchmarks/cross_check.py), each in its own environment, and what each
measured, read from its own per-request output:

- pdlab: its endpoint backend, `pdlab run` of a generated recipe (`engine: {backend: endpoint, ...}`); the
  run's requests.jsonl (TTFT from the scheduled arrival, ITL per chunk, TPOT per token).
- vllm: `vllm bench serve` from vLLM's environment (benchmarks/vllm_cli.py), random dataset, --ignore-eos;
  its --save-detailed JSON (ttfts, itls per chunk, latencies, output_lens: TPOT = (latency - ttft) / (n - 1)).
- aiperf: `aiperf profile` from its own environment (.venv-aiperf: `pip install aiperf`), synthetic random
  prompts; its profile_export.jsonl (time_to_first_token, inter_chunk_latency, inter_token_latency = TPOT).

Every client sends fixed-length random prompts at the same Poisson rate, greedy (temperature 0) with EOS
ignored, after `warmup` requests of its own. Times are seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import yaml

from pdlab.constants import VLLM_PYTHON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_CLI = os.path.join(ROOT, "benchmarks", "vllm_cli.py")
AIPERF = ".venv-aiperf/bin/aiperf"  # `python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf`
SLACK_S = 300.0  # a client's deadline: its schedule (requests / rate) three times over, and this


@dataclass(frozen=True)
class Load:
    url: str  # the server's root, http://HOST:PORT (no /v1)
    model: str  # the name it serves
    tokenizer: str  # the model directory (its tokenizer)
    rate: float  # requests per second, Poisson arrivals
    requests: int  # measured
    input_len: int
    output_len: int
    warmup: int
    seed: int
    cores: tuple[int, ...] = ()  # where the client's processes run (empty: anywhere)


@dataclass(frozen=True)
class Sample:
    """What a client measured over its measured requests (failed ones left out, counted)."""
    ttft: tuple[float, ...]
    itl: tuple[float, ...]  # every gap between consecutive chunks, pooled
    tpot: tuple[float, ...]
    sent: int
    tokens: int = 0  # output tokens of the successful requests
    chunks: int = 0  # streamed chunks that carried them (tokens / chunks > 1: several tokens in a chunk)


@dataclass(frozen=True)
class Client:
    name: str
    label: str
    version: Callable[[str], str]  # the tool's version, from ROOT; raises Missing when it cannot run here
    run: Callable[[Load, str, str], Sample]  # (load, python or binary, out dir)
    tool: str  # the interpreter or binary it runs with (relative to ROOT)


class Missing(RuntimeError):
    """This client's environment is absent or broken here: the reason, one line."""


class ClientFailed(RuntimeError):
    pass


def call(cmd: list[str], log: str, timeout: float, cores: tuple[int, ...], env: Optional[dict] = None) -> None:
    """Run a client to its end on `cores`, its output into `log`; its whole process group goes on timeout or
    Ctrl-C."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})},
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        try:
            code = proc.wait(timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        raise ClientFailed(f"{cmd[0]} ... exited {code}: {tail(log)} (log: {log})")


def tail(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:300] if lines else "no output"


def output(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Missing(f"{cmd[0]}: {e}") from None
    if p.returncode != 0:
        raise Missing(f"{' '.join(cmd[:3])} exited {p.returncode}: {(p.stderr or p.stdout).strip()[-200:]}")
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""


def deadline(load: Load) -> float:
    return 3 * (load.requests + load.warmup) / load.rate + SLACK_S


# ---- pdlab's endpoint backend ----
def pdlab_version(_: str) -> str:
    import pdlab

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return f"{pdlab.__version__} ({sha.strip() or 'no git'})"


def pdlab_run(load: Load, python: str, out: str) -> Sample:
    recipe = {"name": "cross-check-client", "seed": load.seed, "warmup": load.warmup, "repeats": 1,
              "model": {"path": load.tokenizer},
              "workload": {"requests": load.requests, "arrival": {"kind": "poisson"},
                           "input_len": {"kind": "fixed", "value": load.input_len},
                           "output_len": {"kind": "fixed", "value": load.output_len}},
              "rates": [load.rate], "slo": {"ttft_ms": 60000, "itl_ms": 10000, "itl_stat": "p99", "attainment": 0.5},
              "variants": {"served": {"engine": {"backend": "endpoint", "url": f"{load.url}/v1", "model": load.model},
                                      "deployment": {"endpoint": {"devices": 1, "kind": "unified",
                                                                  "label": "pdlab-serve"}}}}}
    path = os.path.join(out, "pdlab-client.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    run_dir = os.path.join(out, "pdlab-client")
    call([python, "-m", "pdlab.cli", "run", path, "--out", run_dir], os.path.join(out, "pdlab-client.log"),
         deadline(load), load.cores)
    recs = [r for r in map(json.loads, open(os.path.join(run_dir, "requests.jsonl"))) if not r.get("warmup")]
    ok = [r for r in recs if r["ok"]]
    return Sample(tuple(r["ttft"] for r in ok), tuple(g for r in ok for g in r["itl"]),
                  tuple(r["tpot"] for r in ok if r["tpot"] is not None), len(recs),
                  sum(r["output_len"] for r in ok), sum(len(r.get("chunks") or r["token_times"]) for r in ok))


# ---- vllm bench serve ----
def vllm_version(python: str) -> str:
    if not os.path.exists(os.path.join(ROOT, python)):
        raise Missing(f"{python} not found (scripts/vllm-env.sh creates vLLM's environment)")
    return "vllm " + output([python, VLLM_CLI, "--version"])


def vllm_run(load: Load, python: str, out: str) -> Sample:
    cmd = [python, VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", load.url,
           "--endpoint", "/v1/completions", "--model", load.model, "--tokenizer", load.tokenizer,
           "--dataset-name", "random", "--random-input-len", str(load.input_len),
           "--random-output-len", str(load.output_len), "--random-range-ratio", "0", "--ignore-eos",
           "--temperature", "0", "--num-prompts", str(load.requests), "--request-rate", f"{load.rate:g}",
           "--num-warmups", str(load.warmup), "--seed", str(load.seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", out, "--result-filename", "vllm-bench.json"]
    call(cmd, os.path.join(out, "vllm-bench.log"), deadline(load), load.cores)
    d = json.load(open(os.path.join(out, "vllm-bench.json")))
    ok = [i for i, e in enumerate(d["errors"]) if not e]
    return Sample(tuple(d["ttfts"][i] for i in ok), tuple(g for i in ok for g in d["itls"][i]),
                  tuple((d["latencies"][i] - d["ttfts"][i]) / (d["output_lens"][i] - 1) for i in ok
                        if d["output_lens"][i] > 1), len(d["errors"]),
                  sum(d["output_lens"][i] for i in ok), sum(len(d["itls"][i]) + 1 for i in ok))


# ---- AIPerf ----
def aiperf_version(binary: str) -> str:
    if not os.path.exists(os.path.join(ROOT, binary)):
        raise Missing(f"{binary} not found (python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf)")
    return output([binary, "--version"]).replace("NVIDIA AIPerf", "aiperf").strip()


def aiperf_run(load: Load, binary: str, out: str) -> Sample:
    art = os.path.join(out, "aiperf")
    cmd = [binary, "profile", "--model", load.model, "--url", load.url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", load.tokenizer, "--prompt-corpus", "random",
           "--isl", str(load.input_len), "--isl-stddev", "0", "--osl", str(load.output_len), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--request-rate", f"{load.rate:g}", "--arrival-pattern", "poisson", "--request-count", str(load.requests),
           "--random-seed", str(load.seed), "--ui-type", "none", "--artifact-dir", art, "--export-level", "records"]
    if load.warmup:
        cmd += ["--warmup-request-count", str(load.warmup)]
    # not HF_HUB_OFFLINE: with it AIPerf 0.13 looks a local tokenizer path up as a hub snapshot and fails;
    # without it a path is loaded as a path, and nothing is asked of the hub
    env = {k: "" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    call(cmd, os.path.join(out, "aiperf.log"), deadline(load), load.cores, env=env)
    recs = [json.loads(line) for line in open(os.path.join(art, "profile_export.jsonl"))]
    recs = [r for r in recs if r["metadata"].get("benchmark_phase") == "profiling"]
    ok = [r["metrics"] for r in recs if "time_to_first_token" in r["metrics"] and not r.get("error")]
    ms = 1e-3
    icl = [(m.get("inter_chunk_latency") or {}).get("value", []) for m in ok]
    return Sample(tuple(m["time_to_first_token"]["value"] * ms for m in ok),
                  tuple(g * ms for gaps in icl for g in gaps),
                  tuple(m["inter_token_latency"]["value"] * ms for m in ok if "inter_token_latency" in m), len(recs),
                  sum(int(m["output_sequence_length"]["value"]) for m in ok), sum(len(gaps) + 1 for gaps in icl))


CLIENTS = {c.name: c for c in (
    Client("pdlab", "pdlab (endpoint)", pdlab_version, pdlab_run, sys.executable),
    Client("vllm", "vllm bench serve", vllm_version, vllm_run, VLLM_PYTHON),
    Client("aiperf", "aiperf", aiperf_version, aiperf_run, AIPERF),
)}
