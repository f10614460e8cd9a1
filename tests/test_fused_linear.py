"""Fused q/k/v and gate/up projections: the same bits as the separate ones, no second copy of the weights,
and a safe fallback when the weights are replaced or the inputs differ."""

import copy

import pytest
import torch

from pdlab.engine import load_model
from pdlab.engine.fused_linear import FusedGroup, fuse_projections


def _hidden(model, tokens=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (1, tokens), generator=g)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_fused_layers_give_the_same_bits(preset):
    plain = load_model(preset)
    fused = copy.deepcopy(plain)
    layers = len(fused.get_decoder().layers)
    assert fuse_projections(fused) == 2 * layers
    assert fuse_projections(fused) == 0  # already fused: nothing to do
    x = torch.randn(1, 40, fused.config.hidden_size)
    for a, b in zip(plain.get_decoder().layers, fused.get_decoder().layers):
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            src = a.self_attn if names[0] == "q_proj" else a.mlp
            dst = b.self_attn if names[0] == "q_proj" else b.mlp
            want = [getattr(src, n)(x) for n in names]
            got = [getattr(dst, n)(x) for n in names]
            assert all(torch.equal(w, g) for w, g in zip(want, got)), names
            group = getattr(dst, names[0]).pdlab_fused
            assert isinstance(group, FusedGroup) and group.pending is None  # nothing held after the last part
            assert all(getattr(dst, n).weight.data_ptr() >= group.weight.data_ptr() for n in names)


def test_weights_are_views_of_one_matrix():
    m = load_model("tiny-llama")
    before = sum(p.numel() for p in m.parameters())
    fuse_projections(m)
    att = m.get_decoder().layers[0].self_attn
    g = att.q_proj.pdlab_fused
    assert g.weight.numel() == sum(getattr(att, n).weight.numel() for n in ("q_proj", "k_proj", "v_proj"))
    assert att.k_proj.weight.untyped_storage().data_ptr() == g.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in m.parameters()) == before


def test_other_inputs_and_replaced_weights_fall_back_then_refuse():
    m = load_model("tiny-llama")
    fuse_projections(m)
    att = m.get_decoder().layers[0].self_attn
    x, y = torch.randn(1, 5, m.config.hidden_size), torch.randn(1, 5, m.config.hidden_size)
    q = att.q_proj(x)
    assert torch.equal(att.k_proj(y), torch.nn.functional.linear(y, att.k_proj.weight))  # not x: its own GEMM
    assert torch.equal(q, torch.nn.functional.linear(x, att.q_proj.weight))
    new = torch.nn.Parameter(att.k_proj.weight[:8].clone(), requires_grad=False)  # as sharding replaces it
    att.k_proj.weight = new
    assert not att.q_proj.pdlab_fused.intact()
    assert att.q_proj(x).shape[-1] == att.q_proj.weight.shape[0]
    assert torch.equal(att.k_proj(x), torch.nn.functional.linear(x, new))
    assert fuse_projections(m) == 1  # the replaced group is fused again, the rest stood
    assert att.k_proj.weight.shape[0] == 8 and att.q_proj.pdlab_fused.intact()
