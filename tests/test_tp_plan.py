"""Tensor parallelism from the model's own plan (transformers' `base_model_tp_plan`): separate projections
(Llama, Qwen2 with q/k/v biases), fused ones (Phi-3's qkv_proj and gate_up_proj) and per-head layouts all
shard; TP 2 and P/D 2->1 and 1->2 give the tokens of one unsharded engine and of transformers' generate, on
models built at test time; a model without a plan, or with one pdlab cannot honour, is a recipe error naming
its model type before anything starts."""

import os

import pytest
import torch
import yaml

from cli_helpers import pdlab as pdlab_here
import engine_helpers as eh
from pdlab.engine.tp_plan import Piece, TpPlanError, check_plan, layer_plan
from test_cluster import Cluster, _drain, _no_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
ENGINE = {"block_size": 8, "kv_blocks": 48, "token_budget": 24, "max_running": 16, "chunked_prefill": True,
          "prefix_caching": True}


def config(arch: str, **kw):
    import transformers

    return getattr(transformers, f"{arch}Config")(**{**DIMS, **kw})


def meta_model(arch: str, **kw):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config(arch, **kw))


def test_the_plan_names_each_projection_and_how_its_features_split():
    assert layer_plan(meta_model("Llama")) == [
        Piece("self_attn.q_proj", False, ("q",)), Piece("self_attn.k_proj", False, ("k",)),
        Piece("self_attn.v_proj", False, ("v",)), Piece("self_attn.o_proj", True, ("q",)),
        Piece("mlp.gate_proj", False, ("mlp",)), Piece("mlp.up_proj", False, ("mlp",)),
        Piece("mlp.down_proj", True, ("mlp",))]
    assert layer_plan(meta_model("Phi3")) == [  # fused: each part split on its own, nothing gathered
        Piece("self_attn.qkv_proj", False, ("q", "k", "v")), Piece("self_attn.o_proj", True, ("q",)),
        Piece("mlp.gate_up_proj", False, ("mlp", "mlp")), Piece("mlp.down_proj", True, ("mlp",))]
    qwen3 = layer_plan(meta_model("Qwen3", head_dim=16))  # per-head q/k norms: replicated, not in the pieces
    assert [p.path for p in qwen3][:3] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


@pytest.mark.parametrize("arch,kw,msg", [
    ("Olmo2", {}, "model type olmo2: layers.*.self_attn.q_norm (Olmo2RMSNorm, [64]) spans every head"),
    ("StableLm", {}, "model type stablelm has no tensor-parallel plan"),
    ("Llama", {"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96}, "3 KV heads do not split"),
])
def test_what_pdlab_cannot_shard_is_refused_naming_the_model_type(arch, kw, msg):
    with pytest.raises(TpPlanError, match=msg.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        check_plan(meta_model(arch, **kw), 2)


def saved(tmp_path_factory, arch: str, **kw) -> str:
    """A model of `arch` with seeded random weights, saved as a user's model directory is."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    path = tmp_path_factory.mktemp(arch.lower())
    AutoModelForCausalLM.from_config(config(arch, **kw), attn_implementation="sdpa").save_pretrained(path)
    return str(path)


def test_a_tp_recipe_on_a_model_without_a_usable_plan_stops_before_anything_starts(tmp_path_factory):
    path = saved(tmp_path_factory, "Olmo2")
    recipe = tmp_path_factory.mktemp("recipe") / "tp.yaml"
    recipe.write_text(yaml.safe_dump({"name": "tp", "model": {"path": path}, "rates": [1],
                                      "workload": {"requests": 2, "input_len": {"kind": "fixed", "value": 8},
                                                   "output_len": {"kind": "fixed", "value": 2}},
                                      "slo": {"ttft_ms": 1000, "itl_ms": 100},
                                      "variants": {"tp2": {"deployment": {"unified": {"devices": ["cpu:0-1"],
                                                                                      "tp": 2}}}}}))
    out = tmp_path_factory.mktemp("out") / "run"
    p = pdlab_here("run", str(recipe), "--out", str(out))
    assert p.returncode == 2, p.stderr
    assert "variants.tp2.deployment: tp 2: model type olmo2" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() or not os.listdir(out)


ARCHS = {"phi3": ("Phi3", {}), "qwen2": ("Qwen2", {})}  # fused projections; q/k/v biases


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request, tmp_path_factory):
    arch, kw = ARCHS[request.param]
    return saved(tmp_path_factory, arch, **kw)


def _want(path: str, reqs: dict) -> dict:
    """One unsharded in-process engine's greedy tokens, checked against transformers' generate."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    want = {rid: eh.run(eh.engine(path, **ENGINE), [p], max_tokens=8)[0]["0"] for rid, p in reqs.items()}
    for rid in list(reqs)[:2]:
        assert want[rid] == eh.hf_greedy(ref, reqs[rid], 8), rid
    return want


DEPLOYMENTS = {
    "tp2": {"unified": {"devices": ["cpu:0-1"], "tp": 2}},
    "2to1": {"prefill": {"devices": ["cpu:0-1"], "tp": 2}, "decode": {"devices": ["cpu:1"]}, "mode": "pull",
             "share_devices": True},
    "1to2": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:0-1"], "tp": 2}, "mode": "push",
             "share_devices": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("dep", list(DEPLOYMENTS))
def test_tp_from_the_plan_matches_one_engine(model_dir, dep):
    reqs = {f"r{i}": p for i, p in enumerate(eh.prompts([5, 23, 40], seed=3))}
    want = _want(model_dir, reqs)
    c = Cluster({"path": model_dir}, ENGINE, DEPLOYMENTS[dep])
    pids = []
    try:
        c.start()
        pids = [w.pid for w in c.workers]
        for rid, p in reqs.items():
            c.submit(rid, p, {"max_tokens": 8, "ignore_eos": True})
        done, _, _ = _drain(c, list(reqs), timeout=180)
        stats = c.kv_stats()
    finally:
        c.stop()
    for rid, d in done.items():
        assert d.ok, d.error
        assert d.output_ids == want[rid], rid
    assert all(s.free_blocks == s.total_blocks for s in stats.values())
    _no_leftovers(pids, c.run_prefix)
