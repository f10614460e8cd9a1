"""Rates relative to the machine: `0.5x` is half of 1 / the TTFT of one request alone (the calibration), so a
recipe lands at the load it means on any box; every variant gets the same absolute rates, the summary records
what each resolved to. The calibration is checked against later measurements on the same kind of worker."""

import json
import os

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.measure.box import calibration_check
from pdlab.recipe import RecipeError, parse_recipe
from pdlab.recipe.recipe import relative_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {"fixed_ms": 2.0, "prefill_token_ms": 1.0, "decode_seq_ms": 1.0}
RAW = {"name": "rel", "seed": 1, "model": {"preset": "tiny-llama", "timing": TIMING},
       "engine": {"block_size": 8, "kv_blocks": 128},
       "workload": {"requests": 6, "input_len": {"kind": "fixed", "value": 40}, "output_len": {"kind": "fixed", "value": 4}},
       "rates": ["0.25x", "0.5x", ".inf"], "slo": {"ttft_ms": 1000, "itl_ms": 100},
       "variants": {"unified": {"deployment": {"unified": {"devices": ["cpu:0"]}}},
                    "pd": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}}}}}


def test_a_relative_rate_is_a_multiple_of_one_request_alone():
    r = parse_recipe(RAW)
    assert r.rates == ["0.25x", "0.5x", float("inf")] and r.relative_rates == ["0.25x", "0.5x"]
    resolved = r.with_rates_for(alone_ttft_ms=200.0)  # 1 / 0.2 s = 5 req/s
    assert resolved.rates == [1.25, 2.5, float("inf")] and not resolved.relative_rates
    assert all(v.rates == (1.25, 2.5, float("inf")) for v in resolved.variants.values())
    assert relative_rate("1.5X") == 1.5 and relative_rate("2") is None and relative_rate("x") is None


@pytest.mark.parametrize("rates,msg", [(["0x"], "expected a rate > 0"), (["-1x"], "expected a rate > 0"),
                                       (["fastx"], "expected a rate > 0"), (["0.5x", "0.50x"], "listed twice")])
def test_bad_relative_rates_are_named(rates, msg):
    with pytest.raises(RecipeError, match=msg):
        parse_recipe({**RAW, "rates": rates})


def test_simulated_runs_resolve_them_against_the_models_request_alone(tmp_path):
    recipe = tmp_path / "rel.yaml"
    recipe.write_text(yaml.safe_dump(RAW))
    out = tmp_path / "run"
    p = pdlab_here("run", str(recipe), "--out", str(out), "--simulate")
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.load(open(out / "summary.json"))
    alone = s["alone"]["ttft_ms"]
    assert s["rates_resolved"] == pytest.approx({"0.25x": 250.0 / alone, "0.5x": 500.0 / alone})
    for v in ("unified", "pd"):
        measured = sorted(float(t) for t in s["variants"][v]["rates"] if t != "inf")
        assert measured == pytest.approx(sorted(s["rates_resolved"].values()), rel=1e-4)  # tags are rounded


@pytest.mark.slow
def test_a_run_resolves_them_after_the_calibration(tmp_path):
    recipe = tmp_path / "rel.yaml"
    recipe.write_text(yaml.safe_dump({**RAW, "rates": ["0.5x"], "variants": {"unified": RAW["variants"]["unified"]}}))
    out = tmp_path / "run"
    p = pdlab_here("run", str(recipe), "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.load(open(out / "summary.json"))
    rate = 500.0 / s["alone"]["ttft_ms"]
    assert s["rates_resolved"] == pytest.approx({"0.5x": rate})
    assert [float(t) for t in s["variants"]["unified"]["rates"]] == pytest.approx([rate], rel=1e-4)
    reqs = [json.loads(x) for x in open(out / "requests.jsonl")]
    assert [float(r["rate"]) for r in reqs if not r.get("warmup")] == pytest.approx([rate] * 6)


def test_the_calibration_is_checked_against_the_same_kind_of_worker():
    cal = {"ttft_ms": 100.0, "itl_ms": 5.0}
    by = {"unified": {"ttft_ms": 120.0, "itl_ms": 5.5}, "unified-slow": {"ttft_ms": 180.0, "itl_ms": 5.0},
          "pd": {"ttft_ms": 400.0, "itl_ms": 5.0}}
    lines = calibration_check(cal, by, ["unified", "unified-slow"])  # pd: a hand-over explains its TTFT
    assert len(lines) == 1 and "unified-slow measured one request alone at 180.0 ms TTFT, 1.8x slower" in lines[0]
    assert calibration_check(cal, by, ["unified"]) == [] and calibration_check(None, by, ["unified"]) == []
