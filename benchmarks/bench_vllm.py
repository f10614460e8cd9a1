"""pdlab's engine against vLLM, offline throughput on the same saved model and prompts (issue 8, item 6).

Paired runs, alternating which engine goes first: each run is one process per engine, pinned to one core,
that loads the model, warms up, then times `generate` over every prompt at once (model loading and vLLM's
start-up are not timed). Greedy outputs are compared token for token in the same run. vLLM runs in its own
environment (scripts/vllm-env.sh): this script starts `.venv-vllm/bin/python benchmarks/bench_vllm.py
--vllm-worker ...` for it.

    python benchmarks/bench_vllm.py                         # cpu-demo, 32 prompts of 200-1000 x 64, 3 pairs
    python benchmarks/bench_vllm.py --pairs 1 --prompts 4   # a quick check

Served latency at one moderate rate is `pdlab run recipes/vllm-check.yaml --variants pdlab-unified,vllm-unified`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vllm_worker(args: argparse.Namespace) -> None:
    """Runs in vLLM's environment: time LLM.generate over the prompts, print JSON."""
    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts_file))
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_num_seqs=64,
              enable_prefix_caching=False, max_num_batched_tokens=args.token_budget)
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"seconds": dt, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))


def pdlab_worker(args: argparse.Namespace) -> None:
    from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model

    torch_threads()
    prompts = json.load(open(args.prompts_file))
    model = load_model(args.preset)

    def run(ps: list) -> tuple[float, list]:
        eng = Engine(model, EngineConfig(block_size=16, token_budget=args.token_budget, max_running=64, prefix_caching=False))
        for i, p in enumerate(ps):
            eng.add(str(i), p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
        outs: dict[str, list] = {str(i): [] for i in range(len(ps))}
        t = time.perf_counter()
        while eng.has_work():
            for tok in eng.step().tokens:
                outs[tok.req_id].append(tok.token_id)
        return time.perf_counter() - t, [outs[str(i)] for i in range(len(ps))]

    run(prompts[:1])  # warm-up
    dt, outs = run(prompts)
    print("RESULT " + json.dumps({"seconds": dt, "outputs": outs}))


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


def one(cmd: list[str], env: dict) -> dict:
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode or not lines:
        sys.exit(f"{cmd[0]} failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=2048,
                    help="tokens per engine step, the same for both engines (vLLM's max_num_batched_tokens)")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pdlab-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_worker:
        return vllm_worker(args)
    if args.pdlab_worker:
        return pdlab_worker(args)
    import tempfile

    import torch

    from pdlab.external.vllm import model_dir
    from pdlab.recipe.model import ModelSpec

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lens]
    path = model_dir(ModelSpec.from_raw({"preset": args.preset}, "model"))
    pf = os.path.join(tempfile.mkdtemp(prefix="pdlab-bench-"), "prompts.json")
    json.dump(prompts, open(pf, "w"))
    core = str(args.core)
    pin = ["taskset", "-c", core]
    common = ["benchmarks/bench_vllm.py", "--prompts-file", pf, "--new-tokens", str(args.new_tokens),
              "--token-budget", str(args.token_budget)]
    cmds = {"pdlab": (pin + [sys.executable, *common, "--pdlab-worker", "--preset", args.preset],
                      {"OMP_NUM_THREADS": "1"}),
            "vllm": (pin + [args.vllm_python, *common, "--vllm-worker", "--model-dir", path],
                     {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": "2"})}
    ratios, rows = [], []
    for i in range(args.pairs):
        order = ["pdlab", "vllm"] if i % 2 == 0 else ["vllm", "pdlab"]
        res = {name: one(*cmds[name]) for name in order}
        same = sum(a == b for a, b in zip(res["pdlab"]["outputs"], res["vllm"]["outputs"]))
        ratio = res["vllm"]["seconds"] / res["pdlab"]["seconds"]
        ratios.append(ratio)
        rows.append({"pair": i + 1, "first": order[0], "pdlab_s": res["pdlab"]["seconds"],
                     "vllm_s": res["vllm"]["seconds"], "pdlab_throughput_vs_vllm": ratio,
                     "outputs_equal": f"{same}/{len(prompts)}"})
        print(json.dumps(rows[-1]), flush=True)
    out_tokens = args.prompts * args.new_tokens
    print(json.dumps({"prompts": args.prompts, "input_tokens": sum(lens), "output_tokens": out_tokens,
                      "median_pdlab_throughput_vs_vllm": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
