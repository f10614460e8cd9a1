"""A timed run end to end: a profile, unified and disaggregated (pull and push) workers that run no model,
hand-overs that take the profile's transfer time, the same tokens everywhere, and every output saying the
timing is modelled."""

import json
import os

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = {"name": "pretend-gpu", "source": "analytic", "device": "a pretend GPU", "date": "2026-11-30",
           "model": "tiny-llama", "step": {"fixed_ms": 3, "prefill_token_ms": 0.05, "decode_seq_ms": 0.2},
           "kv_bytes_per_token": 512, "kv_memory_gb": 0.01,
           "transfer": {"shm": {"gbps": 1.0, "latency_ms": 6.0}}}
DISAGG = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm"}


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("timed")
    (d / "gpu.yaml").write_text(yaml.safe_dump(PROFILE))
    recipe = {"name": "timed", "seed": 1, "warmup": 1,
              "model": {"preset": "tiny-llama", "timing": str(d / "gpu.yaml")},
              "engine": {"block_size": 8, "kv_blocks": "auto", "token_budget": 256, "max_running": 16},
              "workload": {"requests": 8, "input_len": {"kind": "fixed", "value": 40},
                           "output_len": {"kind": "fixed", "value": 6}},
              "rates": [20], "slo": {"ttft_ms": 1000, "itl_ms": 500},
              "variants": {"unified": {"deployment": {"unified": {"devices": ["cpu:0"]}}},
                           "pull": {"deployment": dict(DISAGG, mode="pull")},
                           "push": {"deployment": dict(DISAGG, mode="push")}}}
    (d / "timed.yaml").write_text(yaml.safe_dump(recipe))
    out = str(d / "run")
    r = pdlab_here("run", str(d / "timed.yaml"), "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, r.stdout


@pytest.mark.slow
def test_timed_workers_agree_and_hand_overs_take_the_modelled_time(timed_run):
    out, stdout = timed_run
    reqs = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl")) if '"warmup"' not in x]
    by = {}
    for r in reqs:
        assert r["ok"], r["error"]
        by.setdefault(r["id"], {})[r["variant"]] = r["output_ids"]
    assert len(by) == 8 and all(v["unified"] == v["pull"] == v["push"] for v in by.values())
    xfers = [json.loads(x) for x in open(os.path.join(out, "transfers.jsonl")) if '"warmup"' not in x]
    pulls = [x for x in xfers if x["mode"] == "pull"]
    assert len(pulls) == 8
    for x in pulls:
        # 5 blocks of 8 tokens, tiny-llama's 512 bytes a token: the model's bytes, not the stand-in pool's
        assert x["bytes"] == 5 * 8 * 512
        assert x["end"] - x["start"] >= 0.006  # the profile's 6 ms latency
    pushes = [x for x in xfers if x["mode"] == "push"]
    assert len(pushes) == 8 and all(x["bytes"] == 5 * 8 * 512 for x in pushes)


@pytest.mark.slow
def test_a_timed_run_says_it_is_modelled(timed_run):
    out, stdout = timed_run
    summary = json.load(open(os.path.join(out, "summary.json")))
    want = "modelled timing: profile pretend-gpu (analytic, a pretend GPU, 2026-11-30)"
    assert summary["modelled"] == {"unified": want, "pull": want, "push": want}
    from test_sim import modelled_line

    assert all(modelled_line(stdout, v).startswith(want) for v in ("unified", "pull", "push"))
    steps = [json.loads(x) for x in open(os.path.join(out, "steps.jsonl"))]
    decode = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_seqs"] == 1]
    assert decode and min(s["end"] - s["start"] for s in decode) >= 0.0032  # 3 + 0.2 ms
