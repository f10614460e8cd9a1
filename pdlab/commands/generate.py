"""`pdlab generate`: offline generation with the engine in this process, as a quick check."""

from __future__ import annotations

import sys
import time


def main(model: str, prompts: int, prompt_len: int, max_tokens: int, device: str, seed: int) -> int:
    # deferred: torch
    import torch

    from pdlab.engine import Engine, EngineConfig, ModelLoadError, RequestError, SamplingParams, load_model

    try:
        m = load_model(model, device=device, seed=seed)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = m.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    eng = Engine(m, EngineConfig(kv_blocks="auto", max_running=max(prompts, 1)))
    try:
        for i in range(prompts):
            ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            eng.add(str(i), ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    outs: dict[str, list[int]] = {str(i): [] for i in range(prompts)}
    steps = 0
    t0 = time.monotonic()
    while eng.has_work():
        out = eng.step()
        steps += out.record is not None
        for t in out.tokens:
            if t.token_id is not None:
                outs[t.req_id].append(t.token_id)
    dt = time.monotonic() - t0
    n_out = sum(len(v) for v in outs.values())
    print(f"model {model} on {device}: {prompts} prompts x {prompt_len} tokens -> {n_out} new tokens "
          f"in {dt:.2f} s over {steps} steps ({n_out / dt:.1f} output tok/s, "
          f"{(n_out + prompts * prompt_len) / dt:.1f} total tok/s)")
    for k in list(outs)[:3]:
        print(f"  request {k}: {outs[k][:16]}{' ...' if len(outs[k]) > 16 else ''}")
    return 0
