"""Decode steps with and without MKL's packed GEMM (pdlab.engine.packed_linear), alternated in one process.

One engine per shape of benchmarks/bench_vllm_cells.py (seeded weights, saved to a temporary directory and
loaded as a user's model is), pinned to one core with one torch thread, `--batch` sequences of `--ctx` tokens
decoding; each round times `--steps` decode steps packed and `--steps` with every linear on F.linear
(`unpack`), in alternating order. Both halves compute the same bits (the packed path is used only where its
check found them equal), so the engine's state carries on from one half to the next.

    python benchmarks/bench_packed.py                                   # qwen2 and llama-d128, 32 sequences
    python benchmarks/bench_packed.py --shapes llama-d32 phi3 --batch 8 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import decoding_engine, step_ms  # noqa: E402
from bench_vllm_cells import SHAPES, select  # noqa: E402
from pdlab.engine import load_model  # noqa: E402
from pdlab.engine import packed_linear as pl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen2", "llama-d128"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--core", type=int, default=1)
    a = ap.parse_args()
    os.sched_setaffinity(0, [a.core])
    torch.set_num_threads(1)
    for shape in select(a.shapes, SHAPES, "--shapes"):
        with tempfile.TemporaryDirectory(prefix="pdlab-packed-") as d:
            model = load_model({"path": shape.save(d)})
            eng = decoding_engine(model, a.batch, a.ctx, a.steps * a.rounds * 2 + 8, model.config.vocab_size)
        choice = eng.runner.kernels["packed_linear"]
        if not choice.use:
            print(f"{shape.name}: packed GEMM not used here ({choice.why})")
            continue
        step_ms(eng, 3)
        rows = []
        for r in range(a.rounds):
            got = {}
            for packed in ((True, False) if r % 2 == 0 else (False, True)):
                pl.pack_linears(model) if packed else pl.unpack(model)
                got[packed] = step_ms(eng, a.steps)
            rows.append(got)
            print(f"{shape.name} round {r + 1}: packed {got[True]:.2f} ms, F.linear {got[False]:.2f} ms: "
                  f"x{got[False] / got[True]:.2f}", flush=True)
        ratios = sorted(x[False] / x[True] for x in rows)
        print(f"{shape.name}: {a.batch} sequences of ~{a.ctx} tokens, one core: F.linear / packed step median "
              f"x{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] over {a.rounds} rounds")


if __name__ == "__main__":
    main()
