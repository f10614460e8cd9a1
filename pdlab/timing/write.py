"""A timing profile as a YAML file: plain data, readable without pdlab, loadable by pdlab.recipe.load_profile."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Optional

import yaml

from pdlab.timing.pace import READ_MIB

FORMAT_VERSION = 1  # the `pdlab_timing_profile` key: which layout of the file this is


def sig(x: Any, digits: int = 4) -> Any:
    """A float rounded to `digits` significant digits (so the file reads cleanly); other values as they are.
    Lists and dicts are rounded throughout."""
    if isinstance(x, dict):
        return {str(k): sig(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [sig(v, digits) for v in x]
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, str):
        return str(x)  # str subclasses (torch's version string) as plain str: safe_dump takes only those
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        x = float(x)
        return float(f"{x:.{digits}g}") if math.isfinite(x) and x != 0.0 else x
    return x


def profile_raw(*, name: str, source: str, device: str, date: str, model: str, step: dict[str, float],
                kv_bytes_per_token: int, kv_memory_gb: Optional[float], transfer: dict[str, dict],
                fit: Optional[dict] = None, device_kind: str = "", host: Optional[dict] = None,
                kernels: Optional[dict] = None, pace_ms: Optional[float] = None,
                memory_pace_ms: Optional[float] = None, pace_read_mib: Optional[int] = None,
                contention: Optional[dict] = None) -> dict:
    """The profile's plain form, in the order a reader wants it (TimingProfile's keys, and the format mark)."""
    raw: dict[str, Any] = {"pdlab_timing_profile": FORMAT_VERSION, "name": name, "source": source,
                           "device": device}
    if device_kind:
        raw["device_kind"] = device_kind
    raw.update(date=date, model=model, step={k: sig(v) for k, v in step.items()},  # knee_tokens stays an int
               kv_bytes_per_token=int(kv_bytes_per_token))
    if kv_memory_gb is not None:
        raw["kv_memory_gb"] = sig(float(kv_memory_gb))
    raw["transfer"] = {k: {"gbps": sig(float(t["gbps"])), "latency_ms": sig(float(t.get("latency_ms", 0.0)))}
                       for k, t in transfer.items()}
    if host:
        raw["host"] = {k: sig(float(v)) for k, v in host.items()}
    if contention:
        raw["contention"] = sig(contention)  # figures and spreads (lists) alike
    if kernels:
        raw["kernels"] = sig(kernels)
    if pace_ms:
        raw["pace_ms"] = sig(float(pace_ms))
    if memory_pace_ms:
        raw["memory_pace_ms"] = sig(float(memory_pace_ms))
    if pace_ms:  # a pace measured now: its read is this code's unless said
        raw["pace_read_mib"] = int(pace_read_mib or READ_MIB)
    if fit is not None:
        raw["fit"] = sig(fit)
    return raw


def dump_profile(raw: dict, header: str = "") -> str:
    head = "".join(f"# {ln}".rstrip() + "\n" for ln in header.strip("\n").splitlines()) if header else ""
    return head + yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, width=110)


def write_profile(path: str, raw: dict, header: str = "") -> str:
    """Check `raw` as load_profile would, then write it (folders made as needed); returns the path."""
    from pdlab.recipe.timing import TimingProfile

    TimingProfile.from_raw({k: v for k, v in raw.items() if k != "pdlab_timing_profile"}, path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(dump_profile(raw, header))
    os.replace(tmp, path)
    return path
