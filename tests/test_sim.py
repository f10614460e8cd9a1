"""The virtual-time simulator: the real engine on a virtual clock reproduces queueing theory, places and
hands over like the router, and writes a run's records (how fast it runs: benchmarks/bench_sim.py)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.recipe import parse_recipe
from pdlab.sim.experiment import simulate_recipe
from pdlab.sim.simulator import Simulator
from pdlab.workload import build_requests, build_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILL = {"fixed_ms": 2, "prefill_token_ms": 2, "decode_seq_ms": 4}  # a 40-token prompt: 82 ms


def recipe(deployments, **over):
    raw = {"model": {"preset": "tiny-llama", "timing": PREFILL},
           "engine": {"block_size": 8, "kv_blocks": 256, "token_budget": 256, "max_running": 16},
           "workload": {"requests": 50, "input_len": {"kind": "fixed", "value": 40},
                        "output_len": {"kind": "fixed", "value": 8}},
           "rates": [2], "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "variants": {k: {"deployment": d} for k, d in deployments.items()}}
    raw.update(over)
    return parse_recipe(raw)


UNIFIED = {"unified": {"devices": ["cpu:0"]}}
PULL = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"}
PUSH = dict(PULL, mode="push")


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.8])
def test_a_single_prefill_server_is_md1(rho):
    """One unified worker, one prompt per step, one output token: an M/D/1 queue, W = D + rho D / 2(1 - rho)."""
    r = recipe({"u": UNIFIED}, engine={"block_size": 8, "kv_blocks": 256, "token_budget": 40, "max_running": 16},
               workload={"requests": 4000, "input_len": {"kind": "fixed", "value": 40},
                         "output_len": {"kind": "fixed", "value": 1}})
    v = r.resolved("u")
    d = 0.082
    rate = rho / d
    reqs = build_requests(v.workload, rate, seed=1, vocab_size=512)
    recs, steps, _ = Simulator(v, v.slo).run(reqs, rate)
    measured = float(np.mean([x["ttft"] for x in recs]))
    predicted = d + rho * d / (2 * (1 - rho))
    assert abs(measured - predicted) / predicted < 0.05, (rho, measured, predicted)
    assert all(abs(s["end"] - s["start"] - d) < 1e-9 for s in steps)  # every step takes exactly its model


def test_disaggregated_hands_over_and_matches_unified_tokens():
    timing = dict(PREFILL)
    r = recipe({"u": UNIFIED, "pull": PULL, "push": PUSH},
               model={"preset": "tiny-llama", "timing": {"name": "t", "step": timing, "kv_bytes_per_token": 512,
                                                          "transfer": {"shm": {"gbps": 0.001, "latency_ms": 5}}}})
    out = {}
    for name in r.variant_names:
        v = r.resolved(name)
        reqs = build_requests(v.workload, 2.0, seed=0, vocab_size=512)
        recs, steps, xfers = Simulator(v, v.slo).run(reqs, 2.0)
        out[name] = ({x["id"]: x["output_ids"] for x in recs}, recs, xfers)
    assert out["u"][0] == out["pull"][0] == out["push"][0]
    assert all(len(v) == 8 for v in out["u"][0].values())
    # pull: 5 blocks of 8 tokens x 512 bytes at 1 MB/s + 5 ms = 25.5 ms after prefill, all exposed in TTFT
    for x in out["pull"][2]:
        assert x["bytes"] == 20480 and x["end"] - x["start"] == pytest.approx(0.005 + 0.02048)
    pull = {x["id"]: x for x in out["pull"][1]}
    push = {x["id"]: x for x in out["push"][1]}
    # push overlaps the copy with the 82 ms prefill (2 layers): less of it reaches TTFT
    assert np.mean([push[i]["ttft"] for i in push]) < np.mean([pull[i]["ttft"] for i in pull])
    for x in out["pull"][1]:
        ph = x["phases"]
        assert ph["queued"] <= ph["prefill_start"] <= ph["prefill_end"] <= ph["transfer_start"]
        assert ph["transfer_end"] == pytest.approx(ph["admitted"]) and x["decode_worker"] == "decode0"


GPU_PULL = {"prefill": {"devices": ["cuda:0"]}, "decode": {"devices": ["cuda:1"]}, "mode": "pull"}
NIXL_PULL = dict(PULL, transport="nixl")
COPIES = {t: {"gbps": 1, "latency_ms": 5} for t in ("shm", "cuda-ipc", "nixl")}


@pytest.mark.parametrize("dep", [GPU_PULL, NIXL_PULL, PUSH], ids=["gpu-pull", "nixl-pull", "push"])
def test_a_decode_worker_admits_between_its_steps(dep):
    """A decode worker reads landings and messages between steps: a request whose KV lands mid-step is admitted,
    and its first token sent, when that step ends; its second token comes from a step that starts after
    that, not from what was left of the one in progress. (A copy beside the steps: a GPU's side stream, NIXL,
    a push written by the prefill worker.)"""
    r = recipe({"pd": dep}, workload={"requests": 60, "input_len": {"kind": "fixed", "value": 40},
                                      "output_len": {"kind": "fixed", "value": 32}}, rates=[10],
               model={"preset": "tiny-llama", "timing": {"name": "t", "step": PREFILL, "kv_bytes_per_token": 512,
                                                          "transfer": COPIES}})
    v = r.resolved("pd")
    recs, steps, _ = Simulator(v, v.slo).run(build_requests(v.workload, 10.0, seed=0, vocab_size=512), 10.0)
    spans = [(s["start"], s["end"]) for s in steps if s["worker"] == "decode0"]
    mid_step = 0
    for x in recs:
        first, ph = x["token_times"][0], x["phases"]
        assert not any(a < first < b for a, b in spans), x["id"]
        assert ph["admitted"] == first >= ph["transfer_end"]
        mid_step += ph["admitted"] > ph["transfer_end"]
        assert x["token_times"][1] in {b for a, b in spans if a >= first}  # a step that started after it
    assert mid_step > 5  # the decode worker was stepping when most of them landed


def test_a_cpu_decode_worker_pulling_over_shm_copies_between_its_steps():
    """A CPU decode worker's pull over shm copies on its own core: the copy starts once its step in progress is
    over, and its next step starts only after the KV landed and the request was admitted (with admit_ms in
    all; the copy's own time counts in it, as the gaps it was read from held the copy), so that step already
    decodes the request. Where the copy takes longer than admit_ms, the gap is the copy."""
    for copy_ms, admit_ms in ((5.0, 1.0), (0.5, 3.0)):
        r = recipe({"pd": PULL}, workload={"requests": 60, "input_len": {"kind": "fixed", "value": 40},
                                           "output_len": {"kind": "fixed", "value": 8}}, rates=[10],
                   model={"preset": "tiny-llama",
                          "timing": {"name": "t", "step": PREFILL, "kv_bytes_per_token": 512,
                                     "host": {"admit_ms": admit_ms},
                                     "transfer": {"shm": {"gbps": 1000, "latency_ms": copy_ms}}}})
        v = r.resolved("pd")
        recs, steps, _ = Simulator(v, v.slo).run(build_requests(v.workload, 10.0, seed=0, vocab_size=512), 10.0)
        spans = sorted((s["start"], s["end"]) for s in steps if s["worker"] == "decode0")
        alone = 0
        for x in recs:
            ph = x["phases"]
            assert not any(ph["transfer_start"] < b and a < ph["admitted"] for a, b in spans), x["id"]
            assert ph["admitted"] == pytest.approx(ph["transfer_end"]) == pytest.approx(x["token_times"][0])
            after = min(a for a, b in spans if a >= ph["admitted"])
            assert after - ph["transfer_start"] >= max(copy_ms, admit_ms) / 1e3 - 1e-9
            since = max((b for a, b in spans if b <= ph["transfer_start"]), default=0.0)  # the gap it copied in
            if sum(since <= y["phases"]["transfer_start"] < after for y in recs) == 1:  # the gap's only pull
                copy = ph["transfer_end"] - ph["transfer_start"]
                assert after - ph["transfer_start"] == pytest.approx(max(copy, admit_ms / 1e3))
                alone += 1
            assert x["token_times"][1] == min(b for a, b in spans if a >= ph["admitted"])  # the next step decodes it
        assert max(s["running"] for s in steps if s["worker"] == "decode0") > 1  # admitted beside others' decodes
        assert alone > 10


def test_the_simulators_tokens_come_from_the_kv_it_hands_over(monkeypatch):
    """The simulator copies a request's blocks between its engines' pools when a hand-over lands, and the
    decode engine samples from what it holds (pdlab.engine.timed): without the copy, tokens change."""
    r = recipe({"pull": PULL, "push": PUSH}, workload={"requests": 6, "input_len": {"kind": "fixed", "value": 40},
                                                      "output_len": {"kind": "fixed", "value": 4}})
    reqs = build_requests(r.resolved("pull").workload, 2.0, seed=0, vocab_size=512)

    def tokens(name):
        v = r.resolved(name)
        return {x["id"]: x["output_ids"] for x in Simulator(v, v.slo).run(reqs, 2.0)[0]}

    right = {n: tokens(n) for n in ("pull", "push")}
    assert right["pull"] == right["push"]
    monkeypatch.setattr("pdlab.sim.simulator.copy_blocks", lambda *a, **k: 0)
    for name in ("pull", "push"):
        wrong = tokens(name)
        assert all(wrong[i][0] == right[name][i][0] and wrong[i][1:] != right[name][i][1:] for i in wrong)


def test_a_recipe_simulates_with_search_repeats_and_a_relative_slo():
    r = recipe({"u": UNIFIED, "push": PUSH}, rates="auto", repeats=2, search={"max_trials": 4},
               slo={"ttft": "5x", "itl": "5x", "itl_stat": "max"})
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    assert res.slo.ttft_ms == pytest.approx(5 * res.facts["alone"]["ttft_ms"])
    s = res.summary()
    for name in ("u", "push"):
        g = s["variants"][name]["goodput"]
        assert g["n"] == 2 and g["mean"] > 0 and s["variants"][name]["mode"] == "search"
        assert s["modelled"][name].startswith("simulated in virtual time; modelled timing: inline step model")


def test_push_at_saturation_with_a_small_decode_pool_completes():
    """Push reserves decode blocks before prefill. With a small pool this used to deadlock: reservations took
    the blocks running decodes needed to grow, and admitted requests waited behind a preempted one that
    needed more blocks than were free. Reservations now leave a block per held sequence, and admitted
    requests run past a blocked head of the queue: every request completes (checked here in virtual time;
    the engine is the same in a run)."""
    r = recipe({"push": PUSH}, engine={"block_size": 8, "kv_blocks": 64, "token_budget": 256, "max_running": 16},
               workload={"requests": 100, "input_len": {"kind": "uniform", "min": 20, "max": 60},
                         "output_len": {"kind": "fixed", "value": 32}})
    v = r.resolved("push")
    recs, _, _ = Simulator(v, v.slo).run(build_requests(v.workload, math.inf, seed=0, vocab_size=512), math.inf)
    assert len(recs) == 100 and all(x["ok"] for x in recs)


def test_what_cannot_progress_fails_instead_of_hanging(monkeypatch):
    """If nothing can ever run again (no event pending, no step schedulable), the simulator fails what is
    left, as a real run's timeouts would, rather than loop."""
    r = recipe({"u": UNIFIED})
    v = r.resolved("u")
    sim = Simulator(v, v.slo)
    from pdlab.engine.scheduler import ScheduledBatch

    monkeypatch.setattr(sim.workers["unified0"].engine.scheduler, "schedule", lambda: ScheduledBatch())
    recs, _, _ = sim.run(build_requests(v.workload, 2.0, seed=0, vocab_size=512), 2.0)
    assert len(recs) == 50 and all(not x["ok"] and "no KV room anywhere" in x["error"] for x in recs)


def modelled_line(stdout: str, variant: str) -> str:
    """What the MODELLED line of pdlab run's table says about `variant` ("MODELLED a, b: what ..."; a line
    the table wrapped continues on indented lines)."""
    lines: list[str] = []
    for line in stdout.splitlines():
        if line.startswith(" ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    for line in lines:
        head, _, what = line.partition(": ")
        if head.startswith("MODELLED ") and variant in head[len("MODELLED "):].split(", "):
            return what
    raise AssertionError(f"no MODELLED line names {variant}:\n{stdout}")


@pytest.mark.slow
def test_run_simulate_writes_a_run_directory(tmp_path):
    raw = {"model": {"preset": "tiny-llama", "timing": PREFILL}, "rates": [2, ".inf"],
           "engine": {"block_size": 8, "kv_blocks": 256, "token_budget": 256},
           "workload": {"requests": 20, "input_len": {"kind": "fixed", "value": 40},
                        "output_len": {"kind": "fixed", "value": 8}},
           "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "variants": {"u": {"deployment": UNIFIED}, "pull": {"deployment": PULL}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    out = str(tmp_path / "run")
    p = subprocess.run([sys.executable, "-c", "from pdlab.commands.run import main; import sys; "
                        f"sys.exit(main({str(tmp_path / 'r.yaml')!r}, [], {out!r}, None, simulate=True))"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.load(open(os.path.join(out, "summary.json")))
    assert set(s["modelled"]) == {"u", "pull"} and "simulated" in s["modelled"]["u"]
    assert modelled_line(p.stdout, "u").startswith("simulated in virtual time")
    reqs = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl"))]
    measured = [x for x in reqs if not x.get("warmup")]
    assert len(measured) == 2 * 2 * 20 and all(x["ok"] for x in reqs)
    assert len(reqs) - len(measured) == 2 * 2 * 2  # each rate's warm-up (the default 2), kept as a run keeps it
    real = {k: v for k, v in raw.items()}
    real["model"] = {"preset": "tiny-llama"}
    (tmp_path / "real.yaml").write_text(yaml.safe_dump(real))
    p = subprocess.run([sys.executable, "-c", "from pdlab.commands.run import main; import sys; "
                        f"sys.exit(main({str(tmp_path / 'real.yaml')!r}, [], {str(tmp_path / 'x')!r}, None, "
                        "simulate=True))"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "--simulate: variant pull has no model.timing; give it a profile" in p.stderr  # yaml sorts keys
    # a recipe may ask for virtual time itself (simulate: true); the CLI's --no-simulate overrides it
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(dict(raw, simulate=True)))
    p = pdlab_here("run", str(tmp_path / "sim.yaml"), "--out", str(tmp_path / "s"))
    assert p.returncode == 0 and modelled_line(p.stdout, "u").startswith("simulated in virtual time"), p.stderr
    (tmp_path / "simreal.yaml").write_text(yaml.safe_dump(dict(real, simulate=True)))
    p = pdlab_here("run", str(tmp_path / "simreal.yaml"))
    assert p.returncode == 2 and "error: simulate: true: variant pull has no model.timing" in p.stderr


@pytest.mark.slow
def test_the_mori_table_shows_the_essays_pattern_at_8_req_s():
    """recipes/mori-table.yaml, cut to 30 requests at 8 req/s: unified misses on ITL only (prefills stall
    every running request), disaggregated has no ITL miss and no prefill interruption, and pays in TTFT."""
    from pdlab.measure.slo import miss_kind

    with open(f"{ROOT}/recipes/mori-table.yaml") as f:
        raw = yaml.safe_load(f)
    raw.update(rates=[8], repeats=1, warmup=0)
    raw["workload"]["requests"] = 30
    r = parse_recipe(raw)
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    by = {n: [x for x in res.requests if x["variant"] == n and x["rate"] == 8] for n in r.variant_names}
    kinds = {n: {miss_kind(x) for x in recs} - {None} for n, recs in by.items()}
    assert kinds["unified-2xTP4"] == {"itl_only"} and kinds["unified-1xTP8"] <= {"itl_only"}
    assert kinds["disagg-read"] == kinds["disagg-write"] == set()
    ttft = {n: float(np.median([x["ttft"] for x in recs])) for n, recs in by.items()}
    assert ttft["disagg-read"] > ttft["unified-2xTP4"] and ttft["disagg-write"] > ttft["unified-2xTP4"]


def test_goodput_per_device_counts_the_modelled_devices_not_the_stand_ins():
    """Each of the MORI table's rows spans eight modelled GPUs (2 x TP4, 1 x TP8, TP4 + TP4), though its workers
    stand in on one or two CPU devices: compare divides by 8; a real run by its distinct devices."""
    from pdlab.recipe import Deployment, load_recipe
    from pdlab.report.rows import count_devices

    for name, v in load_recipe(f"{ROOT}/recipes/mori-table.yaml").variants.items():
        assert count_devices(v.deployment, v.model.timing) == 8, name
    assert count_devices(Deployment.from_raw({"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}, "d")) == 2
    assert count_devices(Deployment.from_raw({"unified": {"replicas": 2, "devices": ["cuda:0-3", "cuda:4-7"],
                                                          "tp": 4}}, "d")) == 8


@pytest.mark.parametrize("warmup", [0, 2])
def test_each_rate_warms_up_as_a_run_does(warmup):
    """pdlab.harness resets the prefix cache before each rate, then serves the warm-up requests: with as many
    warm-up requests as prefix groups, the measured requests find every prefix cached, the first one included.
    The simulation does the same, and keeps the warm-up's records marked as a run's are."""
    r = recipe({"u": UNIFIED}, rates=[1, 2], warmup=warmup,
               engine={"block_size": 8, "kv_blocks": 256, "token_budget": 256, "max_running": 16,
                       "prefix_caching": True},
               workload={"requests": 6, "input_len": {"kind": "fixed", "value": 40},
                         "output_len": {"kind": "fixed", "value": 4},
                         "shared_prefix": {"groups": 2, "len": 24}})
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    warm = [x for x in res.requests if x.get("warmup")]
    assert len(warm) == 2 * warmup  # per rate
    for rate in (1, 2):
        measured = sorted((x for x in res.requests if x["rate"] == rate and not x.get("warmup")),
                          key=lambda x: x["arrival"])
        first_of_group = {}
        for x in measured:
            first_of_group.setdefault(tuple(x["prompt_ids"][:24]), x)
        cached = [x["cached_tokens"] for x in first_of_group.values()]
        assert len(cached) == 2
        if warmup:
            assert all(c >= 16 for c in cached), cached  # the prefix's whole blocks, from the warm-up
        else:
            assert cached == [0, 0], cached  # a cold cache each rate: the rate before left nothing
