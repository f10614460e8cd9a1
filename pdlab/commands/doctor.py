"""`pdlab doctor`: what this machine offers for PD disaggregation, measured.

Devices (CPU cores and memory; GPUs through nvidia-ml-py: name, memory, driver, peer-access / NVLink
matrix) and one probe per transport: effective GB/s of a KV-sized hand-over next to a plain copy of the
same bytes in the same run. A transport that is unavailable, or would take a slower path, says why.
With `--peer tcp://HOST:PORT`: NIXL to another node, whose agent (`pdlab worker --join`) joins the doctor as it
would join a run (pdlab.serve.peer_doctor): pull and push at a few sizes, latency, the path UCX took.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

from pdlab.constants import JOIN_TIMEOUT_S, SHM_DIR
from pdlab.engine.model import PRESETS
from pdlab.measure.records import cpu_model
from pdlab.serve.curve import ClusterKeys, KeysError


def cpu_info() -> dict:
    model = cpu_model() or ""
    mem = {}
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                k, v = ln.split(":", 1)
                mem[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    shm_free = 0
    try:
        st = os.statvfs(SHM_DIR)
        shm_free = st.f_bavail * st.f_frsize
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "usable_cores": sorted(os.sched_getaffinity(0)),
            "memory_bytes": mem.get("MemTotal", 0), "available_bytes": mem.get("MemAvailable", 0),
            "dev_shm_free_bytes": shm_free, "kernels": kernel_info()}


def kernel_info(preset: str = "cpu-demo") -> dict:
    """The CPU kernels' build, and what a one-core worker of `preset` would choose here (timed as a worker
    times them, on one torch thread; the verdict is cached, so a run's workers then read it)."""
    # deferred: torch
    import torch

    from pdlab.engine import cpu_kernel
    from pdlab.engine.kernel_check import Shape, choose

    p = PRESETS[preset]
    shape = Shape(p.heads, p.kv_heads, p.head_dim or p.hidden_size // p.heads, p.hidden_size, p.intermediate_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choices = {n: c.to_dict() | {"line": c.describe()} for n, c in choose(shape, torch.float32).items()}
    finally:
        torch.set_num_threads(threads)
    return {"build": cpu_kernel.status(), "preset": preset, "shape": shape.key(), "choices": choices}


def gpu_info() -> dict:
    """GPUs through NVML, with the peer-access matrix (P2P read) and NVLink links per GPU."""
    try:
        # deferred: pynvml
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver or no library
        return {"available": False, "reason": f"NVML not available ({type(e).__name__}: {e})", "gpus": []}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        n = pynvml.nvmlDeviceGetCount()
        hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        gpus = []
        for i, h in enumerate(hs):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            links = 0
            for link in range(18):
                try:
                    links += int(pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED)
                except Exception:  # noqa: BLE001 - no such link / not supported
                    break
            gpus.append({"index": i, "name": _s(pynvml.nvmlDeviceGetName(h)), "memory_bytes": int(mem.total),
                         "free_bytes": int(mem.free), "nvlinks": links})
        peer = [[_p2p(pynvml, a, b) if a is not b else "self" for b in hs] for a in hs]
        return {"available": True, "driver": _s(driver), "gpus": gpus, "peer": peer}
    finally:
        pynvml.nvmlShutdown()


def _p2p(pynvml: Any, a: Any, b: Any) -> str:
    try:
        if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK:
            return "nvlink"
        if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ) == pynvml.NVML_P2P_STATUS_OK:
            return "pcie"
        return "none"
    except Exception:  # noqa: BLE001
        return "unknown"


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def main(json_: bool = False, probe_mb: float = 0.0, peer: Optional[str] = None, keys: Optional[str] = None,
         insecure: bool = False, ucx_tls: str = "auto", wait_s: float = JOIN_TIMEOUT_S) -> int:
    if peer is not None:
        return peer_main(peer, keys, insecure, ucx_tls, wait_s, json_)
    # deferred: torch
    import torch

    from pdlab.kv.probe import kv_shape, probe_all, shape_for_mb

    torch.set_num_threads(1)  # a worker on one core copies with one thread
    shape = kv_shape("cpu-demo", 2048)
    what = "a 2048-token cpu-demo prompt's KV"
    if probe_mb > 0:  # megabytes (10^6 bytes) of float32 KV, whole blocks
        shape = shape_for_mb(probe_mb, shape)
        what = f"--probe-mb {probe_mb:g}"
    n = 1
    for d in shape:
        n *= d
    size_note = f"{what}: {shape[2]} blocks, {4 * n / 1e6:.1f} MB float32 on CPU, {2 * n / 1e6:.1f} MB bfloat16 on GPU"
    report = {"cpu": cpu_info(), "gpu": gpu_info(), "probe_size": size_note,
              "probes": [r.to_dict() for r in probe_all(shape)],
              "probes_scattered": [r.to_dict() for r in probe_all(shape, scattered=True) if r.available]}
    if json_:
        print(json.dumps(report, indent=2))
        return 0
    _print(report)
    return 0


def _print(r: dict) -> None:
    # deferred: rich
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)  # off a terminal: no 80-column squeeze
    c = r["cpu"]
    con.print(f"[bold]CPU[/] {c['model']}: {c['cores']} cores (usable {c['usable_cores']}), "
              f"{c['memory_bytes'] / 2**30:.1f} GiB memory, {c['dev_shm_free_bytes'] / 2**30:.1f} GiB free in /dev/shm")
    k = c["kernels"]
    con.print(f"  CPU kernels (pdlab.engine.cpu_kernel): {k['build']}; for a {k['preset']} worker here:")
    for name, choice in k["choices"].items():
        con.print(f"    {name}: {choice['line']}")
    g = r["gpu"]
    if not g["available"] or not g["gpus"]:
        con.print(f"[bold]GPU[/] none: {g.get('reason', 'NVML reports 0 devices')}")
    else:
        con.print(f"[bold]GPU[/] driver {g['driver']}")
        for d in g["gpus"]:
            con.print(f"  cuda:{d['index']} {d['name']}, {d['memory_bytes'] / 2**30:.0f} GiB "
                      f"({d['free_bytes'] / 2**30:.0f} free), {d['nvlinks']} NVLink links")
        if len(g["gpus"]) > 1:
            t = Table("peer", *[f"cuda:{i}" for i in range(len(g["gpus"]))], title="GPU peer access")
            for i, row in enumerate(g["peer"]):
                t.add_row(f"cuda:{i}", *row)
            con.print(t)
    t = Table("transport", "status", "hand-over GB/s", "baseline GB/s", "ratio", "baseline / note",
              title=f"KV hand-over probe ({r['probe_size']}, best of 20)")
    scattered = {p["transport"]: p for p in r["probes_scattered"]}
    for p in r["probes"]:
        if not p["available"]:
            t.add_row(p["transport"], "[red]unavailable[/]", "-", "-", "-", p["note"])
            continue
        note = p["baseline"] + (f"; {p['note']}" if p["note"] else "")
        fallback = "FALLBACK" in p["note"] or "NO peer" in p["note"]
        t.add_row(p["transport"], "[yellow]slow path[/]" if fallback else "[green]ok[/]",
                  f"{p['handover_gbps']:.1f}", f"{p['baseline_gbps']:.1f}", f"{p['ratio']:.0%}", note)
        s = scattered.get(p["transport"])
        if s:
            t.add_row("", "scattered blocks", f"{s['handover_gbps']:.1f}", f"{s['baseline_gbps']:.1f}",
                      f"{s['ratio']:.0%}", "destination blocks not contiguous (a pool after churn)")
    con.print(t)


def peer_main(peer: str, keys: Optional[str], insecure: bool, ucx_tls: str, wait_s: float, json_: bool) -> int:
    # deferred: numpy, torch
    from pdlab.recipe import RecipeError
    from pdlab.recipe.nixl import INSTALL_HINT, nixl_module
    from pdlab.recipe.nodes import ControlSpec
    from pdlab.serve.peer_doctor import PeerError, probe_peer

    def err(msg: str) -> int:
        print(f"pdlab doctor: error: {msg}", file=sys.stderr)
        return 2

    try:
        if not ControlSpec.from_raw(peer, "--peer").tcp:
            raise RecipeError("")
    except RecipeError:
        return err(f"--peer {peer}: expected tcp://HOST:PORT (the address the node's `pdlab worker --join`s)")
    if nixl_module() is None:
        return err(f"--peer measures NIXL, which is not installed: {INSTALL_HINT}")
    if (keys is None) == (not insecure):
        return err("give --keys DIR (the cluster's keys) or --insecure (plain TCP)")
    try:
        server = ClusterKeys.load(keys, server=True) if keys else None
    except KeysError as e:
        return err(f"--keys: {e}")
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if json_ else (lambda s: print(s, flush=True))
    try:
        report = probe_peer(peer, server, wait_s, ucx_tls, say=say)
    except PeerError as e:
        print(f"pdlab doctor: {e}", file=sys.stderr)
        return 1
    if json_:
        print(json.dumps(report, indent=2))
        return 0
    # deferred: rich
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)
    t = Table("bytes", "blocks", "pull (READ) GB/s", "pull p50 ms", "push (WRITE) GB/s", "push p50 ms",
              title=f"NIXL to node {report['node']} ({report['host']}) via {report['path']}, best of "
                    f"{report['sizes'][0]['repeats']}, every copy checked")
    for r in report["sizes"]:
        t.add_row(f"{r['bytes'] / 1e6:.2f} MB", str(r["blocks"]), f"{r['read_gbps']:.2f}", f"{r['read_ms_p50']:.2f}",
                  f"{r['write_gbps']:.2f}", f"{r['write_ms_p50']:.2f}")
    con.print(t)
    con.print(f"latency: {report['latency_ms']:.3f} ms for {report['latency_bytes'] / 1e3:.0f} kB (pull, median)")
    if report["warning"]:
        con.print(f"[yellow]{report['warning']}[/]")
    return 0
