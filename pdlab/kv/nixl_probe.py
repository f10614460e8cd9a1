"""Measured NIXL hand-over next to memcpy, and which UCX transports it actually took (`pdlab doctor`).

Two NIXL agents in this process, each with its own private pool (no shared memory), connected the way two
workers are (exported handle -> open). UCX picks the same lanes for two agents in one process as for two
processes on one node (checked: `rma_am(tcp/lo) am(tcp/lo cma/memory)` either way on a CPU box), so the
lanes and GB/s shown are those a run on this node gets. A path that moves the data (the rma lanes) over
TCP while shared memory (one node) or RDMA devices are there is reported as a FALLBACK: the silent slow
path NIXL users report (pull at 0.5 GB/s against 49 GB/s for push, same node).
"""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from typing import Iterator

import torch

from pdlab.kv.nixl import NixlTransport
from pdlab.kv.probe_result import ProbeResult, best_of
from pdlab.kv.ucx_log import rma_over_tcp
from pdlab.recipe.nixl import INSTALL_HINT, nixl_module, rdma_devices


@contextmanager
def nixl_pair(shape: tuple[int, ...], dst_blocks: int, ucx_tls: str = "auto",
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> Iterator[tuple]:
    """(prefill side, decode side, prefill pool as the decode side sees it, decode pool as the prefill side sees it)."""

    tag = secrets.token_hex(3)
    a = NixlTransport("prefill", f"pdlab-probe-{tag}-prefill", ucx_tls=ucx_tls, device=device)
    b = NixlTransport("decode", f"pdlab-probe-{tag}-decode", ucx_tls=ucx_tls, device=device)
    try:
        a.kv_alloc(shape, dtype).normal_()
        b.kv_alloc(tuple(shape[:2]) + (dst_blocks,) + tuple(shape[3:]), dtype)
        yield a, b, b.open(a.export()), a.open(b.export())
    finally:
        b.close()
        a.close()


def path_warning(lanes: str, same_host: bool = True) -> str:
    """'FALLBACK: ...' when the data lanes are TCP although something faster is there; '' otherwise."""

    if not rma_over_tcp(lanes):
        return ""
    rdma = rdma_devices()
    if rdma:
        return (f"FALLBACK: NIXL moves KV over TCP although RDMA devices exist ({', '.join(rdma)}); "
                "add rc (and ud) to nixl.ucx_tls")
    if same_host:
        return ("FALLBACK: NIXL moves KV over TCP loopback although both sides share a node: on one node use "
                "transport shm (cpu) or cuda-ipc (cuda); nixl over TCP is the across-nodes path without RDMA")
    return ""


def probe_nixl(shape: tuple[int, ...], repeats: int = 20, scattered: bool = False,
               ucx_tls: str = "auto") -> ProbeResult:
    """A pull (READ of the prefill pool's blocks into reserved decode blocks) timed against memcpy."""
    if nixl_module() is None:
        return ProbeResult("nixl", False, f"not installed: {INSTALL_HINT}")
    n = shape[2]
    src_blocks = list(range(n))
    dst_blocks = [2 * i for i in range(n)] if scattered else list(range(n))
    try:
        with nixl_pair(shape, 2 * n, ucx_tls) as (a, b, prefill_pool, _):
            nbytes = a.pool.numel() * a.pool.element_size()
            flat_a = torch.ones(a.pool.numel(), dtype=a.pool.dtype)
            flat_b = torch.empty_like(flat_a)
            base = best_of(lambda: flat_b.copy_(flat_a), lambda: None, repeats)
            hand = best_of(lambda: b.copy(prefill_pool, src_blocks, b.pool, dst_blocks), lambda: None, repeats)
            if not torch.equal(b.pool[:, :, dst_blocks], a.pool):
                return ProbeResult("nixl", False, "the READ completed but the blocks differ: NIXL path broken")
            lanes = b.path(prefill_pool.name)  # lanes UCX logged late are read again after the transfers
            note = f"pull READ via {lanes}"
            warning = path_warning(lanes)
            return ProbeResult("nixl", True, f"{note}; {warning}" if warning else note, nbytes, n,
                               nbytes / hand / 1e9, nbytes / base / 1e9, "memcpy (torch copy, same bytes)")
    except Exception as e:  # noqa: BLE001 - the doctor reports it, it does not crash
        return ProbeResult("nixl", False, f"NIXL failed here ({type(e).__name__}: {e}); UCX_TLS={ucx_tls}")
