"""One compare row per (run, variant): what summary.json measured, read once, beside what the recipe says the
variant is: its engine family, layout (unified or disaggregated), timing (measured, modelled or simulated),
step budget, devices and the configuration footnote the tables print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import MISS_KINDS
from pdlab.recipe import Deployment, TimingProfile, Variant
from pdlab.report.load import LoadedRun
from pdlab.report.stats import Stat
from pdlab.workload import rate_tag

TIMINGS = ("measured", "modelled", "simulated")
LIMITS = {"ttft_only": "TTFT misses", "itl_only": "ITL misses", "both": "TTFT and ITL misses",
          "failed": "failed requests"}
LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "worst_gap_p90_ms")


@dataclass(frozen=True)
class Goodput:
    """A goodput over repeats and how far it can be trusted (pdlab.measure.search.Goodput, per repeat)."""

    stat: Stat
    open_above: bool = False  # some repeat never failed: a lower bound
    open_below: bool = False  # some repeat failed at its lowest rate, above the search floor
    capped: bool = False  # some repeat was held to its saturation throughput
    lowest_fail: Optional[float] = None  # the lowest first failing rate of an open-below repeat

    @classmethod
    def of(cls, g: dict) -> "Goodput":
        below = [ff for lp, ff in g["brackets"] if lp is None and ff is not None]
        return cls(Stat.of(g), bool(g["open_above"]), bool(g["open_below"]), bool(g["capped"]),
                   min(below) if g["open_below"] and below else None)

    @property
    def bound(self) -> str:
        """exact; lower (the value is a lower bound); below (0 at the rates tried: it lies below the lowest)."""
        if self.open_below and not self.stat.mean:
            return "below"
        return "lower" if self.open_above or self.open_below else "exact"

    def cell(self) -> str:
        """'1.40 ± 0.12', '≥ 4.00' (a lower bound), '< 1.00' (below the lowest rate tried), '3.90 ± 0.20 sat'."""
        if self.bound == "below" and self.lowest_fail is not None:
            return f"< {self.lowest_fail:.2f}"
        return ("≥ " if self.bound == "lower" else "") + self.stat.cell() + (" sat" if self.capped else "")

    def to_dict(self) -> dict:
        return {**self.stat.to_dict(), "open_above": self.open_above, "open_below": self.open_below,
                "capped": self.capped, "bound": self.bound, "lowest_fail": self.lowest_fail}


@dataclass(frozen=True)
class Row:
    label: str
    run: str  # the run directory
    variant: str
    engine: str  # pdlab, vllm, endpoint; "?" when the recipe does not load here
    layout: str  # unified, disagg, ?
    timing: str  # one of TIMINGS
    config: str  # the footnote: devices, transport, engine knobs
    token_budget: Optional[int]
    chunked: Optional[bool]
    ran: bool
    partial: bool
    mode: str  # grid or search
    goodput: Goodput
    goodput_tpot: Goodput
    devices: Optional[int]
    saturation_tok_s: Stat
    met: dict[str, tuple[int, int]]
    attainment: dict[str, Stat]
    trials: tuple[tuple[tuple[float, float], ...], ...]  # per repeat of a search: (rate, attainment) tried
    saturation_rps: Optional[float]  # requests per second completed all at once (mean over repeats)
    misses: dict[str, int]
    sent: int
    prefill_routes: dict[str, int]
    prefill_interruptions: int
    limit: str
    mdl1: Optional[dict]  # the first repeat's M/D/1 check at the lowest rate
    summary: Any  # this variant's summary.json entry (latencies are read at the focus rate)

    @property
    def itl_misses(self) -> int:
        return self.misses["itl_only"] + self.misses["both"]

    @property
    def ttft_misses(self) -> int:
        return self.misses["ttft_only"] + self.misses["both"]

    def latencies(self, tag: Optional[str]) -> Optional[dict]:
        """TTFT/ITL/stall Stats at one rate (grid), or at each repeat's last passing rate (tag None: search)."""
        vs = self.summary
        if self.mode == "search" or tag is None:
            at = vs["at_goodput"] if self.mode == "search" else None
            return None if not at else {k: Stat.of(at[k]) for k in LATENCY_KEYS} | {"at": list(at["rates"])}
        x = vs["rates"][tag]["over_repeats"] if tag in vs["rates"] else None
        return None if x is None else {k: Stat.of(x[k]) for k in LATENCY_KEYS} | {"at": [tag]}


def _interference(x: dict) -> dict:
    """The engine-side attribution; the client-side one for an engine without step records (vLLM)."""
    return x["interference_client"] if not x["steps"] and "interference_client" in x else x["interference"]


def _limit(vs: dict) -> str:
    """What stopped this variant's goodput: capacity, the misses at each repeat's first failing rate, or none."""
    if not vs["repeats"]:
        return "not run"
    if vs["goodput"]["capped"]:
        return "capacity (held to the saturation throughput)"
    counts = dict.fromkeys(MISS_KINDS, 0)
    for rep in vs["repeats"]:
        ff = rep["goodput"]["first_fail"]
        for k, n in (rep["rates"][rate_tag(ff)]["misses"] if ff is not None else {}).items():
            counts[k] += n
    if not any(counts.values()):
        return "nothing within the rates tried"
    return LIMITS[max(MISS_KINDS, key=counts.__getitem__)]


def count_devices(dep: Deployment, timing: Optional[TimingProfile] = None) -> Optional[int]:
    """Devices a deployment uses (goodput per device's denominator): an endpoint's stated count; a modelled
    one's workers times the devices one modelled instance spans (not the stand-ins); else distinct devices."""
    if dep.endpoint is not None:
        return dep.endpoint.devices
    if timing is not None:
        return len(dep.workers) * timing.devices
    return len({d for w in dep.workers for d in w.devices}) or None


def configuration(v: Variant) -> str:
    """The footnote of one variant: `1 prefill worker on cpu:0 + 1 decode worker on cpu:1; KV over shm, pull;
    step budget 2048`; modelled, the stand-in devices with what they model: `... on cpu:0 (modelled: 4x MI300X
    192GB, TP4 (analytic))`."""
    dep, t = v.deployment, v.model.timing
    if dep.endpoint is not None:
        ep = dep.endpoint
        return (f"endpoint {ep.label or v.backend.url}: {ep.kind}, {ep.devices} devices, serving {v.backend.model} at "
                f"{v.backend.url} (a running service pdlab measured, not started)")
    groups = []
    for role in dep.roles:
        g = getattr(dep, role)
        groups.append(f"{g.replicas} {role} worker{'s' if g.replicas > 1 else ''}{f' of TP{g.tp}' if g.tp > 1 else ''}"
                      f" on {', '.join(g.devices)}")
    text = " + ".join(groups)
    if t is not None:  # what the stand-in devices model, once for all workers
        text += f" ({'each ' if len(dep.workers) > 1 else ''}modelled: {t.device or t.name})"
    if dep.disaggregated:
        text += f"; KV {_transport(v)}, {dep.mode}"
        if dep.first_token != "decode":
            text += ", first token from prefill"
        if dep.route.selective:
            text += f"; prefilled remotely from {dep.route.remote_prefill_min_tokens} uncached tokens"
    e = v.engine
    text += f"; step budget {e.token_budget}{', chunked prefill' if e.chunked_prefill else ''}"
    text += "" if e.prefix_caching else ", prefix cache off"
    return text + (f"; on {v.backend.backend} servers" if v.backend.external else "")


def _transport(v: Variant) -> str:
    dep, t = v.deployment, v.model.timing
    if v.backend.external:
        return f"over {v.backend.backend}'s NixlConnector"
    if t is None:
        return f"over {dep.transport}"
    link = t.transfer_of(dep.transport)
    if link is None:
        return f"over {dep.transport} (stand-in; the profile models no {dep.transport} link: hand-over time 0)"
    return f"over {dep.transport} (stand-in; modelled at {link.gbps:g} GB/s + {link.latency_ms:g} ms)"


def build_row(lr: LoadedRun, name: str, label: str) -> Row:
    vs, v = lr.summary["variants"][name], lr.variant(name)
    finite = [x for t, x in vs["rates"].items() if t != "inf"]
    timing = "?" if v is None else "measured" if not v.model.modelled else (
        "simulated" if lr.facts.simulated else "modelled")
    sat = vs["saturation"]
    reps = vs["repeats"]
    return Row(
        label=label, run=lr.run.path, variant=name,
        engine=v.backend.backend if v else "?", layout=v.deployment.kind if v else "?", timing=timing,
        config=configuration(v) if v else f"(not shown: {lr.recipe_error})",
        token_budget=v.engine.token_budget if v else None, chunked=v.engine.chunked_prefill if v else None,
        ran=bool(vs["ran"]), partial=bool(lr.summary["partial"]), mode=vs["mode"],
        goodput=Goodput.of(vs["goodput"]), goodput_tpot=Goodput.of(vs["goodput_tpot"]),
        devices=count_devices(v.deployment, v.model.timing) if v else None,
        saturation_tok_s=Stat.of(sat["output_tok_s"] if sat else None),
        met={t: (x["slo_met"], x["sent"]) for t, x in vs["rates"].items()},
        attainment={t: Stat.of(x["over_repeats"]["attainment"], ceiling=1.0) for t, x in vs["rates"].items()},
        trials=tuple(tuple((t["rate"], t["attainment"]) for t in rep["goodput"]["trials"]) for rep in reps),
        saturation_rps=sat["request_throughput"]["mean"] if sat else None,
        misses={k: sum(x["misses"][k] for x in finite) for k in MISS_KINDS}, sent=sum(x["sent"] for x in finite),
        prefill_routes=_sum_counts(x["prefill_routes"] for x in finite),
        prefill_interruptions=sum(_interference(x)["prefill_interruptions"] for x in finite),
        limit=_limit(vs), mdl1=vs["mdl1"]["repeats"][0] if vs["mdl1"] else None, summary=vs)


def _sum_counts(counts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out
