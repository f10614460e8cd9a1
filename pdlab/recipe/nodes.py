"""The deployment's `control` and `nodes`: how workers reach the router, and the other machines they run on.

    control: tcp://10.0.0.1:5555                                   # the address alone (old recipes)
    control: {address: tcp://10.0.0.1:5555, keys: ~/.pdlab/keys}   # CurveZMQ with the cluster's keys
    control: {address: tcp://10.0.0.1:5555, insecure: true}        # plain TCP: a warning, never a default
    nodes: {b: {devices: [cpu:2-3]}}                               # node b offers these; workers write b:cpu:2

A tcp:// control plane is authenticated and encrypted (pdlab.serve.curve): with `keys` (a directory written
by `pdlab keys init DIR`, copied to every node) the router and every agent load them; without keys and
without nodes the launcher makes keys for the run alone, which its own workers get in memory. A worker on
another node needs the cluster's keys, so a deployment with nodes needs `keys` (or `insecure: true`).
ipc:// (the default) lives in a private directory and needs neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import JOIN_TIMEOUT_S
from pdlab.devices import check_node_name, parse_devices, split_node
from pdlab.fields import RecipeError, Section, did_you_mean, key_of, optional, spec, to_bool, to_float, to_str

_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]]+):\d{1,5}$")


def _address(v: Any) -> str:
    if not isinstance(v, str) or not (v.startswith("ipc://") and len(v) > 6 or _TCP.match(v)):
        raise ValueError
    return v


_CONTROL_KEYS = ("address", "keys", "insecure", "join_timeout_s")


@dataclass(frozen=True)
class ControlSpec(Section):
    """Where the router listens, and how its peers prove they belong to the cluster."""

    address: str = spec(expected="a tcp://HOST:PORT or ipc://PATH address", conv=_address)
    keys: Optional[str] = spec(None, "a directory written by `pdlab keys init DIR`", optional(to_str))
    insecure: bool = spec(False, "true or false (true: plain TCP without keys; anyone who can reach the port "
                                 "can drive the workers)", to_bool)
    join_timeout_s: float = spec(JOIN_TIMEOUT_S, "a number > 0 (seconds the run waits for its nodes to join)",
                                 to_float(0.0))

    @property
    def tcp(self) -> bool:
        return self.address.startswith("tcp://")

    @property
    def curve(self) -> bool:
        """Authenticated and encrypted: every tcp:// control plane unless the recipe says insecure."""
        return self.tcp and not self.insecure

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "ControlSpec":
        if isinstance(raw, ControlSpec):  # a resolved deployment's own, passed on (the calibration's)
            return raw
        if isinstance(raw, str):
            raw = {"address": raw}
        elif not isinstance(raw, dict):
            raise RecipeError(f"{where}: expected a tcp:// or ipc:// address, or {{address: tcp://HOST:PORT, "
                              f"keys: DIR}}, got {raw!r}")
        obj = cls(**cls.read(raw, where, list(_CONTROL_KEYS)))  # named: the field `keys` hides Section.keys()
        obj.check(where)
        return obj

    def check(self, where: str) -> None:
        if self.tcp:
            if self.keys is not None and self.insecure:
                raise RecipeError(f"{key_of(where, 'insecure')}: give keys or insecure: true, not both")
            return
        for k in ("keys", "insecure"):
            if getattr(self, k):
                raise RecipeError(f"{key_of(where, k)}: only for a tcp:// address (an ipc:// socket lives in a "
                                  "directory only its owner can open)")

    def to_raw(self) -> Any:
        """The address alone when nothing else was said, as old recipes write it."""
        if self.keys is None and not self.insecure and self.join_timeout_s == JOIN_TIMEOUT_S:
            return self.address
        return super().to_raw()


def _node_devices(v: Any) -> tuple[str, ...]:
    specs = [v] if isinstance(v, str) else v
    if not isinstance(specs, list) or not specs or not all(isinstance(s, str) for s in specs):
        raise ValueError
    if any(split_node(s)[0] for s in specs):
        raise ValueError
    parse_devices(specs)
    return tuple(specs)


@dataclass(frozen=True)
class NodeSpec(Section):
    devices: tuple[str, ...] = spec(expected="a list of this node's device specs such as [cpu:2-3] or [cuda:0-7] "
                                             "(no node name: the node is the key)", conv=_node_devices)


@dataclass(frozen=True)
class Nodes(Section):
    """`nodes: {b: {devices: [...]}}`: the other machines a deployment's workers may be placed on, by name."""

    entries: tuple[tuple[str, NodeSpec], ...] = ()

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "Nodes":
        if not isinstance(raw, dict) or not raw:
            raise RecipeError(f"{where}: expected a mapping of node name -> {{devices: [...]}}, e.g. "
                              f"{{b: {{devices: [cpu:2-3]}}}}, got {raw!r}")
        entries = []
        for name, body in raw.items():
            try:
                check_node_name(name)
            except ValueError as e:
                raise RecipeError(f"{key_of(where, str(name))}: {e}") from None
            entries.append((name, NodeSpec.from_raw(body, key_of(where, name))))
        return cls(tuple(entries))

    def to_raw(self) -> dict:
        return {name: s.to_raw() for name, s in self.entries}

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.entries]

    def get(self, name: str, where: str) -> NodeSpec:
        for n, s in self.entries:
            if n == name:
                return s
        raise RecipeError(f"{where}: node {name!r} is not in nodes{did_you_mean(name, self.names)}; nodes: "
                          f"{', '.join(self.names)}")
