"""A trace workload through a run: a malformed trace stops `pdlab run` before anything starts; a simulated
run reports the trace's own reuse beside the prefix-hit rate its engines reached."""

import os

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.recipe import parse_recipe
from pdlab.sim.experiment import simulate_recipe
from pdlab.traces.report import describe
from pdlab.workload import build_workload

DATA = os.path.join(os.path.dirname(__file__), "data")

RECIPE = {
    "name": "trace-sim", "model": {"preset": "cpu-demo", "timing": "cpu-demo-2core"},
    "engine": {"block_size": 16, "kv_blocks": "auto", "token_budget": 2048, "prefix_caching": True},
    "workload": {"trace": {"format": "mooncake", "path": os.path.join(DATA, "trace-mooncake.jsonl"),
                           "length_scale": 0.125, "limit": 24}},
    "rates": ["trace"], "warmup": 1, "slo": {"ttft_ms": 2000, "itl_ms": 100},
    "variants": {"unified": {"deployment": {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}},
                 "disagg": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                           "mode": "push"}}},
}


def test_a_simulated_replay_reports_the_traces_reuse_beside_the_measured_hit_rate():
    r = parse_recipe(RECIPE)
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    s = res.summary()
    t = s["trace"]
    assert t["format"] == "mooncake" and t["requests"] == 24 and t["block_size"] == 64
    assert t["nominal_rate"] == pytest.approx(r.rates[0])  # rates: [trace] is its own pace
    ratio = t["reuse_ratio"]
    assert 0 < ratio < 1
    for v in ("unified", "disagg"):
        got = t["variants"][v]
        assert got["rates"][0]["of_nominal"] == pytest.approx(1.0) and got["rates"][0]["requests"] == 24
        assert 0 < got["prefix_hit_rate"] <= ratio  # the engine cannot beat one unbounded cache
    # one prefill worker holds every prompt's blocks: it reaches nearly the trace's own ratio
    assert t["variants"]["disagg"]["prefix_hit_rate"] > 0.8 * ratio
    # compare's header says it in one line: the trace's reuse, then each variant's measured hits
    line = describe(t)
    hits = [f"{v} {100 * t['variants'][v]['prefix_hit_rate']:.0f}%" for v in ("unified", "disagg")]
    assert line.startswith("trace mooncake ") and ": 24 requests" in line and "length_scale 0.125" in line
    assert f"prefix reuse {100 * ratio:.0f}% in the trace, prefix hits measured: {', '.join(hits)}" in line


def test_a_trace_without_prefix_information_says_so_and_counts_what_it_dropped_and_clipped():
    t = {"format": "burstgpt", "path": "b.csv", "requests": 10, "span_s": 60.0, "nominal_rate": 0.1667,
         "time_scale": 1.0, "length_scale": 1.0, "dropped": {"failed": 2, "zero_output": 1}, "prefix_info": False,
         "reuse_ratio": None, "variants": {"u": {"clipped": {"context": 4096, "input": 3, "output": 0},
                                                  "prefix_hit_rate": 0.0}}}
    assert describe(t) == ("trace burstgpt b.csv: 10 requests over 60 s, nominal 0.167 req/s, 3 rows dropped; "
                           "no prefix information in this format; clipped to the context: u 3 input")


def test_pdlab_run_stops_on_a_malformed_trace_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 100, "output_length": 2, "hash_ids": [1]}\n'
                   '{"timestamp": 0, "input_length": -4, "output_length": 2, "hash_ids": [1]}\n')
    raw = {**RECIPE, "rates": [1], "workload": {"trace": {"format": "mooncake", "path": str(bad)}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    p = pdlab_here("run", str(tmp_path / "r.yaml"), "--out", str(out), "--simulate")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"pdlab run: error: {bad}:2: negative input_length (-4)"]
    assert not out.exists()
