"""Deployments: which workers a variant runs, on which devices.

Shapes (a variant's `deployment`):
    {unified: {replicas: N, devices: [...]}, share_devices: false}
    {prefill: {replicas: N, devices: [...]}, decode: {replicas: M, devices: [...]},
     transport: shm|cuda-ipc|host|nixl, mode: pull|push, first_token: decode|prefill,
     share_devices: false, transfer_timeout_s: 30}
A pool's devices are one spec per replica (`[cuda:0-3, cuda:4-7]` with replicas 2) or a list split
evenly among the replicas (`[cpu:0, cpu:1]` with replicas 2: one core each). Workers of a variant may
not share a device unless `share_devices: true`. The transport defaults to shm on cpu, cuda-ipc on cuda.
"""

from __future__ import annotations

from typing import Any

from pdlab.devices import format_devices, overlaps, parse_devices
from pdlab.recipe_schema import (
    REQUIRED, TRANSPORTS, Field, RecipeError, _any, _bool, _choice, _float, _int, _opt, _str, check_section,
)

_POOL = {"replicas": Field(1, "an integer >= 1", _int(1)),
         "devices": Field(REQUIRED, "a list of device specs such as [cpu:0] or [cuda:0-3]", _any)}
_DISAGG = {
    "prefill": _POOL, "decode": _POOL,
    "transport": Field(None, f"one of {', '.join(TRANSPORTS)}", _opt(_choice(*TRANSPORTS))),
    "mode": Field("pull", "pull or push", _choice("pull", "push")),
    "first_token": Field("decode", "decode or prefill (which worker delivers the first token)",
                         _choice("decode", "prefill")),
    "share_devices": Field(False, "true or false", _bool),
    "transfer_timeout_s": Field(30.0, "a number > 0 (seconds)", _float(0.0)),
    "control": Field(None, "a tcp:// or ipc:// address (default: ipc:// in a private directory)", _opt(_str)),
    "step_timeout_s": Field(300.0, "a number > 0 (seconds one engine step may take before its worker is "
                                   "declared hung)", _float(0.0)),
}
_UNIFIED = {"unified": _POOL, "share_devices": Field(False, "true or false", _bool),
            "control": _DISAGG["control"], "step_timeout_s": _DISAGG["step_timeout_s"]}


def _split(pool: dict, role: str, where: str) -> list[list[str]]:
    """Devices per replica: one spec per replica, or all devices split evenly."""
    specs = pool["devices"] if isinstance(pool["devices"], list) else [pool["devices"]]
    n = pool["replicas"]
    try:
        if len(specs) == n:
            per = [parse_devices(s) for s in specs]
        else:
            flat = parse_devices(specs)
            if len(flat) % n:
                raise RecipeError(f"{where}.{role}.devices: {len(flat)} devices cannot be split evenly among "
                                  f"{n} replicas; give one spec per replica or a multiple of {n} devices")
            k = len(flat) // n
            per = [flat[i * k:(i + 1) * k] for i in range(n)]
    except ValueError as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"{where}.{role}.devices: {e}") from None
    return [[str(d) for d in p] for p in per]


def resolve_deployment(dep: Any, where: str) -> dict:
    """Validate a deployment and expand it into workers: [{name, role, devices}]."""
    if not isinstance(dep, dict):
        raise RecipeError(f"{where}: expected {{unified: {{...}}}} or {{prefill: {{...}}, decode: {{...}}}}, got {dep!r}")
    if "unified" in dep:
        out = check_section("deployment", dep, _UNIFIED, where)
        roles = ["unified"]
        out["kind"] = "unified"
    elif "prefill" in dep or "decode" in dep:
        for role in ("prefill", "decode"):
            if role not in dep:
                raise RecipeError(f"{where}.{role}: missing; a disaggregated deployment needs at least one "
                                  f"prefill and one decode worker, e.g. {role}: {{devices: [cpu:1]}}")
        out = check_section("deployment", dep, _DISAGG, where)
        roles = ["prefill", "decode"]
        out["kind"] = "disagg"
    else:
        raise RecipeError(f"{where}: expected a unified or a prefill/decode deployment, got keys {list(dep)}")
    workers = []
    for role in roles:
        for i, devs in enumerate(_split(out[role], role, where)):
            workers.append({"name": f"{role}-{i}", "role": role, "devices": devs})
    kinds = {w["devices"][0].split(":")[0] for w in workers}
    if len(kinds) > 1:
        raise RecipeError(f"{where}: all workers of a variant must use one kind of device, got {sorted(kinds)}")
    if not out["share_devices"]:
        for i, a in enumerate(workers):
            for b in workers[i + 1:]:
                common = overlaps(a["devices"], b["devices"])
                if common:
                    raise RecipeError(f"{where}: workers {a['name']} and {b['name']} overlap on "
                                      f"{format_devices(common)}; use separate devices or set share_devices: true")
    if out["kind"] == "disagg":
        kind = kinds.pop()
        if out["transport"] is None:
            out["transport"] = "shm" if kind == "cpu" else "cuda-ipc"
        if kind == "cpu" and out["transport"] in ("cuda-ipc", "host"):
            raise RecipeError(f"{where}.transport: {out['transport']} needs cuda devices; use shm on cpu")
    for role in roles:
        out[role]["devices"] = [format_devices(parse_devices(d)) for d in _split(out[role], role, where)]
    out["workers"] = workers
    return out
