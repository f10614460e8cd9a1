"""pdlab plan: candidates for a budget, a ranking by simulated goodput, the closed-form estimate beside it,
and validation rows from real (timed) runs of the best."""

import json
import os

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.recipe import parse_recipe
from pdlab.sim.plan import candidates, closed_form, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = {"name": "small", "seed": 0, "warmup": 1,
          "model": {"preset": "tiny-llama", "timing": {"fixed_ms": 4, "prefill_token_ms": 1, "decode_seq_ms": 2}},
          "engine": {"block_size": 8, "kv_blocks": 512, "token_budget": 256, "max_running": 16},
          "workload": {"requests": 12, "input_len": {"kind": "fixed", "value": 40},
                       "output_len": {"kind": "fixed", "value": 8}},
          "rates": "auto", "search": {"max_trials": 2}, "slo": {"ttft_ms": 500, "itl_ms": 40, "itl_stat": "max"},
          "deployment": {"unified": {"devices": ["cpu:0"]}}}


def test_candidates_cover_the_budget():
    names = [c.name for c in candidates(4, ("pull", "push"))]
    assert names == ["unified-2x", "unified-4x", "1P3D-pull", "1P3D-push", "2P2D-pull", "2P2D-push",
                     "3P1D-pull", "3P1D-push"]
    assert all(c.devices == 4 for c in candidates(4) if "P" in c.name)


def test_a_budget_counts_the_devices_each_modelled_worker_spans():
    """With a TP4 profile (devices: 4) eight GPUs are two workers: 2x TP4 unified, 1xTP4 unified, or 1P1D
    (the MORI table's rows but 1xTP8, which is another profile); four GPUs cannot split into P and D."""
    cands = candidates(8, ("pull", "push"), per_worker=4)
    assert [(c.name, c.devices) for c in cands] == [("unified-1x", 4), ("unified-2x", 8), ("1P1D-pull", 8),
                                                    ("1P1D-push", 8)]
    with pytest.raises(ValueError, match="a budget of 4 devices holds 1 worker"):
        candidates(4, per_worker=4)


def test_closed_form_is_rate_matching():
    r = parse_recipe(dict(RECIPE, rates=[1], variants={
        "pd": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}}}}))
    v = r.resolved("pd")
    # prefill of 40 tokens: 4 + 40 + 0 (no attention term) = 44 ms; TTFT target 500 ms:
    # rho = 2 (0.5 - 0.044) / (1 - 0.044) = 0.954, capacity rho / 0.044 = 21.7 req/s
    # decode: the largest batch with 4 + 2 B <= 40 ms is B = 18 (40 ms): 18 / (0.040 x 8) = 56.25 req/s
    assert closed_form(v, v.slo, v.deployment) == pytest.approx(2 * (0.5 - 0.044) / (1 - 0.044) / 0.044)


def test_plan_ranks_by_simulated_goodput():
    r = parse_recipe(RECIPE)
    from pdlab.workload import build_workload

    ranked, slo = plan(r, 2, lambda rr: {n: build_workload(v) for n, v in rr.variants.items()})
    assert {x.candidate.name for x in ranked} == {"unified-1x", "unified-2x", "1P1D-push"}
    goodputs = [x.goodput["mean"] for x in ranked]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0


@pytest.mark.slow
def test_pdlab_plan_prints_a_ranking_and_validation_rows(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(RECIPE))
    p = pdlab_here("plan", str(tmp_path / "r.yaml"), "--devices", "2", "--validate", "1", "--out",
                   str(tmp_path / "plan"), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)  # the validation run's progress goes to stderr
    assert [x["candidate"] for x in out["ranking"]][0] == out["validation"][0]["candidate"]
    row = out["validation"][0]
    assert row["predicted"] == out["ranking"][0]["goodput"]["mean"]
    # how close the real processes come to the prediction is the box's business (BENCHMARKS.md records it);
    # the row is what the validation run measured and the difference
    summary = json.load(open(tmp_path / "plan" / "run" / "summary.json"))
    assert row["measured"] == summary["variants"][row["candidate"]]["goodput"]["mean"]
    want = (row["predicted"] - row["measured"]) / row["measured"] if row["measured"] else None
    assert row["relative_error"] == pytest.approx(want)
    assert out["modelled"].startswith("simulated; modelled timing: inline step model")
