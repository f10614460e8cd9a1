"""CPU kernels against torch on this machine: one long prefill and decode steps of the engine, in-process on
one core, with every kernel forced on (PDLAB_CPU_KERNEL=on: what pdlab ran before kernels were timed), with
the machine's own choice (auto: each kernel only where it timed faster than torch here) and with none (off).

Each mode runs in its own process (the choice is per process), alternated over `--pairs` rounds, so drift
hits every mode alike; each figure is the best of `--reps` in its process. Tokens must agree across modes.

    python benchmarks/bench_kernels.py                     # cpu-demo, a 1,800-token prefill, batch-8 decode
    python benchmarks/bench_kernels.py --preset tiny-llama --prompt 400 --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("on", "auto", "off")


def worker(preset: str, prompt: int, batch: int, reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model

    model = load_model(preset)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    eng = Engine(model, EngineConfig(block_size=16, kv_blocks=(prompt // 16 + 8) * (batch + 2),
                                     token_budget=max(prompt, 2048), max_running=batch + 1))
    prefill, tokens = [], None
    for r in range(reps):  # one request alone: its prefill step is the first step
        ids = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        eng.add(f"p{r}", ids, SamplingParams(max_tokens=2, ignore_eos=True))
        t = time.perf_counter()
        eng.step()
        prefill.append(time.perf_counter() - t)
        while eng.has_work():
            eng.step()
    for i in range(batch):  # a decode batch at ~prompt/4 context
        eng.add(f"d{i}", torch.randint(3, vocab, (prompt // 4,), generator=g).tolist(),
                SamplingParams(max_tokens=24, ignore_eos=True))
    steps: list[float] = []
    out: dict[str, list[int]] = {}
    while eng.has_work():
        decoding = eng.num_running == batch and not eng.num_waiting
        t = time.perf_counter()
        step = eng.step()
        if decoding and step.record is not None and step.record.prefill_tokens == 0:
            steps.append(time.perf_counter() - t)
        for o in step.tokens:
            out.setdefault(o.req_id, []).append(o.token_id)
    tokens = [out[k] for k in sorted(out) if k.startswith("d")]
    return {"prefill_ms": 1000 * min(prefill), "decode_step_ms": 1000 * statistics.median(steps[2:] or steps),
            "kernels": {n: c.describe() for n, c in eng.runner.kernels.items()}, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--prompt", type=int, default=1800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--worker", choices=MODES)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.preset, a.prompt, a.batch, a.reps)))
        return
    import platform

    from pdlab.engine.kernel_build import cpu_flags

    isa = [f for f in ("avx512f", "avx2", "fma") if f in cpu_flags().split()]
    print(f"machine: {platform.processor() or platform.machine()}, ISA {'+'.join(isa) or 'generic'}, "
          f"{os.cpu_count()} cores; {a.preset}, prompt {a.prompt}, decode batch {a.batch}")
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    for p in range(a.pairs):
        for m in (MODES if p % 2 == 0 else MODES[::-1]):
            env = {**os.environ, "PDLAB_CPU_KERNEL": m}
            r = subprocess.run([sys.executable, __file__, "--worker", m, "--preset", a.preset, "--prompt",
                                str(a.prompt), "--batch", str(a.batch), "--reps", str(a.reps)], env=env,
                               capture_output=True, text=True, check=True)
            res[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
    tokens = {m: rs[0]["tokens"] for m, rs in res.items()}
    print(f"tokens equal across modes: {len({json.dumps(t) for t in tokens.values()}) == 1}")
    for m in MODES:
        pf = [r["prefill_ms"] for r in res[m]]
        dc = [r["decode_step_ms"] for r in res[m]]
        print(f"  {m:>4}: prefill {statistics.median(pf):8.1f} ms (runs {', '.join(f'{x:.0f}' for x in pf)}); "
              f"decode step {statistics.median(dc):6.2f} ms (runs {', '.join(f'{x:.2f}' for x in dc)})")
    print("auto chose:")
    for n, line in res["auto"][0]["kernels"].items():
        print(f"    {n}: {line}")


if __name__ == "__main__":
    main()
