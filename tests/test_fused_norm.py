"""The fused RMSNorm is transformers' RMSNorm, bit for bit, in float32; other dtypes keep transformers'."""

import pytest
import torch

from pdlab.engine import load_model
from pdlab.engine.fused_norm import fuse_rms_norms


@pytest.mark.parametrize("preset,per_layer", [("tiny-llama", 2), ("tiny-qwen3", 4)])  # qwen3: q_norm, k_norm
def test_every_norm_is_fused_and_computes_the_same_bits(preset, per_layer):
    model = load_model(preset)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == per_layer * model.config.num_hidden_layers + 1  # and the final norm
    g = torch.Generator().manual_seed(0)
    for m in norms:
        m.weight.data.uniform_(0.5, 1.5, generator=g)
        width = m.weight.shape[0]
        for shape in ((1, 37, width), (3, 5, 2, width), (1, 1, width)):
            x = torch.randn(shape, generator=g) * 3
            assert torch.equal(m(x), type(m).forward(m, x))  # the class's own forward is transformers'


def test_other_dtypes_keep_transformers_forward():
    model = load_model("tiny-llama")
    norm = model.model.norm
    x = torch.randn(2, 7, norm.weight.shape[0])
    model.to(torch.bfloat16)
    assert torch.equal(norm(x.bfloat16()), type(norm).forward(norm, x.bfloat16()))
    assert fuse_rms_norms(model) == 0  # nothing float32 left to fuse
