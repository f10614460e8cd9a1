"""Engine benchmark: offline throughput against transformers, per-step overhead, compute floor.

One run, same prompts, side by side (these machines are noisy: compare within a run, not across):
  1. pdlab's engine, all requests added at once (continuous batching on a token budget);
  2. transformers' own continuous batching (`generate_batch`);
  3. transformers' padded batched `generate` (left padding, one batch);
  4. the compute floor: the workload's FLOPs / the single-core matmul rate measured now;
  5. pdlab's per-step overhead (step time outside the model forward) at 1, 16 and 64 running sequences.
The output's `attention` says which attention kernel the engine ran (sdpa on CPU; flash-attn or
sdpa-expanded on CUDA, pdlab.engine.cuda_attention).

    python benchmarks/bench_engine.py                      # cpu-demo, 32 prompts of 200-1000 tokens x 64
    python benchmarks/bench_engine.py --device cuda --dtype bfloat16 --preset gpu-0.6b --prompts 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model
from pdlab.engine.cuda_attention import describe as describe_attention
from pdlab.engine.model import model_dims


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """Bytes moved per second by a large copy, counting the read and the write."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * nbytes * 5 / (time.perf_counter() - t)  # read + write


def workload_flops(model, prompts: list[list[int]], new: int) -> float:
    """Matmul FLOPs of serving the workload: weights for every token, lm_head for every sampled token,
    attention scores and values over each token's context."""
    cfg = model.config
    d = model_dims(model)
    body = sum(p.numel() for n, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    head = cfg.hidden_size * cfg.vocab_size
    attn_per_ctx = 4 * d["layers"] * cfg.num_attention_heads * d["head_dim"]  # QK^T + AV, per context token
    total = 0.0
    for p in prompts:
        n_all = len(p) + new - 1  # tokens that go through the model
        total += 2 * body * n_all + 2 * head * new
        total += attn_per_ctx * sum(range(1, n_all + 1))
    return total


def roofline_floor(model, prompts: list[list[int]], new: int, flops_s: float, bytes_s: float) -> float:
    """A floor that also counts memory: prefill is compute-bound (its FLOPs / the matmul rate); each of the
    `new - 1` decode steps of the whole batch must at least read the weights and every request's KV once
    (bytes / copy bandwidth), or do its FLOPs, whichever takes longer."""
    d = model_dims(model)
    dtype_bytes = next(model.parameters()).element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n) * dtype_bytes
    kv_per_token = d["layers"] * 2 * d["kv_heads"] * d["head_dim"] * dtype_bytes
    prefill = workload_flops(model, [p[:-1] for p in prompts], 1)  # every prompt token but the last once
    t = prefill / flops_s
    decode_flops_per_step = (workload_flops(model, prompts, new) - prefill) / new
    for step in range(new):
        kv = sum(len(p) + step for p in prompts) * kv_per_token
        t += max((weights + kv) / bytes_s, decode_flops_per_step / flops_s)
    return t


def run_pdlab(model, prompts, new, cfg: EngineConfig) -> tuple[float, dict, list]:
    eng = Engine(model, cfg)  # allocating (zeroing) the pool is start-up, not serving: outside the timer
    for i, p in enumerate(prompts):
        eng.add(str(i), p, SamplingParams(max_tokens=new, ignore_eos=True))
    outs = {str(i): [] for i in range(len(prompts))}
    records = []
    t = time.perf_counter()
    while eng.has_work():
        step = eng.step()
        records.append(step.record)
        for tok in step.tokens:
            outs[tok.req_id].append(tok.token_id)
    sync(str(eng.device))
    return time.perf_counter() - t, outs, records


def hf_model(model):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa", dtype=next(model.parameters()).dtype)
    ref.load_state_dict(model.state_dict())
    ref.config._attn_implementation = "sdpa"
    return ref.to(next(model.parameters()).device).eval()


def run_generate_batch(ref, prompts, new) -> tuple[float, dict]:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    res = ref.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False)
    dt = time.perf_counter() - t
    outs = {}
    for i, r in enumerate(res.values()):
        outs[str(i)] = list(r.generated_tokens)
    return dt, outs


def run_padded_generate(ref, prompts, new) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    dev = next(ref.parameters()).device
    t = time.perf_counter()
    with torch.inference_mode():
        ref.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                     do_sample=False, pad_token_id=0)
    sync(str(dev))
    return time.perf_counter() - t


def decoding_engine(model, batch: int, ctx: int, steps: int, vocab: int) -> Engine:
    """An engine with `batch` random prompts of `ctx` tokens prefilled, ready for `steps` decode-only steps
    (benchmarks/bench_corun.py uses it too)."""
    g = torch.Generator().manual_seed(batch)
    eng = Engine(model, EngineConfig(block_size=16, kv_blocks=batch * ((ctx + steps + batch) // 16 + 4),
                                     token_budget=max(2048, ctx), max_running=batch))
    for i in range(batch):
        eng.add(str(i), torch.randint(3, vocab, (ctx,), generator=g).tolist(),
                SamplingParams(max_tokens=steps + batch + 16, ignore_eos=True))
    while eng.num_waiting or any(s.num_computed < s.prompt_len for s in eng.seqs.values()):
        eng.step()
    return eng


def step_ms(eng: Engine, steps: int) -> float:
    """The median step of `eng` over its next `steps` steps, in ms (bench_corun.py and bench_packed.py)."""
    ms = []
    for _ in range(steps):
        r = eng.step().record
        ms.append((r.end - r.start) * 1e3)
    return statistics.median(ms)


def step_overhead(model, batch: int, ctx: int, steps: int, vocab: int) -> dict:
    """Decode-only steps with `batch` running sequences of ~`ctx` tokens."""
    eng = decoding_engine(model, batch, ctx, steps, vocab)
    for _ in range(3):
        eng.step()
    total = fwd = 0.0
    for _ in range(steps):
        r = eng.step().record
        assert r.decode_seqs == batch
        total += r.end - r.start
        fwd += r.forward_s
    return {"running": batch, "step_ms": 1000 * total / steps, "forward_ms": 1000 * fwd / steps,
            "overhead_pct": 100 * (total - fwd) / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = one core)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model({"preset": args.preset, "dtype": args.dtype, "device": args.device})
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    tdtype = next(model.parameters()).dtype
    res: dict = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}",
                 "device": args.device, "threads": args.threads, "torch": torch.__version__,
                 "preset": args.preset, "dtype": args.dtype, "prompts": args.prompts,
                 "prompt_lens": [min(lens), max(lens), sum(lens)], "new_tokens": args.new,
                 "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name()
    out_tokens = args.prompts * args.new
    res["matmul_gflops"] = matmul_rate(args.device, tdtype) / 1e9
    res["workload_gflop"] = workload_flops(model, prompts, args.new) / 1e9
    res["floor_s"] = res["workload_gflop"] / res["matmul_gflops"]
    res["copy_gb_s"] = copy_bandwidth(args.device) / 1e9
    res["roofline_floor_s"] = roofline_floor(model, prompts, args.new, res["matmul_gflops"] * 1e9,
                                             res["copy_gb_s"] * 1e9 / 2)

    run_pdlab(model, prompts[:2], 4, EngineConfig(kv_blocks=256))  # warm-up
    cfg = EngineConfig(block_size=16, kv_blocks="auto", token_budget=2048, max_running=64)
    dims = model_dims(model)
    res["attention"] = describe_attention(torch.device(args.device).type, tdtype, dims["head_dim"], cfg.block_size)
    dt, outs, records = run_pdlab(model, prompts, args.new, cfg)
    steps = [r for r in records if r]
    res["pdlab"] = {"seconds": dt, "out_tok_s": out_tokens / dt, "total_tok_s": (out_tokens + sum(lens)) / dt,
                    "steps": len(steps), "forward_share": sum(r.forward_s for r in steps) / dt}
    res["pdlab_vs_floor"] = dt / res["floor_s"]
    res["pdlab_vs_roofline_floor"] = dt / res["roofline_floor_s"]
    if not args.skip_hf:
        ref = hf_model(model)
        dt_cb, outs_cb = run_generate_batch(ref, prompts, args.new)
        same = sum(outs_cb.get(k) == v for k, v in outs.items())
        res["hf_generate_batch"] = {"seconds": dt_cb, "out_tok_s": out_tokens / dt_cb,
                                    "identical_outputs": f"{same}/{len(outs)}"}
        dt_pad = run_padded_generate(ref, prompts, args.new)
        res["hf_padded_generate"] = {"seconds": dt_pad, "out_tok_s": out_tokens / dt_pad}
        res["speedup_vs_generate_batch"] = dt_cb / dt
        res["speedup_vs_padded_generate"] = dt_pad / dt
    res["step_overhead"] = [step_overhead(model, b, 256, 32, vocab) for b in (1, 16, 64)]
    if args.device.startswith("cuda"):
        d = model_dims(model)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for row in res["step_overhead"]:
            kv = row["running"] * (256 + 16) * d["layers"] * 2 * d["kv_heads"] * d["head_dim"] * tdtype.itemsize
            row["bandwidth_floor_ms"] = 1000 * (weights + kv) / (res["copy_gb_s"] * 1e9 / 2)
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
