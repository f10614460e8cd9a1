import glob
import math
import os

import pytest
import yaml

from pdlab.engine.config import EngineConfig
from pdlab.recipe import SLO, PlannedWorker, RecipeError, dump_recipe, load_recipe, parse_recipe

BASE = {
    "name": "t",
    "model": {"preset": "tiny-llama"},
    "workload": {"requests": 4, "input_len": {"kind": "fixed", "value": 32},
                 "output_len": {"kind": "fixed", "value": 4}},
    "rates": [1, 2, ".inf"],
    "variants": {
        "unified": {"deployment": {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}},
        "disagg": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                  "mode": "push"}},
    },
}


def err(raw, *sets, variants=None) -> str:
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw, sets=list(sets), variants=variants)
    msg = str(e.value)
    assert "\n" not in msg, "errors are one line"
    return msg


def test_defaults_are_filled_and_variants_resolve():
    r = parse_recipe(BASE)
    assert r.variant_names == ["unified", "disagg"]
    assert r.rates == [1.0, 2.0, math.inf]
    u = r.resolved("unified")
    assert u.warmup == 2 and u.seed == 0
    assert u.engine.token_budget == 2048 and u.engine.kv_blocks == "auto"
    assert u.slo == SLO(ttft_ms=1000.0, itl_ms=50.0, itl_stat="p99", attainment=0.9)
    assert u.model.dtype == "float32"  # cpu default
    assert u.deployment.kind == "unified"
    assert u.deployment.workers == (
        PlannedWorker("unified0", "unified", ("cpu:0",)),
        PlannedWorker("unified1", "unified", ("cpu:1",)),
    )
    d = r.resolved("disagg")
    assert d.deployment.kind == "disagg"
    assert d.deployment.transport == "shm"  # cpu default
    assert d.deployment.mode == "push" and d.deployment.first_token == "decode"
    assert [w.role for w in d.deployment.workers] == ["prefill", "decode"]


def test_devices_split_evenly_among_replicas():
    raw = dict(BASE, variants={"u": {"deployment": {"unified": {"replicas": 2, "devices": ["cuda:0-7"], "tp": 4}}}})
    w = parse_recipe(raw).resolved("u").deployment.workers
    assert w[0].devices == tuple(f"cuda:{i}" for i in range(4))
    assert w[1].devices == tuple(f"cuda:{i}" for i in range(4, 8))
    assert parse_recipe(raw).resolved("u").model.dtype == "bfloat16"  # cuda default
    d = parse_recipe(raw, sets=["variants.u.deployment={prefill: {devices: [cuda:0]}, decode: {devices: [cuda:4]}}"])
    assert d.resolved("u").deployment.transport == "cuda-ipc"  # cuda default


def test_variant_engine_overrides_deep_merge_over_base():
    raw = dict(BASE, engine={"token_budget": 512, "long_prefill_token_threshold": 128})
    raw["variants"] = dict(BASE["variants"], chunked={
        "engine": {"chunked_prefill": True},
        "deployment": {"unified": {"devices": ["cpu:0"]}}})
    e = parse_recipe(raw).resolved("chunked").engine
    assert (e.token_budget, e.long_prefill_token_threshold, e.chunked_prefill) == (512, 128, True)
    assert isinstance(e, EngineConfig)


def test_base_deployment_is_used_and_a_variant_shape_replaces_it():
    raw = dict(BASE, deployment={"unified": {"devices": ["cpu:0"]}})
    raw["variants"] = {"plain": {}, "pd": BASE["variants"]["disagg"]}
    r = parse_recipe(raw)
    assert r.resolved("plain").deployment.kind == "unified"
    assert r.resolved("pd").deployment.kind == "disagg"


def test_no_variants_means_one_default_variant():
    raw = {k: v for k, v in BASE.items() if k != "variants"}
    raw["deployment"] = {"unified": {"devices": "cpu:0"}}
    assert parse_recipe(raw).variant_names == ["default"]


def test_set_overrides_parse_yaml_values():
    r = parse_recipe(BASE, sets=["engine.chunked_prefill=true", "engine.long_prefill_token_threshold=256", "rates=[1, inf]",
                                 "variants.disagg.deployment.mode=pull", "slo.itl_stat=max"])
    d = r.resolved("disagg")
    assert d.engine.chunked_prefill is True and d.engine.long_prefill_token_threshold == 256
    assert d.rates == (1.0, math.inf) and d.deployment.mode == "pull" and d.slo.itl_stat == "max"


def test_variants_selection():
    assert parse_recipe(BASE, variants="disagg").variant_names == ["disagg"]
    assert "unknown variant 'nope'" in err(BASE, variants="unified,nope")


@pytest.mark.parametrize("sets, needle", [
    (["engine.tokn_budget=5"], "engine.tokn_budget: unknown key (did you mean 'token_budget'?)"),
    (["bogus=1"], "bogus: unknown key"),
    (["engine.block_size=abc"], "engine.block_size: expected an integer >= 1"),
    (["engine.chunked_prefill=1"], "engine.chunked_prefill: expected true or false"),
    (["rates=[1, -2]"], "rates[1]: expected a rate > 0"),
    (["rates=3"], "rates: expected auto (goodput found by search) or a list"),
    (["rates=sometimes"], "rates: expected auto"),
    (["repeats=0"], "repeats: expected an integer >= 1"),
    (["search.max_trials=0"], "search.max_trials: expected an integer >= 1"),
    (["search.rel_tol=1.5"], "search.rel_tol: expected a fraction"),
    (["slo.ttft=fast"], "slo.ttft: expected a multiple such as 5x"),
    (["slo.ttft=5x", "slo.ttft_ms=100"], "slo.ttft: give ttft_ms (absolute) or ttft (relative, e.g. 5x), not both"),
    (["workload.arrival={kind: poisson, rescale: 1}"], "workload.arrival.rescale: expected true or false"),
    (["rates=[1, 1]"], "rates[1]: rate 1 is listed twice"),
    (["engine.chunked_prefill=true", "engine.long_prefill_token_threshold=4096"], "engine.long_prefill_token_threshold (4096) must be <= engine.token_budget"),
    (["slo.itl_stat=p95"], "slo.itl_stat: expected one of mean, p50, p90, p99, max"),
    (["slo.attainment=1.5"], "slo.attainment: expected a fraction"),
    (["variants.disagg.deployment.transport=rdma"], "deployment.transport: expected one of shm, cuda-ipc, host, nixl"),
    (["variants.disagg.deployment.mode=write"], "deployment.mode: expected pull or push"),
    (["variants.disagg.deployment.decode.devices=[cpu:0]"], "overlap on cpu:0"),
    (["variants.disagg.deployment.decode.replicas=0"], "decode.replicas: expected an integer >= 1"),
    (["variants.disagg.deployment.transport=cuda-ipc"], "cuda-ipc does not move cpu pools"),
    (["variants.unified.deployment.unified.devices=[gpu:0]"], "bad device spec 'gpu:0'"),
    (["variants.unified.deployment.unified.devices=[cpu:0-2]"], "cannot be split evenly"),
    (["variants.unified.workload={requests: 3}"], "variants.unified.workload: a variant may override only"),
    (["workload.arrival={kind: weibull}"], "workload.arrival: expected {kind: poisson|gamma|constant|burst}"),
    (["workload.arrival={kind: gamma, burstiness: 0}"], "workload.arrival.burstiness: expected a number > 0"),
    (["workload.input_len={kind: uniform, min: 9, max: 3}"], "min (9) must be <= max (3)"),
    (["workload.input_len={kind: fixed, min: 3}"], "workload.input_len.min: not used by kind fixed"),
    (["workload.shared_prefix={groups: 2, len: 64}"], "shared_prefix.len (64) must be < the shortest input_len (32)"),
    (["workload.shared_prefix={groups: 2, len: 8, share: 2}"], "shared_prefix.share: expected a fraction"),
    (["workload.dataset=/no/such.jsonl", "workload.input_len={kind: dataset}"], "dataset: file not found"),
    (["workload.output_len={kind: dataset}"], "needs workload.dataset"),
    (["workload.input_len={kind: mixture, parts: [{weight: -1, kind: fixed, value: 8}]}"],
     "workload.input_len.parts[0].weight: expected a number > 0"),
    (["workload.input_len={kind: mixture, parts: [{kind: dataset}]}"], "workload.input_len.parts[0]: expected"),
    (["variants.disagg.deployment.on_transfer_failure=retry"], "deployment.on_transfer_failure: expected one of "
                                                              "fail, recompute"),
    (["variants.disagg.deployment.route={remote_prefill_min_tokens: -5}"],
     "deployment.route.remote_prefill_min_tokens: expected an integer >= 0"),
    (["variants.disagg.deployment.route={min_tokens: 5}"], "deployment.route.min_tokens: unknown key"),
    (["warmup=-1"], "warmup: expected an integer >= 0"),
    (["engine.kv_blocks=lots"], "engine.kv_blocks: expected auto or an integer >= 1"),
    (["enginechunk=1"], "enginechunk: unknown key"),
    (["engine.long_prefill_token_threshold"], "expected KEY=VALUE"),
])
def test_bad_recipes_get_one_clear_message(sets, needle):
    assert needle in err(BASE, *sets)


def test_overlap_allowed_when_declared_shared():
    r = parse_recipe(BASE, sets=["variants.disagg.deployment.decode.devices=[cpu:0]",
                                 "variants.disagg.deployment.share_devices=true"])
    assert [w.devices for w in r.resolved("disagg").deployment.workers] == [("cpu:0",), ("cpu:0",)]


def test_shared_devices_place_replicas_round_robin():
    """More replicas than devices: an error unless sharing is declared, then replicas take the devices in turn
    (two prefill workers on core 0 beside a decode worker on core 1, as test_cluster's 2P1D runs)."""
    dep = "variants.disagg.deployment.prefill={replicas: 2, devices: [cpu:0]}"
    assert "1 devices cannot be split evenly among 2 replicas" in err(BASE, dep)
    r = parse_recipe(BASE, sets=[dep, "variants.disagg.deployment.share_devices=true"])
    d = r.resolved("disagg").deployment
    assert [(w.name, w.devices) for w in d.workers] == [
        ("prefill0", ("cpu:0",)), ("prefill1", ("cpu:0",)), ("decode0", ("cpu:1",))]
    assert d.prefill.devices == ("cpu:0", "cpu:0")  # one spec per replica once resolved


def test_recipe_yaml_records_the_deployment_kind():
    out = parse_recipe(BASE).to_dict()
    assert out["variants"]["unified"]["deployment"]["kind"] == "unified"
    assert out["variants"]["disagg"]["deployment"]["kind"] == "disagg"
    assert "kind: unified does not match" in err(BASE, "variants.disagg.deployment.kind=unified")


def test_disagg_needs_both_roles():
    raw = dict(BASE, variants={"p": {"deployment": {"prefill": {"devices": ["cpu:0"]}}}})
    assert "deployment.decode: missing" in err(raw)


def test_missing_deployment():
    raw = dict(BASE, variants={"x": {}})
    assert "variants.x.deployment: missing" in err(raw)


def test_round_trip_through_recipe_yaml(tmp_path):
    r = parse_recipe(BASE, sets=["engine.long_prefill_token_threshold=64"])
    p = tmp_path / "recipe.yaml"
    p.write_text(dump_recipe(r))
    assert ".inf" in p.read_text()
    r2 = load_recipe(str(p))
    for v in r.variant_names:
        assert r2.resolved(v) == r.resolved(v)
    assert r2.to_dict() == r.to_dict()


def test_load_errors(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("rates: [1, 2\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(bad))


def test_name_defaults_to_file_stem(tmp_path):
    raw = {k: v for k, v in BASE.items() if k != "name"}
    p = tmp_path / "my-recipe.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert load_recipe(str(p)).name == "my-recipe"


def test_unknown_preset_gets_a_suggestion():
    pytest.importorskip("pdlab.engine.model", exc_type=ImportError)
    assert "did you mean 'tiny-llama'" in err(BASE, "model.preset=tiny-lama")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(f"{ROOT}/recipes/*.yaml")) + [f"{ROOT}/tests/data/tiny-recipe.yaml"])
def test_shipped_recipes_validate(path):
    from pdlab.recipe.nixl import nixl_module

    if "transport: nixl" in open(path).read() and nixl_module() is None:
        pytest.skip("asks for transport: nixl, which needs the nixl extra (pip install -e '.[nixl]')")
    r = load_recipe(path)
    assert r.variant_names
    for v in r.variant_names:
        r.resolved(v)


def test_a_relative_slo_round_trips_through_recipe_yaml(tmp_path):
    r = parse_recipe(BASE, sets=["slo={ttft: 10x, itl: 2.5x, itl_stat: max}"])
    assert r.slo.ttft == 10.0 and r.slo.itl == 2.5 and r.slo.ttft_ms is None
    p = tmp_path / "recipe.yaml"
    p.write_text(dump_recipe(r))
    assert "10x" in p.read_text() and "2.5x" in p.read_text()
    assert load_recipe(str(p)).slo == r.slo


def test_a_stand_in_only_preset_needs_a_timing():
    assert "qwen3-235b-a22b has a model's dimensions only" in err(BASE, "model.preset=qwen3-235b-a22b")
    r = parse_recipe(BASE, sets=["model={preset: qwen3-235b-a22b, timing: mi300x-qwen3-235b-fp8-tp4-analytic}"])
    assert r.resolved("unified").model.modelled
