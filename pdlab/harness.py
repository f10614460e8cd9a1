"""The run loop behind `pdlab run`: for every variant, start its workers once; for every repeat, measure
each rate of the grid, or search for goodput (saturation first, then the rates RateSearch asks for);
at each rate warm up, send the seeded requests at their scheduled times, collect every token, and write
the records as they come. Nothing here knows about engines: it drives a `Cluster`.

Before the variants, `calibrate` measures one request at a time on one unified worker: what a request
takes alone. It resolves relative SLOs (`ttft: 5x`) and gives the isolated prefill time for the M/D/1
check of the measurements.

Faults end the run cleanly: a worker that dies fails its in-flight requests (the router does that), the
run stops there, and everything measured so far is written, marked partial. Ctrl-C does the same.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.constants import STALL_TIMEOUT_S
from pdlab.external import check_variant
from pdlab.fields import RecipeError
from pdlab.measure.metrics import build_request_record
from pdlab.measure.box import calibration_check
from pdlab.measure.kernels import KernelLog
from pdlab.measure.records import RunDir, read_jsonl
from pdlab.measure.search import RateSearch
from pdlab.measure.transports import TransportPaths
from pdlab.recipe import SLO, Deployment, Recipe, Variant
from pdlab.recipe.recipe import relative_rate
from pdlab.serve import topology
from pdlab.serve.launch import start_mode
from pdlab.workload import Workload, WorkloadRequest, build_requests, trace_facts

LEAD_S = 0.05  # the first arrival is this far after the rate starts, so nothing is late by construction
ALONE_REQUESTS = 3  # calibration: requests measured one at a time (after one unmeasured)


class RunAborted(RuntimeError):
    """The run stopped early; what was measured is kept."""


@dataclass
class _Pending:
    req: WorkloadRequest
    arrival: float  # absolute, time.monotonic()
    token_times: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Alone:
    """What one request took alone on one unified worker (calibration), in milliseconds."""

    ttft_ms: float  # median TTFT: the isolated prefill time, plus a router hop
    itl_ms: float  # median gap between tokens
    requests: int
    worker: str  # its devices

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms, "requests": self.requests, "devices": self.worker}


def check_machine(recipe: Recipe) -> None:
    """Every variant's devices exist on this machine, and workers can be started as $PDLAB_WORKER_START says;
    checked before any process starts (raises ClusterError)."""
    try:
        start_mode()
    except ValueError as e:
        raise topology.ClusterError(str(e)) from None
    for v in recipe.variants.values():
        if v.deployment.endpoint is None:  # an endpoint runs on its own machines
            topology.place(v.deployment)
        check_variant(v)
        check_model(v)


def check_model(v: Variant) -> None:
    """What the variant's model must allow, checked before anything starts (RecipeError): tensor-parallel
    workers need a model pdlab can shard by its own plan (pdlab.engine.tensor_parallel)."""
    tp = max((w.tp for w in v.deployment.workers), default=1) if v.deployment.endpoint is None else 1
    if tp == 1 or v.backend.external or v.model.modelled:
        return
    # deferred: torch
    from pdlab.engine.tp_plan import TpPlanError, check_spec

    try:
        check_spec(v.model, tp)
    except TpPlanError as e:
        raise RecipeError(f"variants.{v.name}.deployment: tp {tp}: {e}") from None


def calibration_deployment(v: Variant) -> tuple[Deployment, str]:
    """Where one request alone is measured: one unified worker on the variant's first worker's devices, on
    whichever machine they are (its control plane and nodes come along), or the endpoint itself."""
    if v.deployment.endpoint is not None:
        return v.deployment, f"endpoint {v.backend.url}"
    first = v.deployment.workers[0]
    raw = v.deployment.to_raw()
    dep = Deployment.from_raw({"unified": {"devices": list(first.where), "tp": first.tp},
                               "control": raw.get("control"), "nodes": raw.get("nodes")}, "calibration")
    return dep, ",".join(first.where)


def worker_cores(recipe: Recipe) -> set[int]:
    """The CPU cores any worker of the recipe is pinned to (a GPU worker: its host cores, as the launcher
    will give them, pdlab.serve.sharing)."""
    return {c for v in recipe.variants.values() for c in topology.deployment_cores(v.deployment)}


class Harness:
    def __init__(self, recipe: Recipe, rd: RunDir, view: Any, workloads: dict[str, Workload]):
        """`workloads`: variant -> its requests (pdlab.workload.build_workload)."""
        self.recipe, self.rd, self.view = recipe, rd, view
        self.workloads = workloads
        self.steps_seen: dict[str, int] = {}
        self.slo: SLO = recipe.slo  # absolute once calibrate() resolved a relative one
        self.alone: Optional[Alone] = None  # the calibration: one unified worker
        self.alone_by_variant: dict[str, Alone] = {}  # each variant's own deployment
        self.searches: dict[tuple[str, int], dict] = {}  # (variant, repeat) -> saturation rps and trials
        self.paths = TransportPaths(rd, view)  # the KV path each variant actually took: env.json, live view
        self.kernels = KernelLog(rd, view)  # the CPU kernels each variant's workers ran: env.json, summary
        self.rates_resolved: dict[str, float] = {}  # relative rates (0.5x) -> req/s, once calibrated
        self.warm_caches: set[str] = set()  # variants whose server could not reset its prefix cache

    def facts(self, warnings: list[str]) -> dict:
        """What the summary needs beyond the records (pdlab.measure.summary.summarize_run)."""
        slo = self.recipe.slo
        checks, check_warnings = self._profile_check()
        return {"alone": self.alone.to_dict() if self.alone else None,
                "alone_by_variant": {n: a.to_dict() for n, a in self.alone_by_variant.items()},
                "relative": {"ttft": slo.ttft, "itl": slo.itl} if slo.relative else None,
                "prefill_workers": {n: sum(w.role != "decode" for w in v.deployment.workers)
                                    for n, v in self.recipe.variants.items()},
                "max_running": {n: v.engine.max_running for n, v in self.recipe.variants.items()},
                "floors": {k: s["floor"] for k, s in self.searches.items() if s.get("floor")},
                "warnings": list(warnings) + self.kernels.warnings + self._calibration_check() + check_warnings,
                "profile_check": checks,
                "kernels": self.kernels.facts(), "rates_resolved": dict(self.rates_resolved),
                "modelled": {n: v.model.timing.describe() for n, v in self.recipe.variants.items() if v.model.modelled},
                "trace": trace_facts(self.workloads), "expect": self.recipe.shared.expect}

    def _profile_check(self) -> tuple[dict, list[str]]:
        """Each variant's steps against the profile its recipe names (pdlab.timing.check), from the records."""
        # deferred: torch
        from pdlab.timing.check import run_facts

        variants = {n: self.recipe.resolved(n) for n in self.recipe.variant_names}
        steps, requests = (read_jsonl(self.rd.file(f"{k}.jsonl")) for k in ("steps", "requests"))
        return run_facts(variants, steps, requests, **self.kernels.reported())

    def _calibration_check(self) -> list[str]:
        """The calibration against the variants that ran on the same kind of worker (pdlab.measure.box)."""
        first = self.recipe.resolved(self.recipe.variant_names[0])
        like = [n for n, v in self.recipe.variants.items()
                if v.deployment.kind == "unified" and v.deployment.endpoint is None and v.engine == first.engine
                and v.model == first.model and v.backend == first.backend]
        lines = calibration_check(self.alone.to_dict() if self.alone else None,
                                  {n: a.to_dict() for n, a in self.alone_by_variant.items()}, like)
        for line in lines:
            self.view.note(f"warning: {line}")
        return lines

    def run(self) -> None:
        self.calibrate()
        for variant in self.recipe.variant_names:
            self.run_variant(variant)

    def cluster(self, v: Variant, deployment: Deployment, label: str) -> Any:
        """The workers of `deployment` for variant `v`: pdlab's own, external servers, or a running endpoint
        (engine.backend)."""
        if v.backend.endpoint:
            # deferred: aiohttp
            from pdlab.external.endpoint import EndpointCluster

            return EndpointCluster(v, deployment, label=label, log_dir=self.rd.file("servers"))
        if v.backend.external:
            # deferred: aiohttp
            from pdlab.external.cluster import ExternalCluster

            return ExternalCluster(v, deployment, label=label, log_dir=self.rd.file("servers"))
        # deferred: torch
        from pdlab.serve.cluster import Cluster

        return Cluster(v.model, v.engine, deployment, seed=v.seed)

    # ---- calibration: one request alone ----
    def calibrate(self) -> Alone:
        """Time a few requests one at a time on one unified worker on the first variant's first devices. When
        the first variant is an endpoint, pdlab cannot start a worker of it: the endpoint itself, as it is."""
        v = self.recipe.resolved(self.recipe.variant_names[0])
        dep, where = calibration_deployment(v)
        wl = self.workloads[v.name]
        reqs = build_requests(v.workload, math.inf, v.seed, wl.vocab, wl.tokenizer, wl.dataset,
                              n=ALONE_REQUESTS + 1, stream="alone")
        self.view.status("measuring one request alone (calibration)")
        with self.cluster(v, dep, "calibration") as cluster:
            cluster.start()
            self.alone = self._alone(cluster, reqs, where)
        itl = self.alone.itl_ms
        if self.recipe.relative_rates:  # 0.5x: half of 1 / TTFT alone, the same absolute rates for every variant
            written = self.recipe.relative_rates
            self.recipe = self.recipe.with_rates_for(self.alone.ttft_ms)
            self.rates_resolved = {w: relative_rate(w) * 1000.0 / self.alone.ttft_ms for w in written}
            self.view.note("rates relative to one request alone (1 / TTFT = "
                           f"{1000.0 / self.alone.ttft_ms:.3g} req/s): " +
                           ", ".join(f"{w} = {r:.3g} req/s" for w, r in self.rates_resolved.items()))
        if self.slo.relative:
            if self.slo.itl is not None and math.isnan(itl):
                raise RunAborted("a relative ITL SLO needs requests with 2+ output tokens to measure ITL alone")
            self.slo = self.slo.resolved(self.alone.ttft_ms, self.alone.itl_ms)
        self.view.set_slo(self.slo)
        self.view.note(f"one request alone: TTFT {self.alone.ttft_ms:.0f} ms, ITL {self.alone.itl_ms:.1f} ms; "
                       f"SLO: {self.slo.describe()}")
        return self.alone

    def _alone(self, cluster: Any, reqs: list[WorkloadRequest], where: str) -> Alone:
        """Send `reqs` one at a time (the first unmeasured) and take the median TTFT and median gap."""
        ttfts, gaps = [], []
        placeholder = self.slo.resolved(1.0, 1.0)  # these records are not kept: they judge nothing
        for i, r in enumerate(reqs):
            recs = self.serve(cluster, "(alone)", math.inf, 0, (r,), warmup=True, write=False, slo=placeholder)
            times = recs[0]["token_times"] if recs and recs[0]["ok"] else []
            if i and times:  # the first one warms up
                ttfts.append(times[0] - recs[0]["arrival"])
                gaps += [b - a for a, b in zip(times, times[1:])]
        if not ttfts:
            raise RunAborted(f"calibration failed: no request completed alone on {where}")
        itl = statistics.median(gaps) if gaps else float("nan")
        return Alone(1000 * statistics.median(ttfts), 1000 * itl, len(ttfts), where)

    # ---- variants ----
    def run_variant(self, variant: str) -> None:
        v = self.recipe.resolved(variant)
        n = len(v.deployment.workers)
        self.view.status(f"{variant}: checking endpoint {v.backend.url}" if v.deployment.endpoint is not None else
                         f"{variant}: starting {n} worker{'s' if n != 1 else ''}")
        if v.model.modelled:
            self.view.note(f"{variant}: {v.model.timing.describe()}: its times are the model's, not this machine's")
        with self.cluster(v, v.deployment, variant) as cluster:
            cluster.start()
            for w in cluster.workers:
                self.view.update_worker(w.name, role=w.role, devices=",".join(w.devices))
            self.kernels.record(variant, cluster.workers)
            self.paths.start(variant, v.deployment)
            # this deployment's own time for one request alone: the D of its M/D/1 check (chunking or a
            # KV hand-over make it differ from the calibration's unified worker)
            wl = self.workloads[v.name]
            self.view.status(f"{variant}: one request alone")
            self.alone_by_variant[variant] = self._alone(cluster, build_requests(
                v.workload, math.inf, v.seed, wl.vocab, wl.tokenizer, wl.dataset, n=ALONE_REQUESTS, stream="alone"),
                " + ".join(",".join(w.where) for w in v.deployment.workers) or variant)
            for repeat, seed in enumerate(v.seeds()):
                if v.auto:
                    self.search(cluster, v, repeat, seed)
                else:
                    for rate in v.rates:
                        self.measure(cluster, v, repeat, seed, rate)
        self.view.drop_workers()

    def measure(self, cluster: Any, v: Variant, repeat: int, seed: int, rate: float) -> list[dict]:
        """One (variant, repeat, rate) point: cold prefix cache, warm-up, then the measured requests."""
        wl = self.workloads[v.name]
        reqs = wl.at(rate, seed)
        self.view.plan(v.name, rate, len(reqs), repeat=repeat)
        # every rate starts with a cold prefix cache (False: an endpoint could not reset it; None: no answer)
        if cluster.reset_prefix_cache() is False and v.name not in self.warm_caches:
            self.warm_caches.add(v.name)  # an endpoint without vLLM's /reset_prefix_cache: best effort
            self.view.note(f"{v.name}: the server did not reset its prefix cache; rates may start warm")
        if wl.n_warmup:
            self.view.status(f"{v.name}: warming up for {_tag(rate)} req/s")
            self.serve(cluster, v.name, rate, repeat, wl.warmup(seed), warmup=True)
        self.view.status(f"{v.name}: measuring {_tag(rate)} req/s" + (f" (repeat {repeat + 1})" if v.repeats > 1
                                                                        else ""))
        return self.serve(cluster, v.name, rate, repeat, reqs, warmup=False)

    def search(self, cluster: Any, v: Variant, repeat: int, seed: int) -> None:
        """Saturation first (every request at once), then the rates the search asks for."""
        sat = self.measure(cluster, v, repeat, seed, math.inf)
        ok = [r for r in sat if r["ok"]]
        span = max((r["token_times"][-1] for r in ok), default=0.0) - min((r["arrival"] for r in sat), default=0.0)
        info: dict = {"saturation_rps": None, "trials": []}
        self.searches[(v.name, repeat)] = info
        if not ok or span <= 0:
            self.view.note(f"{v.name}: no request completed at saturation; no rate to search from")
            return
        info["saturation_rps"] = len(ok) / span
        s = v.search
        rs = RateSearch(self.slo.attainment, len(ok) / span, max_trials=s.max_trials, rel_tol=s.rel_tol,
                        start_fraction=s.start)
        info["floor"] = rs.floor
        while (rate := rs.next_rate()) is not None:
            recs = self.measure(cluster, v, repeat, seed, rate)
            att = sum(r["slo_ok"] for r in recs) / len(recs) if recs else 0.0
            rs.record(rate, att)
            info["trials"].append({"rate": rate, "attainment": att})

    # ---- one rate ----
    def serve(self, cluster: Any, variant: str, rate: float, repeat: int, reqs: tuple[WorkloadRequest, ...],
              warmup: bool, write: bool = True, slo: Optional[SLO] = None) -> list[dict]:
        """Send `reqs` at their arrival offsets and collect until each has finished; returns their records."""
        # deferred: torch
        from pdlab.serve.cluster import RequestDone, StepEvent, TokenEvent, TransferEvent, WorkerFailed

        slo = slo or self.slo
        t0 = time.monotonic() + LEAD_S
        pending = {r.id: _Pending(r, t0 + (0.0 if math.isinf(r.arrival) else r.arrival)) for r in reqs}
        order = sorted(pending.values(), key=lambda p: p.arrival)
        sent, done = 0, []
        tag = {"variant": variant, "rate": rate, "repeat": repeat, **({"warmup": True} if warmup else {})}

        def record(p: _Pending, output_ids: list[int], error: Optional[str], phases: Optional[dict] = None,
                   workers: Optional[dict] = None, cached: int = 0, route: Optional[str] = None,
                   client: Optional[dict] = None) -> dict:
            return build_request_record(
                variant=variant, rate=rate, id=p.req.id, prompt_ids=p.req.prompt_ids, output_ids=output_ids,
                arrival=p.arrival, token_times=p.token_times, slo=slo, error=error, phases=phases,
                workers=workers, cached_tokens=cached, warmup=warmup, repeat=repeat,
                delivery_lag=[b - a for a, b in zip(p.token_times, p.received)], route=route, client=client)

        def append(kind: str, records: list[dict]) -> None:
            if write:
                self.rd.append(kind, records)

        try:
            last_event = time.monotonic()
            while pending:
                now = time.monotonic()
                while sent < len(order) and order[sent].arrival <= now:
                    p = order[sent]
                    cluster.submit(p.req.id, p.req.prompt_ids, {"max_tokens": p.req.output_len, "ignore_eos": True})
                    sent += 1
                if not warmup:
                    self.view.update_requests(variant, rate, sent=sent, repeat=repeat)
                wait = order[sent].arrival - time.monotonic() if sent < len(order) else 0.5
                events = cluster.poll(max(0.0, min(wait, 0.5)))
                if events:
                    last_event = time.monotonic()
                records, steps, transfers = [], [], []
                failure: Optional[str] = None
                for e in events:
                    if isinstance(e, TokenEvent):
                        if e.req_id in pending:
                            pending[e.req_id].token_times.append(e.t)
                            pending[e.req_id].received.append(e.received)
                    elif isinstance(e, RequestDone):
                        p = pending.pop(e.req_id, None)
                        if p is not None:
                            workers = ({"prefill": e.prefill_worker, "decode": e.decode_worker} if e.decode_worker
                                       else {"unified": e.prefill_worker})
                            records.append(record(p, e.output_ids, None if e.ok else (e.error or "failed"),
                                                  e.phases, workers, e.cached_tokens, e.route, e.client))
                    elif isinstance(e, StepEvent):
                        steps.append({**tag, "worker": e.worker, "role": e.role, **e.record})
                        self._worker_view(e)
                    elif isinstance(e, TransferEvent):
                        transfers.append({**tag, **e.record})
                        self.paths.saw(e.record)
                    elif isinstance(e, WorkerFailed):
                        failure = failure or e.reason
                append("requests", records)
                append("steps", steps)
                append("transfers", transfers)
                done += records
                if records and not warmup:
                    self.view.update_requests(variant, rate, records=records, repeat=repeat)
                if failure:  # a degraded cluster would measure something else: stop here
                    raise RunAborted(failure)
                if time.monotonic() - last_event > STALL_TIMEOUT_S:
                    raise RunAborted(f"no progress for {STALL_TIMEOUT_S:.0f}s at {variant} @ {_tag(rate)} req/s "
                                     f"({len(pending)} requests unfinished)")
        except BaseException as e:
            # Requests already sent and not finished are written as failed, with why: they count as
            # misses of this (variant, rate) instead of silently vanishing from its attainment.
            why = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"run stopped early: {e}"
            append("requests", [record(p, [], why) for p in order[:sent] if p.req.id in pending])
            raise
        return done

    def _worker_view(self, e: Any) -> None:
        r = e.record
        self.steps_seen[e.worker] = self.steps_seen.get(e.worker, 0) + 1
        self.view.update_worker(e.worker, role=e.role, running=r.get("running"), waiting=r.get("waiting"),
                                kv_used=r.get("kv_blocks_used"), kv_total=r.get("kv_blocks_total"),
                                steps=self.steps_seen[e.worker])


def _tag(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
