"""The harness does not bend time: on a model double whose steps take known times (model.timing), TTFT at
low load matches M/D/1 and ITL matches the decode step; and attainment recomputed straight from the raw
token times, with an SLO that tells the ITL definitions apart, is what the summary says."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, OUT = 40, 8
# prefill of one 40-token prompt: 2 + 40 * 2 = 82 ms; a decode step of one sequence: 2 + 4 = 6 ms
TIMING = {"fixed_ms": 2.0, "prefill_token_ms": 2.0, "decode_seq_ms": 4.0}
PREFILL_S = (2 + PROMPT * 2) / 1000
DECODE_S = (TIMING["fixed_ms"] + TIMING["decode_seq_ms"]) / 1000
RECIPE = {
    "name": "double", "seed": 3, "warmup": 1,
    "model": {"preset": "tiny-llama", "timing": TIMING},
    "engine": {"block_size": 8, "kv_blocks": 128, "token_budget": 256, "max_running": 16},
    "workload": {"requests": 24, "arrival": {"kind": "poisson"}, "input_len": {"kind": "fixed", "value": PROMPT},
                 "output_len": {"kind": "fixed", "value": OUT}},
    "rates": [2, 8],
    # 50 ms sits between the definitions: a gap interrupted by a prefill (~90 ms) fails p99 and max but
    # not the mean (TPOT) of 7 gaps nor their median
    "slo": {"ttft_ms": 1000, "itl_ms": 50, "itl_stat": "p99", "attainment": 0.9},
    "deployment": {"unified": {"devices": ["cpu:0"]}},
}


@pytest.fixture(scope="module")
def double_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("double")
    recipe = d / "double.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = str(d / "run")
    r = subprocess.run([sys.executable, "-m", "pdlab.cli", "run", str(recipe), "--out", out], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    reqs = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl"))]
    steps = [json.loads(x) for x in open(os.path.join(out, "steps.jsonl"))]
    return summary, [x for x in reqs if not x.get("warmup")], steps


def host_gap(steps: list[dict], rate: float) -> float:
    """The worker's own time between back-to-back steps at `rate` (median, seconds), as steps.jsonl records
    it: sending tokens, taking in requests, scheduling. A timed step waits out only the modelled time, so a
    token gap is the modelled step plus this; the simulator models no host time. On a loaded 2-core box
    it has been measured at 0.3-0.7 ms, 5-11% of the 6 ms decode step."""
    by_worker: dict = {}
    for s in steps:
        if s["rate"] == rate:
            by_worker.setdefault(s["worker"], []).append(s)
    gaps = [b["start"] - a["end"] for ss in by_worker.values() for a, b in zip(ss, ss[1:])
            if b["start"] - a["end"] < DECODE_S]  # back to back: the engine had work waiting
    return float(np.median(gaps))


def host_ttft(summary: dict) -> float:
    """The host's time in one request's TTFT (seconds): one request alone, as the run's calibration measured
    it, minus the modelled prefill. It is the client's send, the router's hop and the worker's wake-up
    between steps; the simulator models none of it. On the loaded 2-core VM it has been 4-8 ms (5-10% of the
    82 ms prefill), and TTFT against the modelled prefill alone came out 11-13% over M/D/1 and the simulator
    there on a slow afternoon (2026-11-30), past a 10% bound that had held before."""
    return summary["alone"]["ttft_ms"] / 1000 - PREFILL_S


@pytest.mark.slow
def test_ttft_at_low_load_is_md1_and_itl_is_the_decode_step(double_run):
    summary, reqs, steps = double_run
    low = [r for r in reqs if r["rate"] == 2]
    # one request alone: the modelled prefill and a little host time, under 15% of the prefill
    first = host_ttft(summary)
    assert 0 <= first < 0.15 * PREFILL_S, first
    lam, d = 2.0, PREFILL_S
    rho = lam * d
    predicted = d + rho * d / (2 * (1 - rho))  # M/D/1 with the known prefill time, independent of pdlab
    measured = float(np.mean([r["token_times"][0] - r["arrival"] for r in low]))
    assert abs(measured - (predicted + first)) / predicted < 0.10, (measured, predicted, first)
    gaps = [b - a for r in low for a, b in zip(r["token_times"], r["token_times"][1:])]
    host = host_gap(steps, 2)
    assert host < 0.25 * DECODE_S, host  # the worker's own overhead stays small against the step
    decode_steps = [s["end"] - s["start"] for s in steps if s["rate"] == 2 and s["decode_seqs"] == 1
                    and s["prefill_tokens"] == 0]
    step = float(np.median(decode_steps))  # the modelled 6 ms and the sleep's overshoot
    assert abs(step - DECODE_S) / DECODE_S < 0.10, step
    # a token gap is the decode step and the host time between steps, nothing the harness adds (a median is
    # not a sum of medians: on the loaded 2-core VM the two sides have differed by up to 5% of a 6 ms gap)
    want = step + host
    assert abs(float(np.median(gaps)) - want) / want < 0.08, (np.median(gaps), DECODE_S, host)
    # the run's own check agrees: the M/D/1 line (on the calibrated prefill) is not flagged
    md = summary["variants"]["default"]["mdl1"]["repeats"][0]
    assert md["rate"] == 2 and not md["flag"] and abs(md["deviation"]) < 0.10, md


@pytest.mark.slow
def test_attainment_recomputed_from_raw_token_times(double_run):
    """Independently of pdlab's metric code, and with an SLO at which the ITL definitions disagree."""
    summary, reqs, _ = double_run
    slo = RECIPE["slo"]
    for rate in (2, 8):
        rs = [r for r in reqs if r["rate"] == rate]
        ttft_ok = [r["token_times"][0] - r["arrival"] <= slo["ttft_ms"] / 1000 for r in rs]

        def attainment(stat):
            return np.mean([t and stat(np.diff(r["token_times"])) <= slo["itl_ms"] / 1000
                            for t, r in zip(ttft_ok, rs)])

        p99 = attainment(lambda g: np.percentile(g, 99))
        got = summary["variants"]["default"]["rates"][str(rate)]
        assert got["attainment"] == pytest.approx(p99)
        assert got["attainment_tpot"] == pytest.approx(attainment(np.mean))
    # at 8 req/s prefills land on running decodes: the definitions must really differ in this data
    rs = [r for r in reqs if r["rate"] == 8]
    pooled_p99 = np.percentile([g for r in rs for g in np.diff(r["token_times"])], 99)
    per_request = summary["variants"]["default"]["rates"]["8"]["attainment"]
    assert per_request < summary["variants"]["default"]["rates"]["8"]["attainment_tpot"]
    assert pooled_p99 > slo["itl_ms"] / 1000 and per_request > 0


@pytest.mark.slow
def test_the_simulator_agrees_with_the_timed_run(double_run):
    """The same recipe and seeded workload in virtual time: mean TTFT and median ITL per rate within 10% of
    what the worker processes measured (the run has a router hop and OS scheduling the simulator does not).
    The simulator models no host time; the run measures its own (host_ttft per request, host_gap between
    steps), and the simulated TTFT and ITL are compared with those added, so that a slow box does not count
    as the simulator's error."""
    from pdlab.recipe import parse_recipe
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.workload import build_workload

    summary, reqs, steps = double_run
    r = parse_recipe(RECIPE)
    sim = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    for rate in (2, 8):
        real = [x for x in reqs if x["rate"] == rate]
        virt = [x for x in sim.requests if x["rate"] == rate]
        assert [x["output_ids"] for x in sorted(real, key=lambda x: x["id"])] == \
            [x["output_ids"] for x in sorted(virt, key=lambda x: x["id"])]
        host = host_gap(steps, rate)
        for f, extra in ((lambda xs: np.mean([x["ttft"] for x in xs]), host_ttft(summary)),
                         (lambda xs: np.median([g for x in xs for g in x["itl"]]), host)):
            a, b = f(real), f(virt) + extra
            assert abs(a - b) / b < 0.10, (rate, a, b, host)
