"""The run loop behind `pdlab run`: for every variant, start its workers once; for every rate, warm up,
send the seeded requests at their scheduled times, collect every token as it reaches the router, and
write the records as they come. Nothing here knows about engines: it drives a `Cluster`.

Faults end the run cleanly: a worker that dies fails its in-flight requests (the router does that), the
run stops there, and everything measured so far is written, marked partial. Ctrl-C does the same.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.constants import STALL_TIMEOUT_S
from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir
from pdlab.recipe import Recipe, Variant
from pdlab.workload import Workload, WorkloadRequest

LEAD_S = 0.05  # the first arrival is this far after the rate starts, so nothing is late by construction


class RunAborted(RuntimeError):
    """The run stopped early; what was measured is kept."""


@dataclass
class _Pending:
    req: WorkloadRequest
    arrival: float  # absolute, time.monotonic()
    token_times: list[float] = field(default_factory=list)


def check_machine(recipe: Recipe) -> None:
    """Every variant's devices exist on this machine, checked before any process starts (raises ClusterError)."""
    from pdlab.serve.topology import place

    for v in recipe.variants.values():
        place(v.deployment)


class Harness:
    def __init__(self, recipe: Recipe, rd: RunDir, view: Any, workloads: dict[str, Workload]):
        """`workloads`: variant -> its requests (pdlab.workload.build_workload)."""
        self.recipe, self.rd, self.view = recipe, rd, view
        self.workloads = workloads
        self.steps_seen: dict[str, int] = {}

    def run(self) -> None:
        for variant in self.recipe.variant_names:
            self.run_variant(variant)

    def run_variant(self, variant: str) -> None:
        from pdlab.serve.cluster import Cluster

        v = self.recipe.resolved(variant)
        workload = self.workloads[variant]
        for rate in v.rates:
            self.view.plan(variant, rate, v.workload.requests)
        n = len(v.deployment.workers)
        self.view.note(f"{variant}: starting {n} worker{'s' if n != 1 else ''}")
        with Cluster(v.model, v.engine, v.deployment, seed=v.seed) as cluster:
            cluster.start()
            for w in cluster.workers:
                self.view.update_worker(w.name, role=w.role, devices=",".join(w.devices))
            for rate in v.rates:
                cluster.reset_prefix_cache()  # every rate starts with a cold prefix cache
                if workload.warmup:
                    self.serve(cluster, v, rate, workload.warmup, warmup=True)
                self.serve(cluster, v, rate, workload.at(rate), warmup=False)
        self.view.drop_workers()

    def serve(self, cluster: Any, v: Variant, rate: float, reqs: tuple[WorkloadRequest, ...], warmup: bool) -> None:
        """Send `reqs` at their arrival offsets and collect until each has finished."""
        from pdlab.serve.cluster import RequestDone, StepEvent, TokenEvent, TransferEvent, WorkerFailed

        variant, slo = v.name, v.slo
        t0 = time.monotonic() + LEAD_S
        pending = {r.id: _Pending(r, t0 + (0.0 if math.isinf(r.arrival) else r.arrival)) for r in reqs}
        order = sorted(pending.values(), key=lambda p: p.arrival)
        sent = 0

        def record(p: _Pending, output_ids: list[int], error: Optional[str], phases: Optional[dict] = None,
                   workers: Optional[dict] = None, cached: int = 0) -> dict:
            return build_request_record(
                variant=variant, rate=rate, id=p.req.id, prompt_ids=p.req.prompt_ids, output_ids=output_ids,
                arrival=p.arrival, token_times=p.token_times, slo=slo, error=error, phases=phases,
                workers=workers, cached_tokens=cached, warmup=warmup)

        try:
            last_event = time.monotonic()
            while pending:
                now = time.monotonic()
                while sent < len(order) and order[sent].arrival <= now:
                    p = order[sent]
                    cluster.submit(p.req.id, p.req.prompt_ids, {"max_tokens": p.req.output_len, "ignore_eos": True})
                    sent += 1
                if not warmup:
                    self.view.update_requests(variant, rate, sent=sent)
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
                    elif isinstance(e, RequestDone):
                        p = pending.pop(e.req_id, None)
                        if p is not None:
                            workers = ({"prefill": e.prefill_worker, "decode": e.decode_worker} if e.decode_worker
                                       else {"unified": e.prefill_worker})
                            records.append(record(p, e.output_ids, None if e.ok else (e.error or "failed"),
                                                  e.phases, workers, e.cached_tokens))
                    elif isinstance(e, StepEvent):
                        steps.append({"variant": variant, "rate": rate, "worker": e.worker, "role": e.role,
                                      **e.record, **({"warmup": True} if warmup else {})})
                        self._worker_view(e)
                    elif isinstance(e, TransferEvent):
                        transfers.append({"variant": variant, "rate": rate, **e.record,
                                          **({"warmup": True} if warmup else {})})
                    elif isinstance(e, WorkerFailed):
                        failure = failure or e.reason
                self.rd.append("requests", records)
                self.rd.append("steps", steps)
                self.rd.append("transfers", transfers)
                if records and not warmup:
                    self.view.update_requests(variant, rate, records=records)
                if failure:  # a degraded cluster would measure something else: stop here
                    raise RunAborted(failure)
                if time.monotonic() - last_event > STALL_TIMEOUT_S:
                    raise RunAborted(f"no progress for {STALL_TIMEOUT_S:.0f}s at {variant} @ {rate} req/s "
                                     f"({len(pending)} requests unfinished)")
        except BaseException as e:
            # Requests already sent and not finished are written as failed, with why: they count as
            # misses of this (variant, rate) instead of silently vanishing from its attainment.
            why = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"run stopped early: {e}"
            cut = [record(p, [], why) for p in order[:sent] if p.req.id in pending]
            self.rd.append("requests", cut)
            raise

    def _worker_view(self, e: Any) -> None:
        r = e.record
        self.steps_seen[e.worker] = self.steps_seen.get(e.worker, 0) + 1
        self.view.update_worker(e.worker, role=e.role, running=r.get("running"), waiting=r.get("waiting"),
                                kv_used=r.get("kv_blocks_used"), kv_total=r.get("kv_blocks_total"),
                                steps=self.steps_seen[e.worker])
