"""`pdlab profile`'s host-time probe: a real 1P1D pull deployment of the profiled model (pdlab.serve.Cluster:
the router, worker processes, the shm hand-over) serves a few requests one at a time, and pdlab.timing.host
reads its host time from the steps and phases it reports, as `pdlab profile --check` reads a run's.

Requests one at a time find both workers idle, so their arrival and hand-over hops are clean samples, and
each request's decode steps run back to back, so the gaps between them are too. Then a burst of BURST
requests submitted together, as a run's harness submits requests that are due (all of them at rate inf), BURSTS
times: the router takes them one at a time, and their arrivals there, apart, give the send time. It is the
quickest burst's median: when a burst's first request wakes a worker on the router's core, the router shares
that core for the rest of the burst and every send takes 3-5 times as long (0.1-0.16 ms against 0.02-0.04 on
the 2-core Xeon; a run's router in the same race stalls once for 2-5 ms instead), and the simulator's router
runs at its own pace. The burst's batched
steps add to the gap samples too. Then CO_REQUESTS requests with longer outputs, each submitted once the
decode worker has taken STAGGER_STEPS steps with the one before: each prefill runs beside the decoding of
the requests before it, so both workers step together, as a run's do, and each hand-over is admitted on its
own between two decode steps (the admit time of pulls of several lengths). Its steps, with the one-at-a-time
ones (each worker alone), give the contention figures (pdlab.timing.contention), which need the step model:
the probe returns its steps for `pdlab profile` to estimate them once the model is fitted. Between the
one-at-a-time requests and the bursts, CHAINED requests of one token each (prefill only: the prefill worker
finishes them), each submitted as the one before finishes: the prefill worker steps them a few ms apart with
the decode worker idle, warm prefills alone, which the one-at-a-time requests (each after an idle worker,
cold) never give; `pdlab profile` holds them against the model just fitted, as it does the decode steps
alone (pdlab.timing.build worker_steps: a prefill path of the workers' other than the profile's shows there,
as the 3x of issue 25 would have). And the probe's own
CPU time over the steps its workers took: the main process's CPU time per worker step (its loop writes the
records a run's harness writes, each step's line and each request's record with its metrics, to a scratch run
directory, so that its time is a run's). `pdlab profile` takes contention.main_step_ms from what the workers'
steps lost to it (pdlab.timing.contention.main_step) where it shared their cores (`main_shared`), and this
where it did not or they do not record their CPU time.

The phases run in PHASES's order: half the one-at-a-time requests and half the chained ones first, then the
bursts and the staggered requests, then the other halves, so that the steps alone straddle the steps together.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable, Optional

import numpy as np

REQUESTS = 8
BURST = 8  # requests submitted together after them
BURSTS = 3  # of them: the send time is the quickest burst's (its router at its own pace)
PROMPTS = (64, 1024)  # prompt lengths drawn uniformly from this range (within the model's context): pulls of
#                       several lengths, whose admit time grows with them (pdlab.timing.host admit_ktok)
OUTPUT = 64  # tokens each: the first steps of a new decode batch run slower (measure.DECODE_LEAD); 16 left mostly those
CHAINED = 16  # prefill-only requests one after the other: warm prefill steps alone (each phase's first is cold)
# staggered, so that prefills run beside decodes (and pulls are admitted one at a time): with 20, ten probes in
# a row on the 2-core Xeon read prefill_x with a spread (sd) of 0.044, with 40 of 0.023 (2026-12-08, BENCHMARKS.md)
CO_REQUESTS = 40
CO_OUTPUT = 48
STAGGER_STEPS = 4  # decode steps between one staggered submission and the next
IDLE_S = 0.05  # between one request's end and the next one's submission: both workers idle again
# The phases in the order they run, each (kind, how many). The steps alone (one at a time, chained) come half
# before and half after the steps together (bursts, staggered), so that a box whose pace moves steadily over the
# probe moves both alike: contention is a ratio of the two, and with the steps alone all first, such a drift read
# as contention (a factor below 1 beside stepping workers, which a neighbour cannot cause, was one sign of it).
# In a quiet quarter hour on the 2-core Xeon the two orders read the same (2026-12-08, BENCHMARKS.md).
PHASES = (("one", REQUESTS // 2), ("chained", CHAINED // 2), ("burst", BURSTS), ("staggered", CO_REQUESTS),
          ("chained", CHAINED - CHAINED // 2), ("one", REQUESTS - REQUESTS // 2))
TIMEOUT_S = 120.0  # the whole probe, after the workers are up


def _model_spec(model: str, dtype: str) -> Any:
    from pdlab.engine.model import PRESETS
    from pdlab.recipe.model import ModelSpec

    return ModelSpec.from_raw({("preset" if model in PRESETS else "path"): model, "dtype": dtype}, "model")


def probe_host(model: str, dtype: str, cores: list[int], seed: int = 0,
               say: Optional[Callable[[str], None]] = None) -> dict:
    """Host time of the profiled model's workers on `cores` (prefill on the first, decode on the last; one
    core: both on it), by pdlab.timing.host.host_times; plus `requests`, the requests served, `steps`, their
    step records, and `request_records`, theirs (for pdlab.timing.contention)."""
    from pdlab.engine.config import EngineConfig
    from pdlab.measure.metrics import build_request_record
    from pdlab.measure.records import RunDir
    from pdlab.recipe.slo import SLO
    from pdlab.engine.model import model_config
    from pdlab.recipe.deployment import Deployment
    from pdlab.serve.cluster import Cluster, RequestDone, StepEvent, TokenEvent
    from pdlab.serve.topology import main_shares_cores
    from pdlab.timing.host import host_times, median_ms, sends

    spec = _model_spec(model, dtype)
    dep = Deployment.from_raw({"prefill": {"devices": [f"cpu:{cores[0]}"]},
                               "decode": {"devices": [f"cpu:{cores[-1]}"]},
                               "transport": "shm", "mode": "pull", "share_devices": len(set(cores)) < 2},
                              "host probe")
    rng = np.random.default_rng(seed)
    steps: list[dict] = []
    requests: list[dict] = []
    tag = {"variant": "host", "rate": 0.0, "repeat": 0}
    slo = SLO(ttft_ms=1000.0, itl_ms=100.0)  # a run's records carry a verdict; the probe's is not read
    with Cluster(spec, EngineConfig(), dep, seed=seed) as cluster, tempfile.TemporaryDirectory() as scratch, \
            RunDir(scratch) as rd:
        cluster.start()
        if say:
            say(f"host time: a 1P1D pull deployment on cpu:{cores[0]} and cpu:{cores[-1]}, {REQUESTS} requests "
                f"one at a time, {CHAINED} prefills chained, {BURSTS} bursts of {BURST}, then {CO_REQUESTS} staggered")
        cfg = model_config(spec)
        vocab = cfg.vocab_size
        context = int(getattr(cfg, "max_position_embeddings", 0) or PROMPTS[1] * 2)
        lengths = (min(PROMPTS[0], context // 4), max(min(PROMPTS[1], context - OUTPUT - 1), PROMPTS[0] + 1))
        deadline = time.monotonic() + TIMEOUT_S

        def serve(ids: list[str], output: int = OUTPUT, stagger: bool = False, chain: bool = False) -> None:
            """Submit `ids` together (stagger: one each STAGGER_STEPS decode steps with the one before, counted
            from its first token from the decode worker; chain: one as the one before finishes), then read events
            until all are done (and both workers idle again)."""
            queue = [(rid, rng.integers(3, vocab, size=int(rng.integers(*lengths))).tolist()) for rid in ids]
            arrivals: dict[str, float] = {}
            prompts = dict(queue)
            times: dict[str, list[float]] = {rid: [] for rid in ids}

            def submit(n: int) -> None:
                now = time.monotonic()  # made before: a burst's spacing is the router's alone, as a harness's is
                for rid, prompt in queue[:n]:
                    arrivals[rid] = now
                    cluster.submit(rid, prompt, {"max_tokens": output, "ignore_eos": True})
                del queue[:n]

            submit(1 if stagger or chain else len(queue))
            left, last, decoded = set(ids), ids[0], None  # decode steps since `last` decoded (None: not yet)
            while left:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the host-time probe did not finish within {TIMEOUT_S:.0f} s")
                batch, done = [], []
                for e in cluster.poll(0.2):
                    if isinstance(e, TokenEvent):
                        if e.req_id in times:
                            times[e.req_id].append(e.t)
                        if e.req_id == last and e.index >= 1 and decoded is None:
                            decoded = 0
                    elif isinstance(e, StepEvent):
                        batch.append({**tag, "worker": e.worker, "role": e.role, **e.record})
                        if stagger and queue and decoded is not None and e.role == "decode":
                            decoded += 1
                            if decoded >= STAGGER_STEPS:
                                last, decoded = queue[0][0], None
                                submit(1)
                    elif isinstance(e, RequestDone) and e.req_id in left:
                        if not e.ok:
                            raise RuntimeError(f"the host-time probe's request {e.req_id} failed: {e.error}")
                        left.discard(e.req_id)
                        if chain and queue:
                            submit(1)
                        done.append(build_request_record(
                            **tag, id=e.req_id, prompt_ids=prompts[e.req_id], output_ids=e.output_ids,
                            arrival=arrivals[e.req_id], token_times=times[e.req_id], slo=slo, phases=dict(e.phases),
                            workers={"prefill": e.prefill_worker, "decode": e.decode_worker}))
                record(batch, done)
            record([{**tag, "worker": e.worker, "role": e.role, **e.record}  # the last steps; both workers idle
                    for e in cluster.poll(IDLE_S) if isinstance(e, StepEvent)], [])

        def record(batch: list[dict], done: list[dict]) -> None:
            """Keep them, and write them as a run's harness writes its records: the main process's time per
            step is then a run's."""
            steps.extend(batch)
            requests.extend(done)
            rd.append("steps", batch)
            rd.append("requests", done)

        cpu0 = time.process_time()
        bursts = 0
        for p, (kind, n) in enumerate(PHASES):
            if kind == "one":
                for i in range(n):
                    serve([f"h{p}.{i}"])
            elif kind == "chained" and n:
                serve([f"p{p}.{i}" for i in range(n)], 1, chain=True)
            elif kind == "burst":
                for _ in range(n):
                    serve([f"b{bursts}.{i}" for i in range(BURST)])
                    bursts += 1
            elif kind == "staggered" and n:
                serve([f"c{p}.{i}" for i in range(n)], CO_OUTPUT, stagger=True)
        main_s = time.process_time() - cpu0
    est = host_times(steps, requests)
    quickest = min((x for x in (median_ms(sends([r for r in requests if r["id"].startswith(f"b{k}.")]))
                                for k in range(bursts)) if x is not None), default=None)
    return {**est, "send_ms": quickest, "requests": len(requests), "steps": steps, "request_records": requests,
            "main_step_ms": 1000.0 * main_s / len(steps) if steps else None,
            "main_shared": main_shares_cores(dep)}  # the probe's main process had no core of its own
