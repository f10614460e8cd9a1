"""Device specs: `cpu:0`, `cpu:0-1`, `cuda:0-3`, `cuda:4,5`, or lists of such; `b:cpu:2` names node b's.

A spec names devices by kind and index. On CPU an index is a core (a worker is pinned to its cores);
on CUDA it is a GPU (a worker sees only its GPUs through CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Union

KINDS = ("cpu", "cuda")
_SPEC = re.compile(r"^(cpu|cuda):(.+)$")
_PART = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True, order=True)
class Device:
    kind: str  # "cpu" | "cuda"
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def _parse_one(spec: str) -> list[Device]:
    text = str(spec).strip()
    m = _SPEC.match(text)
    if not m:
        raise ValueError(
            f"bad device spec {spec!r}: expected KIND:INDICES with KIND cpu or cuda, "
            "e.g. cpu:0, cpu:0-1, cuda:0-3, cuda:4,5"
        )
    kind, rest = m.group(1), m.group(2)
    out: list[Device] = []
    for part in rest.split(","):
        pm = _PART.match(part.strip())
        if not pm:
            raise ValueError(f"bad device spec {spec!r}: {part.strip()!r} is not an index or a range like 0-3")
        lo = int(pm.group(1))
        hi = int(pm.group(2)) if pm.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"bad device spec {spec!r}: range {lo}-{hi} runs backwards")
        out.extend(Device(kind, i) for i in range(lo, hi + 1))
    return out


def parse_devices(spec: Union[str, Iterable[str]]) -> list[Device]:
    """Parse one spec or a list of specs into devices, in order, without duplicates.

    Raises ValueError naming the bad spec. Mixing cpu and cuda in one list is an error: a worker
    runs on one kind of device.
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise ValueError("empty device list: expected e.g. cpu:0 or cuda:0-3")
    out: list[Device] = []
    for s in specs:
        if not isinstance(s, str):
            raise ValueError(f"bad device spec {s!r}: expected a string like cpu:0 or cuda:0-3")
        for d in _parse_one(s):
            if d in out:
                raise ValueError(f"device {d} is listed twice in {spec!r}")
            out.append(d)
    kinds = {d.kind for d in out}
    if len(kinds) > 1:
        raise ValueError(f"device list {spec!r} mixes cpu and cuda; a worker runs on one kind")
    return out


def overlaps(a: Union[str, Iterable[str], Iterable[Device]], b: Union[str, Iterable[str], Iterable[Device]]) -> list[Device]:
    """The devices that `a` and `b` have in common (empty list: no overlap). Accepts specs or devices."""
    da, db = _as_devices(a), _as_devices(b)
    sb = set(db)
    return [d for d in da if d in sb]


def _as_devices(x: Union[str, Iterable[str], Iterable[Device]]) -> list[Device]:
    if isinstance(x, str):
        return parse_devices(x)
    items = list(x)
    if all(isinstance(i, Device) for i in items):
        return items
    return parse_devices([str(i) for i in items])


def format_devices(devices: Iterable[Device]) -> str:
    """Compact spec for a list of devices of one kind: [cpu:0, cpu:1, cpu:3] -> 'cpu:0-1,3'."""
    devs = sorted(devices)
    if not devs:
        return ""
    kind = devs[0].kind
    idx = [d.index for d in devs]
    parts, start = [], idx[0]
    for prev, cur in zip(idx, idx[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return f"{kind}:{','.join(parts)}"


# ---- nodes: `b:cpu:2` is core 2 of node b (a machine whose `pdlab worker` joined the run) ----
_NODE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]{0,62}):((?:cpu|cuda):.*)$")


def check_node_name(name: object) -> str:
    """A node's name: a letter, then letters, digits, '-' or '_' (at most 63), and not a device kind."""
    if not isinstance(name, str) or not _NODE.match(f"{name}:cpu:0") or name in KINDS:
        raise ValueError(f"bad node name {name!r}: expected a letter then letters, digits, '-' or '_' (not "
                         f"{' or '.join(KINDS)}), e.g. b or node-2")
    return name


def split_node(spec: str) -> tuple[Optional[str], str]:
    """`b:cpu:2-3` -> ("b", "cpu:2-3"); `cpu:0` -> (None, "cpu:0"): devices without a node are the run's own
    machine's. Only a device kind after the name makes it a node (`gpu:0` stays a bad device spec); the device
    part is not checked here (parse_devices does)."""
    text = str(spec).strip()
    m = _NODE.match(text)
    if m and m.group(1) not in KINDS:
        return m.group(1), m.group(2)
    return None, text


def on_node(node: Optional[str], spec: str) -> str:
    """The inverse of split_node: `b:cpu:2`, or `cpu:2` for the run's own machine."""
    return f"{node}:{spec}" if node else spec
