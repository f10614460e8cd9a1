"""A simulated worker's pace (pdlab.sim.pace): a worker's steps scaled by its factor at the rate being simulated,
its gaps between steps drawn from quantiles, seeded per worker, rate and repeat; a worker without one takes the
profile as it is."""

import math
import statistics

import pytest

from pdlab.recipe import parse_recipe
from pdlab.sim.pace import LEVELS, WorkerPace, draw, quantiles
from pdlab.sim.worker_time import WorkerTime
from pdlab.sim.simulator import Simulator
from pdlab.timing.host import host_times
from pdlab.timing.records import COUNTS
from pdlab.workload import build_requests

TIMING = {"fixed_ms": 2, "prefill_token_ms": 0.5, "decode_seq_ms": 1}


def variant(deployment: dict, gap_ms: float = 0.0):
    r = parse_recipe({"model": {"preset": "tiny-llama", "timing": {"name": "t", "step": TIMING,
                                                                   "host": {"gap_ms": gap_ms}}},
                      "engine": {"block_size": 8, "kv_blocks": 256, "max_running": 16},
                      "workload": {"requests": 12, "input_len": {"kind": "uniform", "min": 10, "max": 60},
                                   "output_len": {"kind": "fixed", "value": 6}},
                      "rates": [5], "slo": {"ttft_ms": 1000, "itl_ms": 50},
                      "variants": {"v": {"deployment": deployment}}})
    return r.resolved("v")


PD = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"}


def test_quantiles_and_draws_follow_the_values():
    q = quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert len(q) == len(LEVELS) and (q[0], q[-1]) == (1.0, 5.0)
    assert [draw(q, u) for u in (0.0, 0.5, 1.0, 0.125, 0.995)] == pytest.approx([1.0, 3.0, 5.0, 1.5, 4.98])
    assert quantiles([]) == () and set(quantiles([7.0])) == {7.0}
    # the tail is kept where a request's p99 ITL reads it: one long pause among 1,000 gaps moves p99.5 little
    tail = quantiles([1.0] * 999 + [100.0])
    assert draw(tail, 0.99) == pytest.approx(1.0) and draw(tail, 0.995) == pytest.approx(1.0)


def test_a_worker_steps_at_its_factor_for_the_rate_simulated():
    p = WorkerTime(variant(PD).model.timing, "decode0", WorkerPace(1.5, (), (("5", 0, 2.0),)))
    base = p.profile.step_s(10, 2, 100)
    p.begin(5.0, 0)
    assert p.step_s(10, 2, 100) == pytest.approx(2.0 * base)
    p.begin(5.0, 1)  # another repeat: the worker's factor in all
    assert p.step_s(10, 2, 100) == pytest.approx(1.5 * base)
    p.begin(math.inf, 0)
    assert p.step_s(10, 2, 100) == pytest.approx(1.5 * base)
    assert p.kv_memory_gb == p.profile.kv_memory_gb  # everything else is the profile's
    assert WorkerTime(variant(PD).model.timing, "decode0").step_s(10, 2, 100) == pytest.approx(base)  # no pace
    # steps and gaps draw from streams of their own: a slow draw for a step is not a long gap after it
    p.begin(5.0, 0)
    assert [p.step_rng.random() for _ in range(3)] != [p.gap_rng.random() for _ in range(3)]


def test_the_simulator_steps_each_worker_at_its_pace():
    v = variant(PD)
    reqs = build_requests(v.workload, 5.0, seed=2, vocab_size=512)
    plain = Simulator(v, v.slo).run(reqs, 5.0)
    paced = Simulator(v, v.slo, {"decode0": WorkerPace(3.0)}).run(reqs, 5.0)

    def ms(steps, worker):
        return sorted(round((s["end"] - s["start"]) * 1e3, 6) for s in steps if s["worker"] == worker)

    assert ms(paced[1], "prefill0") == ms(plain[1], "prefill0")  # no pace: the profile as it is
    dec = [s for s in paced[1] if s["worker"] == "decode0"]
    assert dec and all(s["end"] - s["start"] == pytest.approx(3.0 * (2 + s["decode_seqs"]) / 1e3) for s in dec)
    assert paced[0][0]["output_ids"] == plain[0][0]["output_ids"]  # the same tokens, later
    with pytest.raises(ValueError, match="does not have: decode7"):
        Simulator(v, v.slo, {"decode7": WorkerPace(2.0)})


def test_gaps_are_drawn_from_the_workers_quantiles_and_repeat_exactly():
    v = variant({"unified": {"devices": ["cpu:0"]}}, gap_ms=0.25)
    reqs = build_requests(v.workload, math.inf, seed=3, vocab_size=512)
    pace = {"unified0": WorkerPace(1.0, quantiles([0.5, 1.0, 4.0, 9.0]))}

    def gaps(steps):
        steps = sorted(steps, key=lambda s: s["start"])
        return [round((b["start"] - a["end"]) * 1e3, 9) for a, b in zip(steps, steps[1:])]

    once = gaps(Simulator(v, v.slo, pace).run(reqs, math.inf)[1])
    assert once == gaps(Simulator(v, v.slo, pace).run(reqs, math.inf)[1])  # seeded: the same draws
    assert all(0.5 - 1e-6 <= g <= 9.0 + 1e-6 for g in once) and len(set(once)) > len(once) // 2
    assert set(gaps(Simulator(v, v.slo).run(reqs, math.inf)[1])) == {0.25}  # the profile's gap without a pace


def test_a_burst_reaches_the_workers_send_ms_apart():
    """At rate inf every request is due at once; the router takes them one at a time, send_ms each. An idle
    worker steps hop_ms after the first reached it, with those that reached it by then (a run's first step at
    inf held 7 of its 8 requests, its router sending 0.02-0.04 ms apart with hops of 0.35-0.5 ms), and the
    later ones wait for the next step."""
    def first_step(send_ms):
        raw = {"model": {"preset": "tiny-llama", "timing": {"name": "t", "step": TIMING,
                                                            "host": {"hop_ms": 1.0, "send_ms": send_ms}}},
               "engine": {"block_size": 8, "kv_blocks": 256, "max_running": 16},
               "workload": {"requests": 6, "input_len": {"kind": "fixed", "value": 30},
                            "output_len": {"kind": "fixed", "value": 4}},
               "rates": [".inf"], "slo": {"ttft_ms": 1000, "itl_ms": 50},
               "variants": {"v": {"deployment": {"unified": {"devices": ["cpu:0"]}}}}}
        v = parse_recipe(raw).resolved("v")
        recs, steps, _ = Simulator(v, v.slo).run(build_requests(v.workload, math.inf, seed=1, vocab_size=512),
                                                 math.inf)
        return min(steps, key=lambda s: s["start"]), recs

    together, recs = first_step(0.0)
    assert together["prefill_tokens"] == 6 * 30  # all at the worker before its first step
    assert first_step(2.0)[0]["prefill_tokens"] == 30  # the first alone: the others come after its hop
    spread, recs = first_step(0.5)
    assert spread["prefill_tokens"] == 3 * 30  # routed 0, 0.5 and 1.0 ms after the first: within its 1 ms hop
    assert len({r["ttft"] for r in recs}) > 1
    # the records say when the router took each request, as a run's do: the send time reads back from them
    assert sorted(round((r["phases"]["queued"] - recs[0]["arrival"]) * 1e3, 6) for r in recs) == \
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert host_times([], recs)["send_ms"] == pytest.approx(0.5)


def test_a_decode_worker_spends_admit_ms_on_each_hand_over_before_its_next_step():
    """A decode worker's own time per hand-over it admits (host.admit_ms, a CPU pull's copy within it) passes
    between the copy's start and its next step, and the run's records of the simulation read it back
    (pdlab.timing.host.admits) as they read a run's."""
    def run(admit_ms):
        raw = {"model": {"preset": "tiny-llama", "timing": {"name": "t", "step": TIMING, "kv_bytes_per_token": 512,
                                                            "transfer": {"shm": {"gbps": 1, "latency_ms": 0.1}},
                                                            "host": {"gap_ms": 0.2, "admit_ms": admit_ms}}},
               "engine": {"block_size": 8, "kv_blocks": 512, "max_running": 32},
               "workload": {"requests": 40, "input_len": {"kind": "fixed", "value": 30},
                            "output_len": {"kind": "fixed", "value": 24}},
               "rates": [20], "slo": {"ttft_ms": 1000, "itl_ms": 50},
               "variants": {"v": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                                  "mode": "pull"}}}}
        v = parse_recipe(raw).resolved("v")
        recs, steps, _ = Simulator(v, v.slo).run(build_requests(v.workload, 20.0, seed=1, vocab_size=512), 20.0)
        return recs, steps

    recs, steps = run(2.0)
    dec = sorted((s for s in steps if s["worker"] == "decode0"), key=lambda s: s["start"])
    for r in recs:  # the decode worker's first step after each admission starts 2 ms or more after its copy began
        t = r["phases"]["admitted"]
        nxt = next(s for s in dec if s["start"] >= t)
        assert nxt["start"] - r["phases"]["transfer_start"] >= 0.002 - 1e-9
    assert host_times(steps, recs)["admit_ms"] == pytest.approx(2.0, rel=0.05)
    recs0, steps0 = run(0.0)
    copies = [r["phases"]["transfer_end"] - r["phases"]["transfer_start"] for r in recs0]
    # none of its own: what a gap holds is the copy (0.1 ms and 30 tokens of 512 bytes at 1 GB/s)
    assert host_times(steps0, recs0)["admit_ms"] == pytest.approx(statistics.median(copies) * 1e3, rel=0.05)
    assert {r["id"]: r["output_ids"] for r in recs} == {r["id"]: r["output_ids"] for r in recs0}


QUICK_PREFILL = {**TIMING, "prefill_token_ms": 0.05}  # prefills quick beside the decodes: admits between steps


def handed_over(mode: str, host: dict, contention: dict | None = None,
                latency_ms: float = 3.0) -> tuple[list, list]:
    """(request records, step records) of 40 requests of 20-400 prompt tokens at 20 req/s through a simulated
    1P1D deployment in `mode` (handed_over_variant's)."""
    v = handed_over_variant(mode, host, contention, latency_ms)
    recs, steps, _ = Simulator(v, v.slo).run(build_requests(v.workload, 20.0, seed=1, vocab_size=512), 20.0)
    return recs, steps


def handed_over_variant(mode: str, host: dict, contention: dict | None = None, latency_ms: float = 3.0):
    """A 1P1D deployment in `mode` of a tiny model whose profile's step is QUICK_PREFILL, with `host` (and
    `contention`; the shm copy's latency), as a resolved variant."""
    timing = {"name": "t", "step": QUICK_PREFILL, "kv_bytes_per_token": 512,
              "transfer": {"shm": {"gbps": 1, "latency_ms": latency_ms}}, "host": host,
              **({"contention": contention} if contention else {})}
    raw = {"model": {"preset": "tiny-llama", "timing": timing},
           "engine": {"block_size": 8, "kv_blocks": 1024, "max_running": 32},
           "workload": {"requests": 40, "input_len": {"kind": "uniform", "min": 20, "max": 400},
                        "output_len": {"kind": "fixed", "value": 24}},
           "rates": [20], "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "variants": {"v": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                              "mode": mode}}}}
    return parse_recipe(raw).resolved("v")


def test_a_pull_adds_admit_ktok_ms_per_1000_tokens_it_copied_and_a_push_does_not():
    """host.admit_ktok_ms: a pull's copy shares its decode worker's core, so each admission puts admit_ms and
    admit_ktok_ms per 1000 prompt tokens between the copy's start and the worker's next step (a quick copy: its
    own time within them); the simulation's records read both back. A push's copy runs on its prefill worker:
    its admissions take admit_ms alone."""
    def run(mode):
        return handed_over(mode, {"gap_ms": 0.2, "admit_ms": 0.5, "admit_ktok_ms": 4.0}, latency_ms=0.1)

    recs, steps = run("pull")
    dec = sorted((s for s in steps if s["worker"] == "decode0"), key=lambda s: s["start"])
    for r in recs:  # the decode worker's next step after each admission waits for its copy too
        t = r["phases"]["admitted"]
        nxt = next(s for s in dec if s["start"] >= t)
        assert nxt["start"] - r["phases"]["transfer_start"] >= 0.0005 + 0.004 * r["prompt_len"] / 1000 - 1e-9
    h = host_times(steps, recs)
    assert h["admit_ms"] == pytest.approx(0.5, abs=0.05) and h["admit_ktok_ms"] == pytest.approx(4.0, rel=0.05)
    push = host_times(*run("push")[::-1])
    assert push["admit_ms"] == pytest.approx(0.5, abs=0.05) and push["admit_ktok_ms"] is None


def test_the_main_process_takes_its_time_from_the_workers_cores_only_where_it_has_none_of_its_own():
    """contention.main_step_ms on a box where the deployment leaves the main process no core: each worker's steps
    take longer by what it takes while both step (pdlab.sim.host_load), and most from the one that idles most
    (a 1P1D prefill worker, against its decode worker); with a core of its own nothing changes. The tokens are
    the same either way."""
    def run(shares, dep):
        step = {**TIMING, "prefill_token_ms": 0.05}  # the prefill worker idles more than the decode worker
        raw = {"model": {"preset": "tiny-llama", "timing": {"name": "t", "step": step, "kv_bytes_per_token": 512,
                                                            "transfer": {"shm": {"gbps": 1, "latency_ms": 1}},
                                                            "contention": {"main_step_ms": 0.5}}},
               "engine": {"block_size": 8, "kv_blocks": 1024, "max_running": 32},
               "workload": {"requests": 40, "input_len": {"kind": "uniform", "min": 20, "max": 200},
                            "output_len": {"kind": "fixed", "value": 32}},
               "rates": [30], "slo": {"ttft_ms": 1000, "itl_ms": 50}, "variants": {"v": {"deployment": dep}}}
        v = parse_recipe(raw).resolved("v")
        sim = Simulator(v, v.slo, shares_cores=shares)
        recs, steps, _ = sim.run(build_requests(v.workload, 30.0, seed=2, vocab_size=512), 30.0)
        model = v.model.timing
        over = {}
        for s in steps:
            ms = model.step_s(*(s[k] for k in COUNTS)) * 1e3
            over.setdefault(s["worker"], []).append((s["end"] - s["start"]) * 1e3 / ms)
        return {r["id"]: r["output_ids"] for r in recs}, over

    pd = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"}
    unified = {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}
    for dep in (pd, unified):
        toks, shared = run(True, dep)
        toks0, own = run(False, dep)
        assert toks == toks0
        assert all(x == pytest.approx(1.0) for xs in own.values() for x in xs)  # a core of its own: the model
        assert all(x >= 1.0 - 1e-9 for xs in shared.values() for x in xs)
        assert all(max(xs) > 1.0 for xs in shared.values())
    _, shared = run(True, pd)
    mean = {w: sum(xs) / len(xs) for w, xs in shared.items()}
    assert mean["prefill0"] - 1 > 2 * (mean["decode0"] - 1)  # the prefill worker idles most: it loses most
