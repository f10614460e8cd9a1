"""Does a timing profile describe these workers? Its CPU kernels against the ones the workers ran (a run) or
would choose on this machine (a simulation, a timed run), and the CPU it was measured on against this one.

A CPU kernel that one side runs and the other does not changes step times by up to 3x (issue 25: the
prefill kernel against SDPA on an AVX2 EPYC), so a profile measured with another choice predicts another
machine. A simulation runs no kernel: what this machine's workers would choose is read, never timed, from
the verdicts pdlab.engine.kernel_check cached here for the model's shape (nothing when none is cached yet).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional


def used(kernels: Optional[dict]) -> dict[str, bool]:
    """kernel -> whether it ran, from a {kernel: Choice dict} mapping."""
    return {k: bool(c.get("use")) for k, c in (kernels or {}).items() if isinstance(c, dict)}


def differences(profile: Optional[dict], ran: Optional[dict]) -> list[str]:
    """'prefill_attention: kernel here, torch in the profile' for every kernel whose use differs (both known)."""
    a, b = used(profile), used(ran)
    return [f"{k}: {'kernel' if b[k] else 'torch'} here, {'kernel' if a[k] else 'torch'} in the profile"
            for k in a if k in b and a[k] != b[k]]


def worker_warning(variant: str, profile: Any, workers: dict[str, dict]) -> Optional[str]:
    """One warning line when any worker of `variant` ran other kernels than `profile` was measured with."""
    if not profile.kernels:
        return None
    diffs = sorted({d for ks in workers.values() if ks for d in differences(profile.kernels, ks)})
    if not diffs:
        return None
    return (f"{variant}: its workers ran other CPU kernels than profile {profile.name} was measured with "
            f"({'; '.join(diffs)}): the profile does not time these steps; measure one here with pdlab profile")


def shape_key(model: Any) -> Optional[str]:
    """kernel_check's cache key of a model spec's shape (None: it has no config pdlab can read)."""
    try:
        from pdlab.engine.kernel_check import Shape, cache_key
        from pdlab.engine.model import model_config

        cfg = model_config(model)
    except Exception:  # noqa: BLE001 - a model pdlab cannot describe: nothing to compare
        return None
    heads = cfg.num_attention_heads
    return cache_key(Shape(heads, getattr(cfg, "num_key_value_heads", None) or heads,
                           getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.hidden_size,
                           cfg.intermediate_size), 1)  # a CPU worker's one torch thread


def machine_choice(model: Any) -> Optional[dict[str, dict]]:
    """What workers of `model` (float32) choose on this machine, from kernel_check's newest cached verdict for
    its shape ({kernel: {use, why}}); None when PDLAB_CPU_KERNEL leaves nothing to look up or nothing is cached."""
    from pdlab.constants import CPU_KERNEL_ENV, CPU_KERNELS
    from pdlab.engine.kernel_build import cache_dir

    mode = os.environ.get(CPU_KERNEL_ENV, "auto")
    if mode == "off":
        return {k: {"use": False, "why": f"off ({CPU_KERNEL_ENV}=off)"} for k in CPU_KERNELS}
    key = shape_key(model)
    if key is None:
        return None
    files = sorted(glob.glob(os.path.join(cache_dir(), "check-*.json")), key=os.path.getmtime, reverse=True)
    for path in files:
        try:
            with open(path) as f:
                have = json.load(f).get(key)
        except (OSError, ValueError):
            continue
        if have:
            return {k: {"use": mode == "on" or have[k][0] <= have[k][1], "why": "cached verdict"}
                    for k in CPU_KERNELS if isinstance(have.get(k), list)}
    return None


def machine_warnings(variant: str, profile: Any, model: Any) -> list[str]:
    """Warnings for a variant timed by `profile` (simulated or timed workers) on this machine: a profile
    measured on another CPU, or with other kernels than this machine's workers of the model choose."""
    from pdlab.measure.records import cpu_model

    out = []
    if profile.source != "measured" or profile.device_kind != "cpu":
        return out
    here = cpu_model()
    if here and here not in profile.device:
        out.append(f"{variant}: profile {profile.name} was measured on {profile.device}, this machine is {here}: "
                   "its times are that machine's (pdlab profile measures this one)")
    diffs = differences(profile.kernels, machine_choice(model)) if profile.kernels else []
    if diffs:
        out.append(f"{variant}: workers of this model on this machine choose other CPU kernels than profile "
                   f"{profile.name} was measured with ({'; '.join(diffs)}): its times are not this machine's")
    return out
