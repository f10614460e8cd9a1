"""How much slower a worker's step is while another core runs a worker's steps (issue 25: the co-run effect).

`pdlab profile` measures steps with the machine's other cores idle; in a run, the other workers step at the
same time, sharing the last-level cache and memory bandwidth (and, in a VM, whatever the host shares). This
measures the ratio directly: decode-only steps of one engine pinned to `--core`, alone and while a second
process steps the same model on `--other`, in alternated rounds (these boxes drift: compare within a round).

    python benchmarks/bench_corun.py                                  # cpu-demo, 8 running sequences of ~300
    python benchmarks/bench_corun.py --batch 32 --ctx 600 --rounds 6

Run it on a quiet machine: anything else on either core is a co-runner too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import decoding_engine as _decoding_engine, step_ms  # noqa: E402
from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model  # noqa: E402


def decoding_engine(preset: str, batch: int, ctx: int, steps: int) -> Engine:
    """bench_engine's decode-only engine, for the preset."""
    model = load_model({"preset": preset})
    return _decoding_engine(model, batch, ctx, steps, model.config.vocab_size)


def co_runner(core: int, preset: str, batch: int, ctx: int, kind: str, ready, stop) -> None:
    os.sched_setaffinity(0, [core])
    torch.set_num_threads(1)
    if kind == "prefill":  # one prompt of `ctx` tokens after another, each prefilled and dropped
        model = load_model({"preset": preset})
        eng = Engine(model, EngineConfig(block_size=16, kv_blocks=2 * (ctx // 16 + 4), token_budget=max(2048, ctx),
                                         max_running=1))
        g = torch.Generator().manual_seed(ctx)
        ready.set()
        n = 0
        while not stop.is_set():
            eng.add(f"p{n}", torch.randint(3, model.config.vocab_size, (ctx,), generator=g).tolist(),
                    SamplingParams(max_tokens=1, ignore_eos=True))
            while eng.seqs and not stop.is_set():
                eng.step()
            n += 1
        return
    while not stop.is_set():
        eng = decoding_engine(preset, batch, ctx, 10_000)
        ready.set()
        for _ in range(5_000):
            if stop.is_set():
                return
            eng.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--batch", type=int, default=8, help="running sequences")
    ap.add_argument("--ctx", type=int, default=300, help="prompt tokens of each")
    ap.add_argument("--steps", type=int, default=60, help="steps per measurement")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--other", type=int, default=0)
    ap.add_argument("--co-runner", choices=("decode", "prefill"), default="decode",
                    help="what the other core runs: the same decode steps, or prefills of --co-prompt tokens")
    ap.add_argument("--co-prompt", type=int, default=1000, help="prompt tokens of a prefill co-runner")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    os.sched_setaffinity(0, [a.core])
    torch.set_num_threads(1)
    eng = decoding_engine(a.preset, a.batch, a.ctx, a.steps * a.rounds * 2 + 8)
    step_ms(eng, 5)  # warm
    ctx = mp.get_context("spawn")
    rows = []
    for r in range(a.rounds):
        order = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
        row = {}
        for mode in order:
            proc = stop = None
            if mode == "beside":
                ready, stop = ctx.Event(), ctx.Event()
                proc = ctx.Process(target=co_runner, args=(a.other, a.preset, a.batch,
                                   a.co_prompt if a.co_runner == "prefill" else a.ctx, a.co_runner, ready, stop), daemon=True)
                proc.start()
                ready.wait(300)
                time.sleep(0.5)
            row[mode] = step_ms(eng, a.steps)
            if proc is not None:
                stop.set()
                proc.join(60)
        row["ratio"] = row["beside"] / row["alone"]
        rows.append(row)
        print(f"round {r + 1}: alone {row['alone']:.2f} ms, beside a {a.co_runner} co-runner on cpu:{a.other} "
              f"{row['beside']:.2f} ms: x{row['ratio']:.2f}", flush=True)
    ratios = sorted(x["ratio"] for x in rows)
    print(f"{a.preset}, {a.batch} sequences of ~{a.ctx} tokens, cpu:{a.core} beside cpu:{a.other} "
          f"({platform.processor() or platform.machine()}): median x{statistics.median(ratios):.2f} "
          f"[{ratios[0]:.2f}-{ratios[-1]:.2f}] over {a.rounds} rounds")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rounds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
