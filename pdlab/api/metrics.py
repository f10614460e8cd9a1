"""/metrics of pdlab serve in Prometheus' text format: vLLM's names where vLLM has the quantity, pdlab's own
for what disaggregation adds, so a dashboard built for vLLM reads a pdlab deployment unchanged.

Times are the workers' own stamps (TokenEvent.t), as in a run: TTFT is the first token's stamp less the
request's arrival (when its HTTP request came in), ITL the gap between two stamps. An external engine's
tokens are stamped by pdlab's client per chunk; tokens of one chunk share a stamp and add no ITL sample.
Engine gauges (running, waiting, KV use) come from each worker's step records, labelled `engine` with the
worker's name; an engine whose steps pdlab cannot see (vLLM) has none.

pdlab's own:
- `pdlab:prefill_interruptions`: ITL gaps longer than the recipe's ITL target during which the worker that
  produced the later token ran a step with prefill tokens (docs/design.md 2.10, counted live). A relative
  SLO has no target without a run's calibration: then every such gap counts.
- `pdlab:handover_seconds` (histogram, a whole copy: end - start) and `pdlab:handover_bytes` per transport
  and mode; `pdlab:transport_path` (info): the path each prefill -> decode pair's KV actually took.
- `pdlab:requests_in_flight`: HTTP requests the server is answering.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so histograms from both engines line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
HANDOVER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFILL_STEPS_KEPT = 256  # per worker: prefill steps older than the gaps still open are not needed


class PrefillSteps:
    """Each worker's latest steps that carried prefill tokens, to ask whether one overlapped a gap. A step's
    record reaches the router before the tokens it sampled (one socket, in order)."""

    def __init__(self) -> None:
        self.by: dict[str, deque] = defaultdict(lambda: deque(maxlen=PREFILL_STEPS_KEPT))

    def add(self, worker: str, rec: dict) -> None:
        if rec.get("prefill_tokens"):
            self.by[worker].append((rec["start"], rec["end"]))

    def overlap(self, worker: str, t0: float, t1: float) -> bool:
        for start, end in reversed(self.by.get(worker, ())):
            if end <= t0:
                return False  # steps of one worker follow each other: every earlier one ended earlier
            if start < t1:
                return True
        return False


class ServeMetrics:
    def __init__(self, model: str, itl_target_s: float):
        self.model, self.itl_target_s = model, itl_target_s
        r = self.registry = CollectorRegistry()
        m, e = ["model_name"], ["model_name", "engine"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to the first prefill step.",
                               m, buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Time from the first prefill step to the "
                                 "end of prefill.", m, buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Sequences running after the worker's last step.", e,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting after the worker's last step.", e,
                             registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e, registry=r)
        self.preempted = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", e, registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens.", m, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached prompt tokens.", m, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               m + ["finished_reason"], registry=r)
        self.interruptions = Counter("pdlab:prefill_interruptions", "ITL gaps over the ITL target "
                                     f"({itl_target_s * 1000:g} ms) overlapping a prefill step of the worker that "
                                     "produced the later token.", e, registry=r)
        x = ["model_name", "transport", "mode"]
        self.handover_s = Histogram("pdlab:handover_seconds", "KV hand-over copy time (end - start) in seconds.",
                                    x, buckets=HANDOVER_BUCKETS, registry=r)
        self.handover_bytes = Counter("pdlab:handover_bytes", "KV bytes handed over.", x, registry=r)
        self.path = Info("pdlab:transport_path", "The path a prefill -> decode pair's KV took.",
                         ["model_name", "src", "dst"], registry=r)
        self.in_flight = Gauge("pdlab:requests_in_flight", "HTTP requests being answered.", m, registry=r)
        self.steps = PrefillSteps()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition in the format the scraper's Accept header asks for (Prometheus text 0.0.4 unless it
        asks for OpenMetrics or a newer text version), and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

    # ---- events (the bridge thread) ----
    def step(self, worker: str, rec: dict) -> None:
        self.steps.add(worker, rec)
        labels = (self.model, worker)
        self.running.labels(*labels).set(rec.get("running", 0))
        self.waiting.labels(*labels).set(rec.get("waiting", 0))
        total = rec.get("kv_blocks_total") or 0
        self.kv.labels(*labels).set(rec.get("kv_blocks_used", 0) / total if total else 0.0)
        if rec.get("preempted"):
            self.preempted.labels(*labels).inc(rec["preempted"])

    def transfer(self, rec: dict) -> None:
        labels = (self.model, str(rec.get("transport")), str(rec.get("mode")))
        self.handover_s.labels(*labels).observe(max(0.0, rec["end"] - rec["start"]))
        self.handover_bytes.labels(*labels).inc(rec.get("bytes") or 0)
        if rec.get("path"):
            self.path.labels(self.model, str(rec.get("src")), str(rec.get("dst"))).info(
                {"transport": str(rec.get("transport")), "mode": str(rec.get("mode")), "path": str(rec["path"])})

    def token(self, live: Any, e: Any) -> None:
        """Before the bridge appends the token's stamp to `live.token_times`."""
        self.generation.labels(self.model).inc()
        if not live.token_times:
            self.ttft.labels(self.model).observe(max(0.0, e.t - live.sub.arrival))
            self.prompt.labels(self.model).inc(len(live.sub.prompt_ids))
            return
        prev = live.token_times[-1]
        gap = e.t - prev
        if gap <= 0:
            return  # the same chunk (an external engine's client stamps per chunk)
        self.itl.labels(self.model).observe(gap)
        if gap > self.itl_target_s and self.steps.overlap(e.worker, prev, e.t):
            self.interruptions.labels(self.model, e.worker).inc()

    def done(self, live: Any, finish_reason: Any) -> None:
        """A request recorded: its end-to-end latency, phases, prefix-cache use and success."""
        if not live.token_times:
            return
        arrival, d = live.sub.arrival, live.done
        self.e2e.labels(self.model).observe(max(0.0, live.token_times[-1] - arrival))
        phases = (d.phases if d is not None else None) or {}
        if phases.get("prefill_start"):
            self.queue.labels(self.model).observe(max(0.0, phases["prefill_start"] - arrival))
            if phases.get("prefill_end"):
                self.prefill.labels(self.model).observe(max(0.0, phases["prefill_end"] - phases["prefill_start"]))
        self.queries.labels(self.model).inc(len(live.sub.prompt_ids))
        self.hits.labels(self.model).inc(d.cached_tokens if d is not None else 0)
        if finish_reason:
            self.success.labels(self.model, finish_reason).inc()
