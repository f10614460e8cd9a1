"""KV transfer benchmark (issue 3).

1. Bandwidth: per available transport, a KV hand-over of a 2k-token `cpu-demo` prompt against a plain
   copy of the same bytes in the same run (target: shm >= 90% of memcpy), contiguous and scattered
   destination blocks; several rounds, the median of each round's best.
2. Push vs pull: a 1P1D cluster (prefill cpu:0, decode cpu:1, shm), 2k-token prompts sent one at a time
   (no queueing, prefix cache off). From the router's phase timestamps:
     transfer  = pull's copy time (transfer_end - transfer_start)
     penalty   = what the hand-over adds to TTFT beyond prefill compute, each from one run's own timestamps
                 (comparing prefill times across runs drowns a ~1 ms copy in load noise on a shared box):
                 pull: admitted - prefill_end (router hop + copy on the decode side)
                 push: admitted - prefill_end (wait for the last layer's copy + router hop)
                       + copy time of the other layers: on a worker pinned to one core those copies
                       take their time from the compute they overlap (an upper bound; on GPU they run
                       on copy engines and cost ~0)
     hidden    = (pull penalty - push penalty) / transfer   (target: >= 80%)

    python benchmarks/bench_transfer.py [--requests 12] [--tokens 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def bandwidth(rounds: int) -> list[dict]:
    import torch

    from pdlab.kv.probe import kv_shape, probe_all

    torch.set_num_threads(1)  # as in a worker pinned to one core
    shape = kv_shape("cpu-demo", 2048)
    out = []
    for scattered in (False, True):
        runs: dict[str, list] = {}
        for _ in range(rounds):
            for r in probe_all(shape, repeats=30, scattered=scattered):
                if r.available:
                    runs.setdefault(r.transport, []).append(r)
        for name, rs in runs.items():
            out.append({"transport": name, "layout": "scattered" if scattered else "contiguous",
                        "bytes": rs[0].bytes, "handover_gbps": statistics.median(r.handover_gbps for r in rs),
                        "baseline_gbps": statistics.median(r.baseline_gbps for r in rs),
                        "ratio": statistics.median(r.ratio for r in rs), "baseline": rs[0].baseline})
    return out


def ttft_run(mode: str, n: int, tokens: int) -> list[dict]:
    import torch

    from pdlab.engine.config import EngineConfig
    from pdlab.engine.model import PRESETS
    from pdlab.recipe import Deployment, ModelSpec
    from pdlab.serve.cluster import Cluster, RequestDone, TokenEvent, TransferEvent

    g = torch.Generator().manual_seed(0)
    engine = EngineConfig(block_size=16, kv_blocks=512, token_budget=4096, prefix_caching=False)
    dep = Deployment.from_raw({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm",
                               "mode": mode}, "deployment")
    rows = []
    with Cluster(ModelSpec(preset="cpu-demo"), engine, dep) as c:
        c.start()
        for i in range(n + 1):  # the first request warms up and is dropped
            c.submit(f"{mode}{i}", torch.randint(3, 4000, (tokens,), generator=g).tolist(),
                     {"max_tokens": 2, "ignore_eos": True})
            first, done, rec = None, None, None
            deadline = time.monotonic() + 60
            while done is None and time.monotonic() < deadline:
                for e in c.poll(1.0):
                    if isinstance(e, TokenEvent) and e.index == 0:
                        first = e.t
                    elif isinstance(e, TransferEvent):
                        rec = e.record
                    elif isinstance(e, RequestDone):
                        done = e
            if done is None or not done.ok:
                raise RuntimeError(f"{mode} request {i} failed: {done}")
            if i:
                p, layers = done.phases, PRESETS["cpu-demo"].layers
                exposed = p["admitted"] - p["prefill_end"]
                overlapped = rec["copy_s"] * (layers - 1) / layers if mode == "push" else 0.0
                rows.append({"ttft": first - p["queued"], "prefill": p["prefill_end"] - p["prefill_start"],
                             "copy": rec["copy_s"], "window": rec["end"] - rec["start"],
                             "exposed": exposed, "penalty": exposed + overlapped})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}",
                 "bandwidth": bandwidth(a.rounds)}
    for b in res["bandwidth"]:
        print(f"{b['transport']:9s} {b['layout']:10s} {b['bytes'] / 1e6:6.1f} MB  hand-over {b['handover_gbps']:6.1f} "
              f"GB/s  {b['baseline']} {b['baseline_gbps']:6.1f} GB/s  ratio {b['ratio']:.0%}")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    pull, push = ttft_run("pull", a.requests, a.tokens), ttft_run("push", a.requests, a.tokens)
    transfer = med(pull, "copy")
    pull_pen, push_pen = med(pull, "penalty"), med(push, "penalty")
    res["push_vs_pull"] = {
        "tokens": a.tokens, "requests": a.requests, "ttft_pull_ms": med(pull, "ttft") * 1e3,
        "ttft_push_ms": med(push, "ttft") * 1e3, "prefill_pull_ms": med(pull, "prefill") * 1e3,
        "prefill_push_ms": med(push, "prefill") * 1e3, "transfer_ms": transfer * 1e3,
        "push_copy_ms": med(push, "copy") * 1e3, "push_copy_window_ms": med(push, "window") * 1e3,
        "pull_exposed_ms": med(pull, "exposed") * 1e3, "push_exposed_ms": med(push, "exposed") * 1e3,
        "pull_penalty_ms": pull_pen * 1e3,
        "push_penalty_ms": push_pen * 1e3, "hidden_share": (pull_pen - push_pen) / transfer if transfer else 0.0,
    }
    for k, v in res["push_vs_pull"].items():
        print(f"{k:20s} {v:.3f}" if isinstance(v, float) else f"{k:20s} {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
