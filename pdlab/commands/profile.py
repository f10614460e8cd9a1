"""`pdlab profile`: measure this device's engine steps and KV transfers, fit a timing profile, write it.

The profile (pdlab/recipe/timing.py) is what a recipe's `model.timing` takes: a timed run then waits out the
fitted step time instead of running the model. This command measures the real engine in this process on
the device at hand: a designed set of prefill-only, decode-only and mixed steps (pdlab.timing.measure),
each with the counts the timed engine uses and its measured time; fits the step model by non-negative
least squares on relative residuals (pdlab.timing.fit) on a training split of the cases and reports the
error on the held-out cases; probes the transports usable here at several sizes and fits latency +
bytes / bandwidth; and writes the YAML (pdlab.timing.write).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from typing import Optional

DEFAULT_STEPS = 400
MIN_STEPS = 12
TEST_FRACTION = 0.3


def default_out(model: str, device: str) -> str:
    """profiles/<model>-<device>.yaml under the current directory: profiles/cpu-demo-cpu.yaml,
    profiles/gpu-0.6b-cuda0.yaml."""
    base = os.path.basename(os.path.normpath(os.path.expanduser(model))) or "model"
    return os.path.join("profiles", f"{base}-{re.sub(r'[^A-Za-z0-9]+', '', device)}.yaml")


def main(model: str = "cpu-demo", device: str = "cpu", dtype: Optional[str] = None, out: Optional[str] = None,
         steps: int = DEFAULT_STEPS, seed: int = 0, threads: Optional[int] = None, quiet: bool = False) -> int:
    def say(msg: str = "") -> None:
        if not quiet:
            print(msg, flush=True)

    if steps < MIN_STEPS:
        print(f"error: --steps must be at least {MIN_STEPS} (5 terms to fit and steps held out), got {steps}",
              file=sys.stderr)
        return 2
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        print(f"error: --device must be cpu or cuda[:N], got {device!r}", file=sys.stderr)
        return 2
    if threads is not None and threads < 1:
        print(f"error: --threads must be at least 1, got {threads}", file=sys.stderr)
        return 2

    import numpy as np
    import torch

    from pdlab.engine import Engine, EngineConfig, ModelLoadError, load_model
    from pdlab.engine.model import model_dims
    from pdlab.timing import fit as F
    from pdlab.timing.measure import Limits, describe_device, design, kv_memory_gb, measure_steps, probe_transfers
    from pdlab.timing.write import profile_raw, write_profile

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"error: --device {device}: no CUDA device visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    dtype = dtype or ("bfloat16" if cuda else "float32")
    out = out or default_out(model, device)
    before = torch.get_num_threads()
    if not cuda or threads is not None:
        threads = threads or 1  # a CPU worker runs on one core with one thread
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    try:
        try:
            m = load_model(model, dtype=dtype, device=device)
        except ModelLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        dims = model_dims(m)
        where = describe_device(device, used_threads)
        mem_gb = kv_memory_gb(device)  # before any pool: what "auto" sizing would see
        lim = Limits.for_device("cuda" if cuda else "cpu", dims["max_model_len"])
        rng = np.random.default_rng(seed)
        cases = design(steps, lim, rng)
        say(f"profiling {model} ({dtype}) on {device}: {where}; {len(cases)} cases, about {steps} steps "
            f"(prompts/contexts up to {lim.max_context} tokens, up to {lim.max_batch} decodes a step)")
        t0 = time.monotonic()
        last = [t0]

        def progress(done: int, n: int) -> None:
            if time.monotonic() - last[0] > 10:
                last[0] = time.monotonic()
                say(f"  {done}/{len(cases)} cases, {n} steps, {last[0] - t0:.0f} s")

        samples = measure_steps(m, cases, lim, rng, progress)
        took = time.monotonic() - t0
        train, test = F.split_by_case(samples, {i: c.kind for i, c in enumerate(cases)}, TEST_FRACTION,
                                      np.random.default_rng(seed + 1))
        coef = F.fit_steps(train)
        held, train_err = F.errors(coef, test), F.errors(coef, train)
        kinds = F.by_kind(coef, test)
        kv_per_token = Engine(m, EngineConfig(block_size=16, kv_blocks=1)).block_bytes // 16
        transfers = probe_transfers(dims, "cuda" if cuda else "cpu", next(m.parameters()).dtype)
    finally:
        torch.set_num_threads(before)

    usable = {k: t for k, t in transfers.items() if np.isfinite(t["gbps"])}
    date = datetime.date.today().isoformat()
    fit = {
        "method": "non-negative least squares on relative residuals (each step weighted by 1 / its time)",
        "split": f"by case: {TEST_FRACTION:.0%} of the designed cases of each kind held out",
        "train_steps": len(train), "test_steps": len(test),
        "held_out": _drop_steps(held), "held_out_by_kind": kinds, "train": _drop_steps(train_err),
        "steps_by_kind": {k: sum(s.kind == k for s in samples) for k in F.KINDS},
        "measured_s": round(took, 1), "dtype": dtype, "threads": used_threads,
        "torch": torch.__version__, "seed": seed,
        "transfer": {k: {"bytes": t["bytes"], "ms": t["ms"], "baseline_gbps": t["baseline_gbps"], "note": t["note"]}
                     for k, t in transfers.items()},
    }
    name = os.path.splitext(os.path.basename(out))[0]
    raw = profile_raw(name=name, source="measured", device=where, date=date, model=model, step=coef,
                      kv_bytes_per_token=kv_per_token, kv_memory_gb=mem_gb, transfer=usable, fit=fit)
    header = (f"Timing profile measured by `pdlab profile --model {model} --device {device} --dtype {dtype} "
              f"--steps {steps} --seed {seed}`\n"
              f"on {where}, {date} ({len(samples)} engine steps in {took:.0f} s).\n"
              "step: ms per engine step = fixed_ms + prefill_token_ms x prefill tokens + prefill_attention_ms x "
              "(prefill token x context pairs) / 1000\n"
              "      + decode_seq_ms x decode sequences + context_token_ms x context tokens of the decodes.\n"
              "fit: percentage errors of that model on held-out steps (mape = mean absolute percentage error).\n"
              "kv_memory_gb: the memory a timed engine takes kv_memory_fraction of (the free device memory; on CPU\n"
              "min(available, 1 GiB / the default fraction), so a timed pool matches the real one).\n"
              "transfer: latency + bytes / bandwidth fitted to pdlab.kv.probe hand-overs (best of 10) at "
              f"{len(next(iter(transfers.values()))['bytes']) if transfers else 0} sizes.")
    try:
        write_profile(out, raw, header)
    except OSError as e:
        print(f"error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2

    say(f"measured {len(samples)} steps in {took:.1f} s ({len(train)} to fit, {len(test)} held out)")
    say(format_step(coef))
    say(format_errors("held-out error", held))
    for k in F.KINDS:
        say(format_errors(f"  {k}", kinds[k]))
    say(format_errors("training error", train_err))
    say(f"KV {kv_per_token} bytes/token; kv_memory_gb {mem_gb:.3g}")
    for k, t in transfers.items():
        sizes = ", ".join(f"{b / 1e6:.2f} MB {ms:.3f} ms" for b, ms in zip(t["bytes"], t["ms"]))
        base = ", ".join(f"{g:.3g}" for g in t["baseline_gbps"])
        say(f"transfer {k}: {t['gbps']:.3g} GB/s, latency {t['latency_ms']:.3g} ms (from {sizes}; "
            f"a plain copy of the same bytes: {base} GB/s)")
    if not transfers:
        say("transfer: no transport measured")
    say(f"wrote {out}")
    return 0


def _drop_steps(e: dict) -> dict:
    return {k: v for k, v in e.items() if k != "steps"}


def format_step(c: dict) -> str:
    return (f"step ms = {c['fixed_ms']:.4g} + {c['prefill_token_ms']:.4g} x prefill tokens + "
            f"{c['prefill_attention_ms']:.4g} x pairs/1000 + {c['decode_seq_ms']:.4g} x decode seqs + "
            f"{c['context_token_ms']:.4g} x context tokens")


def format_errors(label: str, e: dict) -> str:
    if not e.get("steps"):
        return f"{label}: no steps"
    r2 = f", R^2 {e['r2']:.4f}" if e.get("r2") is not None else ""
    return (f"{label} ({e['steps']} steps): MAPE {e['mape_pct']:.1f}%, p90 {e['p90_pct']:.1f}%, "
            f"max {e['max_pct']:.1f}%{r2}")
