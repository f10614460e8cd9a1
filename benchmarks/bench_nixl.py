"""NIXL hand-over benchmark (issue 11, item 7): bandwidth and per-transfer latency of the `nixl` transport
against memcpy and the `shm` transport, for one request's KV of 16 to 4,096 tokens, pull and push.

For each prompt length the KV of that many `cpu-demo` tokens (float32, block 16) is handed over from a
prefill pool into reserved blocks of a decode pool, the way a worker does it:

    memcpy     one flat torch copy of the same bytes (the ceiling)
    shm        copy_blocks from a /dev/shm pool into a peer's /dev/shm pool mapped a second time
    nixl-pull  one NIXL READ of every layer's blocks, initiated by the decode side
    nixl-push  one NIXL WRITE per layer, initiated by the prefill side (push writes each layer as it is
               computed; here back to back, so it is the copy cost without the overlap)

Each is timed `--repeats` times after a warm-up; the table gives the median and p90 per-transfer
latency and GB/s at the median. The two NIXL agents live in this process, each with a private pool; UCX
selects the same lanes as for two processes on one node (printed), so this is the loopback cost of the
path a run takes. Run it alone on the machine: on a shared box the numbers are noise.

    python benchmarks/bench_nixl.py [--tokens 16,64,256,1024,4096] [--repeats 50] [--ucx-tls auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: first touch, connection, registration caches
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(kind: str, tokens: int, nbytes: int, secs: list[float]) -> dict:
    med = statistics.median(secs)
    p90 = sorted(secs)[min(len(secs) - 1, int(0.9 * len(secs)))]
    return {"kind": kind, "tokens": tokens, "bytes": nbytes, "median_us": med * 1e6, "p90_us": p90 * 1e6,
            "gbps": nbytes / med / 1e9}


def measure(tokens: int, repeats: int, ucx_tls: str) -> tuple[list[dict], str]:
    import torch

    from pdlab.kv import shm
    from pdlab.kv.nixl_probe import nixl_pair
    from pdlab.kv.probe import kv_shape
    from pdlab.kv.copy import copy_blocks

    shape = kv_shape("cpu-demo", tokens)
    n, layers = shape[2], shape[0]
    dst_shape = shape[:2] + (2 * n,) + shape[3:]
    src_blocks, dst_blocks = list(range(n)), list(range(n, 2 * n))  # reserved blocks: the pool's second half
    rows = []
    flat = torch.randn(shape).reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    out = torch.empty_like(flat)
    rows.append(row("memcpy", tokens, nbytes, timed(lambda: out.copy_(flat), repeats)))

    a, b = shm.create(shape, torch.float32, tag="bench"), shm.create(dst_shape, torch.float32, tag="bench")
    try:
        a.tensor.normal_()
        peer = shm.attach(b.name, dst_shape, torch.float32).tensor
        rows.append(row("shm", tokens, nbytes, timed(lambda: copy_blocks(a.tensor, src_blocks, peer, dst_blocks),
                                                     repeats)))
    finally:
        a.unlink()
        b.unlink()

    with nixl_pair(shape, 2 * n, ucx_tls) as (p, d, prefill_pool, decode_pool):
        pull = timed(lambda: d.copy(prefill_pool, src_blocks, d.pool, dst_blocks), repeats)
        assert torch.equal(d.pool[:, :, dst_blocks], p.pool), "nixl pull: blocks differ"
        d.pool.zero_()

        def push() -> None:
            for layer in range(layers):
                p.copy(p.pool, src_blocks, decode_pool, dst_blocks, layer=layer)

        pushed = timed(push, repeats)
        assert torch.equal(d.pool[:, :, dst_blocks], p.pool), "nixl push: blocks differ"
        rows += [row("nixl-pull", tokens, nbytes, pull), row("nixl-push", tokens, nbytes, pushed)]
        path = prefill_pool.path
    return rows, path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,1024,4096", help="prompt lengths (comma-separated)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--ucx-tls", default="auto", help="UCX_TLS for the NIXL agents (as deployment.nixl.ucx_tls)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as a worker pinned to one core
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}",
                 "repeats": a.repeats, "rows": []}
    print(f"{'tokens':>6} {'kind':10} {'MB':>7} {'median us':>10} {'p90 us':>10} {'GB/s':>7}")
    for tokens in (int(t) for t in a.tokens.split(",")):
        rows, path = measure(tokens, a.repeats, a.ucx_tls)
        res["rows"] += rows
        res["nixl_path"] = path
        for r in rows:
            print(f"{r['tokens']:>6} {r['kind']:10} {r['bytes'] / 1e6:7.2f} {r['median_us']:10.1f} "
                  f"{r['p90_us']:10.1f} {r['gbps']:7.2f}")
    print(f"nixl path: {res['nixl_path']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
