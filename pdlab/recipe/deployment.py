"""The recipe's `deployment`: which workers a variant runs, on which devices, joined by which transport.

    {unified: {replicas: N, devices: [...]}, share_devices: false}
    {prefill: {replicas: N, devices: [...]}, decode: {replicas: M, devices: [...]},
     transport: shm|cuda-ipc|host|nixl, mode: pull|push, first_token: decode|prefill,
     share_devices: false, transfer_timeout_s: 30, nixl: {backends: [UCX], ucx_tls: auto},
     on_transfer_failure: fail|recompute, route: {remote_prefill_min_tokens: 0}}
    both shapes also take step_timeout_s, control (a tcp:// address or {address, keys, insecure, join_timeout_s};
    ipc:// in a private directory otherwise) and nodes ({b: {devices: [cpu:2-3]}}: workers written b:cpu:2 run
    on node b, started there by `pdlab worker`; pdlab.recipe.nodes)
    {endpoint: {devices: N, kind: unified|disaggregated, label: "..."}}: a running service pdlab only measures
    (engine.backend: endpoint); it has no workers pdlab knows of, only what it is

A group's devices are one spec per replica (`[cuda:0-3, cuda:4-7]` with replicas 2), or a list split
evenly among the replicas (`[cpu:0, cpu:1]` with replicas 2: one core each), or, with `share_devices:
true`, fewer devices than replicas taken round-robin (`[cpu:0]` with replicas 2: both on core 0). Workers
may share a device only with `share_devices: true`. The transport defaults to shm on cpu, cuda-ipc on cuda,
nixl when prefill and decode workers are on different nodes (the others move KV within one machine only).
`on_transfer_failure` says what happens to a request whose KV hand-over failed or timed out: `fail` it (a
failed request, with the reason) or `recompute` its prefill on the decode worker. `route` is selective
disaggregation: a request is prefilled on a prefill worker only when the part of its prompt that the decode
worker does not hold in its prefix cache is at least `remote_prefill_min_tokens` long (0: always).
This is the only place a deployment's shape is checked; `pdlab.serve.topology` checks the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import (DEPLOYMENT_KINDS, ENDPOINT_KINDS, FIRST_TOKEN_FROM, MODES, REMOTE_PREFILL_MIN_TOKENS,
                             STEP_TIMEOUT_S, TP_TRANSPORTS, TRANSFER_FAILURE_POLICIES, TRANSFER_FAILURE_POLICY,
                             TRANSFER_TIMEOUT_S, TRANSPORT_DEVICES, TRANSPORTS)
from pdlab.devices import format_devices, on_node, overlaps, parse_devices, split_node
from pdlab.fields import (RecipeError, Section, as_mapping, key_of, one_of, optional, section, spec, to_bool,
                          to_float, to_int, to_text)
from pdlab.recipe.nixl import INSTALL_HINT, NixlConfig, nixl_module
from pdlab.recipe.nodes import ControlSpec, Nodes

FORM = ("{unified: {devices: [cpu:0]}}, {prefill: {devices: [cpu:0]}, decode: {devices: [cpu:1]}} or "
        "{endpoint: {devices: 8, kind: unified}}")
_COMMON = ("share_devices", "control", "step_timeout_s", "nodes")
KEYS = {"unified": ("kind", "unified", *_COMMON),
        "disagg": ("kind", "prefill", "decode", "transport", "mode", "first_token", "transfer_timeout_s", "nixl",
                   "on_transfer_failure", "route", *_COMMON),
        "endpoint": ("kind", "endpoint", "step_timeout_s")}
DISAGG_ONLY = tuple(k for k in KEYS["disagg"] if k not in KEYS["unified"])


def _devices(v: Any) -> tuple[str, ...]:
    specs = [v] if isinstance(v, str) else v
    if not isinstance(specs, list) or not specs:
        raise ValueError
    return tuple(str(s) if isinstance(s, (str, int)) else s for s in specs)


@dataclass(frozen=True, kw_only=True)
class WorkerGroup(Section):
    """The workers of one role: `replicas` of them, with their devices (one spec per replica once resolved)."""

    replicas: int = spec(1, "an integer >= 1", to_int(1))
    devices: tuple[str, ...] = spec(expected="a list of device specs such as [cpu:0] or [cuda:0-3]", conv=_devices)
    tp: int = spec(1, "an integer >= 1 (tensor-parallel ranks per worker, one device each)", to_int(1))

    def split(self, share: bool, where: str) -> list[tuple[Optional[str], list[str]]]:
        """Devices per replica: (its node, None for this machine; its device names ["cpu:0"], ...)."""
        n = self.replicas
        try:
            parts = [split_node(s) for s in self.devices]
            if len(self.devices) == n:
                per = [[(node, d) for d in parse_devices(s)] for node, s in parts]
            else:
                for node in dict.fromkeys(node for node, _ in parts):  # duplicates and mixed kinds, per machine
                    parse_devices([s for nd, s in parts if nd == node])
                flat = [(node, d) for node, s in parts for d in parse_devices(s)]
                if len(flat) % n == 0:
                    k = len(flat) // n
                    per = [flat[i * k:(i + 1) * k] for i in range(n)]
                elif share and n % len(flat) == 0:
                    per = [[flat[i % len(flat)]] for i in range(n)]
                else:
                    raise RecipeError(f"{where}.devices: {len(flat)} devices cannot be split evenly among {n} "
                                      f"replicas; give one spec per replica, a multiple of {n} devices, or "
                                      "share_devices: true to place replicas round-robin")
        except RecipeError:
            raise
        except ValueError as e:
            raise RecipeError(f"{where}.devices: {e}") from None
        out = []
        for p in per:
            nodes = list(dict.fromkeys(node for node, _ in p))
            if len(nodes) > 1:
                raise RecipeError(f"{where}.devices: a worker would span machines "
                                  f"({', '.join(on_node(nd, str(d)) for nd, d in p)}); a worker runs on one node")
            out.append((nodes[0], [str(d) for _, d in p]))
        return out


@dataclass(frozen=True)
class RouteSpec(Section):
    """Selective disaggregation (llm-d's decider, Dynamo's conditional disaggregation): which requests go to a
    prefill worker. The rest are prefilled by the decode worker chosen for them."""

    remote_prefill_min_tokens: int = spec(REMOTE_PREFILL_MIN_TOKENS, "an integer >= 0 (uncached prompt tokens "
                                          "from which a request is prefilled remotely; 0: always)", to_int(0))

    @property
    def selective(self) -> bool:
        return self.remote_prefill_min_tokens > 0


def _endpoint_kind(v: Any) -> str:
    if v not in ENDPOINT_KINDS:
        raise ValueError
    return ENDPOINT_KINDS[v]


@dataclass(frozen=True)
class EndpointSpec(Section):
    """A running service that pdlab measures but does not start (engine.backend: endpoint). pdlab cannot see
    its workers, so the recipe says what it is: the devices goodput per device divides by, and whether it
    disaggregates, for the verdict."""

    devices: int = spec(expected="an integer >= 1 (devices the service runs on: goodput per device divides by "
                                 "it)", conv=to_int(1))
    kind: str = spec(expected="unified or disaggregated (whether the service runs prefill and decode apart)",
                     conv=_endpoint_kind)
    label: str = spec("", "a string (what tables call the service; default: its URL)", to_text)


@dataclass(frozen=True)
class PlannedWorker:
    name: str  # "unified0", "prefill1", "decode0"
    role: str
    devices: tuple[str, ...]  # on its own machine: ("cpu:2",) also for a worker on node b
    tp: int = 1
    node: Optional[str] = None  # None: this machine; else the node (`pdlab worker --name`) that runs it

    @property
    def kind(self) -> str:
        return self.devices[0].split(":")[0]

    @property
    def where(self) -> tuple[str, ...]:
        """Its devices as a recipe writes them: ("b:cpu:2",) on node b."""
        return tuple(on_node(self.node, d) for d in self.devices)


@dataclass(frozen=True)
class Deployment(Section):
    kind: str = spec("unified", f"one of {', '.join(DEPLOYMENT_KINDS)} (it follows from the shape)",
                     one_of(DEPLOYMENT_KINDS))
    unified: Optional[WorkerGroup] = spec(None, parse=section(WorkerGroup))
    prefill: Optional[WorkerGroup] = spec(None, parse=section(WorkerGroup))
    decode: Optional[WorkerGroup] = spec(None, parse=section(WorkerGroup))
    transport: Optional[str] = spec(None, f"one of {', '.join(TRANSPORTS)}", optional(one_of(TRANSPORTS)))
    mode: str = spec("pull", "pull or push", one_of(MODES))
    first_token: str = spec("decode", "decode or prefill (which worker delivers the first token)",
                            one_of(FIRST_TOKEN_FROM))
    share_devices: bool = spec(False, "true or false", to_bool)
    transfer_timeout_s: float = spec(TRANSFER_TIMEOUT_S, "a number > 0 (seconds)", to_float(0.0))
    on_transfer_failure: str = spec(TRANSFER_FAILURE_POLICY, f"one of {', '.join(TRANSFER_FAILURE_POLICIES)} (a "
                                    "request whose KV hand-over failed: fail it, or prefill it again on its decode "
                                    "worker)", one_of(TRANSFER_FAILURE_POLICIES))
    route: RouteSpec = spec(RouteSpec(), parse=section(RouteSpec))
    step_timeout_s: float = spec(STEP_TIMEOUT_S, "a number > 0 (seconds one engine step may take before its "
                                                 "worker is declared hung)", to_float(0.0))
    control: Optional[ControlSpec] = spec(None, parse=section(ControlSpec, nullable=True))  # None: ipc://, private
    nodes: Optional[Nodes] = spec(None, parse=section(Nodes, nullable=True))  # other machines, by name
    nixl: Optional[NixlConfig] = spec(None, parse=section(NixlConfig))  # transport nixl only; filled then
    endpoint: Optional[EndpointSpec] = spec(None, parse=section(EndpointSpec))  # a service pdlab only measures
    workers: tuple[PlannedWorker, ...] = spec((), derived=True)

    @property
    def disaggregated(self) -> bool:
        return self.kind == "disagg"

    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.disaggregated else ("unified",)

    @property
    def device_kind(self) -> str:
        """cpu or cuda; "endpoint" for a running service (its devices are not this machine's)."""
        return "endpoint" if self.endpoint is not None else self.workers[0].kind

    @property
    def remote_nodes(self) -> list[str]:
        """The other machines its workers run on, in order of first use."""
        return list(dict.fromkeys(w.node for w in self.workers if w.node))

    @property
    def shape(self) -> str:
        """Which keys the recipe gives: unified, disagg or endpoint (KEYS)."""
        return "endpoint" if self.endpoint is not None else self.kind

    @classmethod
    def from_raw(cls, raw: Any, where: str) -> "Deployment":
        if not isinstance(raw, dict) or not raw:
            raise RecipeError(f"{where}: expected {FORM}, got {raw!r}")
        if "endpoint" in raw:
            return cls._endpoint(raw, where)
        if "unified" in raw:
            if "prefill" in raw or "decode" in raw:
                raise RecipeError(f"{where}: give either unified, or prefill and decode, not both")
            kind = "unified"
        elif "prefill" in raw or "decode" in raw:
            for role in ("prefill", "decode"):
                if role not in raw:
                    raise RecipeError(f"{where}.{role}: missing; a disaggregated deployment needs at least one "
                                      f"prefill and one decode worker, e.g. {role}: {{devices: [cpu:1]}}")
            kind = "disagg"
        else:
            raise RecipeError(f"{where}: expected a unified, a prefill/decode or an endpoint deployment, got keys "
                              f"{list(raw)}")
        values = cls.read(as_mapping(raw, where, KEYS[kind]), where, list(KEYS[kind]))
        if values.get("kind", kind) != kind:
            raise RecipeError(f"{where}.kind: {values['kind']} does not match the shape given ({kind})")
        values["kind"] = kind
        for role in ("unified",) if kind == "unified" else ("prefill", "decode"):
            if values[role] is None:
                raise RecipeError(f"{where}.{role}: expected {{replicas: N, devices: [...]}}")
        dep = cls(**values)
        return dep._resolved(where)

    @classmethod
    def _endpoint(cls, raw: dict, where: str) -> "Deployment":
        """A running service: its kind is the endpoint's, and it has no workers pdlab starts."""
        shapes = [k for k in ("unified", "prefill", "decode") if k in raw]
        if shapes:
            raise RecipeError(f"{where}: give either endpoint, or {' and '.join(shapes)}, not both")
        values = cls.read(raw, where, list(KEYS["endpoint"]))
        if values.get("endpoint") is None:
            raise RecipeError(f"{where}.endpoint: expected {{devices: N, kind: unified|disaggregated, label: ...}}")
        kind = values["endpoint"].kind
        if values.get("kind", kind) != kind:
            raise RecipeError(f"{where}.kind: {values['kind']} does not match endpoint.kind ({kind})")
        return cls(**(values | {"kind": kind}))

    def _resolved(self, where: str) -> "Deployment":
        """Split devices into workers and check the shape; the groups come back one spec per replica."""
        workers, groups = [], {}
        for role in self.roles:
            group = getattr(self, role)
            per = group.split(self.share_devices, key_of(where, role))
            for _, d in per:
                # a worker computes on exactly tp devices: never a silent run on the first of several
                if len(d) != group.tp:
                    raise RecipeError(f"{key_of(where, role)}: each worker has {len(d)} device(s) ({format_devices(parse_devices(d))}) "
                                      f"but tp is {group.tp}; a worker computes on one device per tensor-parallel "
                                      f"rank: set tp: {len(d)} or give one device per replica")
            groups[role] = WorkerGroup(replicas=len(per), tp=group.tp, devices=tuple(
                on_node(node, format_devices(parse_devices(d))) for node, d in per))
            workers += [PlannedWorker(f"{role}{i}", role, tuple(d), group.tp, node) for i, (node, d) in enumerate(per)]
        kinds = sorted({w.kind for w in workers})
        if len(kinds) > 1:
            raise RecipeError(f"{where}: all workers of a variant must use one kind of device, got {kinds}")
        if not self.share_devices:
            for i, a in enumerate(workers):
                for b in workers[i + 1:]:
                    common = overlaps(a.devices, b.devices) if a.node == b.node else []
                    if common:
                        raise RecipeError(f"{where}: workers {a.name} and {b.name} overlap on "
                                          f"{on_node(a.node, format_devices(common))}; use separate devices or set "
                                          "share_devices: true")
        self._check_nodes(workers, where)
        machines = list(dict.fromkeys(w.node or "this machine" for w in workers))
        transport = self.transport
        if self.disaggregated:
            kind = kinds[0]
            transport = transport or ("nixl" if len(machines) > 1 else "shm" if kind == "cpu" else "cuda-ipc")
            if len(machines) > 1 and transport != "nixl":
                raise RecipeError(f"{where}.transport: {transport} moves KV within one machine; these workers run "
                                  f"on {' and '.join(machines)}: use transport: nixl")
            if kind not in TRANSPORT_DEVICES[transport]:
                fit = [t for t, kinds_ in TRANSPORT_DEVICES.items() if kind in kinds_]
                raise RecipeError(f"{where}.transport: {transport} does not move {kind} pools; use "
                                  f"{' or '.join(fit)}")
            if transport == "nixl" and nixl_module() is None:
                raise RecipeError(f"{where}.transport: nixl needs the optional extra, not installed here: "
                                  f"{INSTALL_HINT}")
            for role in self.roles:
                ok = TP_TRANSPORTS[kind]
                if groups[role].tp > 1 and transport not in ok:
                    built = f"for transport {' or '.join(ok)} only" if ok else f"not yet for {kind} workers"
                    raise RecipeError(f"{key_of(where, role)}.tp: a hand-over between tensor-parallel workers is "
                                      f"built {built} (not {transport}); use tp: 1 here")
        nixl = self.nixl
        if transport == "nixl":
            nixl = nixl or NixlConfig()
        elif nixl is not None:
            raise RecipeError(f"{where}.nixl: only for transport: nixl (this deployment uses {transport or 'none'})")
        return self.replace(transport=transport, nixl=nixl, workers=tuple(workers), **groups)

    def _check_nodes(self, workers: list[PlannedWorker], where: str) -> None:
        """Workers on other nodes: on devices their node offers (when `nodes` says), reached over an
        authenticated TCP control plane (pdlab.recipe.nodes)."""
        for w in workers:
            if w.node and self.nodes is not None:
                offered = parse_devices(list(self.nodes.get(w.node, key_of(where, w.role) + ".devices").devices))
                outside = [d for d in parse_devices(list(w.devices)) if d not in offered]
                if outside:
                    raise RecipeError(f"{key_of(where, w.role)}.devices: {w.name} is placed on "
                                      f"{on_node(w.node, format_devices(outside))}, which nodes.{w.node}.devices "
                                      f"({', '.join(self.nodes.get(w.node, where).devices)}) does not offer")
        remote = list(dict.fromkeys(w.node for w in workers if w.node))
        if not remote:
            return
        c = self.control
        if c is None or not c.tcp:
            raise RecipeError(f"{key_of(where, 'control')}: workers on node {remote[0]} reach the router over TCP: "
                              "give control: {address: tcp://HOST:PORT, keys: DIR} (an address that node can reach; "
                              "DIR from `pdlab keys init DIR`)")
        if c.keys is None and not c.insecure:
            raise RecipeError(f"{key_of(where, 'control')}.keys: missing; a worker on node {remote[0]} must prove it "
                              f"belongs to the cluster: run `pdlab keys init DIR`, copy DIR to every node and give "
                              f"control: {{address: {c.address}, keys: DIR}} (or insecure: true for plain TCP)")

    def to_raw(self) -> dict:
        """The shape's own keys only (recipe.yaml; loading it back gives this deployment)."""
        raw = super().to_raw()
        return {k: raw[k] for k in KEYS[self.shape] if k in raw and not (k in ("nixl", "nodes") and raw[k] is None)}
