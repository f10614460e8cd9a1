"""The CPU linears' GEMMs side by side: F.linear, MKL's packing, oneDNN's and pdlab's own (csrc/gemm.c), each
weight shape of benchmarks/bench_vllm_cells.py's models at several row counts, alternated in one process.

Weights cycle over copies adding up to more than the CPU's caches (as a model's layers do, and as
pdlab.engine.packed_linear's race runs), one process pinned to `--core` with `--threads` torch threads. Each
round times every GEMM once over all copies, in a rotating order; the table has the median per call over
rounds and its GFLOP/s. MKL's packing is timed only at its rows (4-128); a packing whose bits do not fit
(pdlab.engine.packed_linear._fits) is marked.

    python benchmarks/bench_gemm.py                                   # every shape, 1 to 512 rows
    python benchmarks/bench_gemm.py --shapes qwen2 --rows 32 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm_cells import SHAPES, VOCAB, select  # noqa: E402
from pdlab.engine import packed_linear as pl  # noqa: E402

COLD_BYTES = 96 << 20


def linears(shape) -> dict[str, tuple[int, int, bool]]:
    """name -> (in, out, bias) of a shape's linears as pdlab multiplies them (q/k/v and gate/up fused)."""
    d, kv = shape.head_dim, shape.kv_heads
    return {"qkv": (shape.hidden, (shape.heads + 2 * kv) * d, shape.arch == "qwen2"),
            "o": (shape.heads * d, shape.hidden, False),
            "gate_up": (shape.hidden, 2 * shape.intermediate, False),
            "down": (shape.intermediate, shape.hidden, False),
            "lm_head": (shape.hidden, VOCAB, False)}


def race(k: int, n: int, bias: bool, rows: int, rounds: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(n * 7 + k)
    copies = max(1, min(32, -(-COLD_BYTES // (n * k * 4))))
    ws = [torch.randn(n, k, generator=g) for _ in range(copies)]
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    calls = {"F.linear": lambda: [F.linear(x, w, b) for w in ws]}
    kinds = (["mkl"] if pl.available() and pl.MIN_ROWS <= rows <= pl.MAX_ROWS else []) + (
        ["dnnl"] if pl.dnnl_available() else []) + (["gemm"] if pl.gemm_available() else [])
    for kind in kinds:
        packed = [pl.Packed(w, b, kind) for w in ws]
        fits = kind == "mkl" or pl._fits(kind, ws[0], b, g) is None
        calls[pl.LABEL[kind] + ("" if fits else " (bits do not fit)")] = (
            lambda packed=packed: [p(x, w, b) for p, w in zip(packed, ws)])
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for name in names:  # a warm-up each
        calls[name]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t) / copies * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", help=f"names or prefixes (default all: {', '.join(SHAPES)})")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=1, help="the first core; the process gets --threads from here")
    a = ap.parse_args()
    shapes = select(a.shapes, SHAPES, "--shapes") if a.shapes else list(SHAPES.values())
    os.sched_setaffinity(0, list(range(a.core, a.core + a.threads)))
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s) from core {a.core}, {a.rounds} rounds, median ms per "
          f"call (GFLOP/s)")
    seen = set()
    for shape in shapes:
        for name, (k, n, bias) in linears(shape).items():
            if (k, n, bias) in seen:
                continue
            seen.add((k, n, bias))
            for rows in a.rows:
                t = race(k, n, bias, rows, a.rounds)
                best = min(t, key=t.get)
                flop = 2 * rows * k * n / 1e6
                cells = "  ".join(f"{kind} {ms:.3f} ({flop / ms:.0f})" for kind, ms in t.items())
                print(f"{shape.name} {name} {k}->{n}{' +bias' if bias else ''} x{rows}: {cells}  | fastest: {best}",
                      flush=True)


if __name__ == "__main__":
    main()
