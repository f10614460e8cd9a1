"""`pdlab doctor`: what this machine offers for PD disaggregation, measured.

Devices (CPU cores and memory; GPUs through nvidia-ml-py: name, memory, driver, peer-access / NVLink
matrix) and one probe per transport: effective GB/s of a KV-sized hand-over next to a plain copy of the
same bytes in the same run. A transport that is unavailable, or would take a slower path, says why.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pdlab.constants import SHM_DIR


def cpu_info() -> dict:
    from pdlab.measure.records import cpu_model

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
    import torch

    from pdlab.engine import cpu_kernel
    from pdlab.engine.kernel_check import Shape, choose
    from pdlab.engine.model import PRESETS

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


def main(json_: bool = False, probe_mb: float = 0.0) -> int:
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
