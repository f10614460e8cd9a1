"""The fused RMSNorm is transformers' RMSNorm in float32: bit for bit through torch's op, to float rounding through
pdlab's CPU kernel; other dtypes keep transformers'."""

import pytest
import torch

from pdlab.engine import cpu_kernel, load_model
from pdlab.engine.fused_norm import fuse_rms_norms


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("preset,per_layer", [("tiny-llama", 2), ("tiny-qwen3", 4)])  # qwen3: q_norm, k_norm
def test_every_norm_is_fused_and_computes_transformers_norm(preset, per_layer, kernel, monkeypatch):
    if kernel and not (cpu_kernel.load() and "rms_norm" in cpu_kernel.load().fns):
        pytest.skip(f"CPU kernels: {cpu_kernel.status()}")
    # whatever an earlier runner in this process chose (pdlab.engine.kernel_check): the kernel, or torch's op
    monkeypatch.setattr(cpu_kernel, "_off", {} if kernel else {"rms_norm": "this test: torch's op, the same bits"})
    model = load_model(preset)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == per_layer * model.config.num_hidden_layers + 1  # and the final norm
    g = torch.Generator().manual_seed(0)
    for m in norms:
        m.weight.data.uniform_(0.5, 1.5, generator=g)
        width = m.weight.shape[0]
        for shape in ((1, 37, width), (3, 5, 2, width), (1, 1, width)):
            x = torch.randn(shape, generator=g) * 3
            want = type(m).forward(m, x)  # the class's own forward is transformers'
            if kernel:
                torch.testing.assert_close(m(x), want, rtol=2e-6, atol=1e-6)
            else:
                assert torch.equal(m(x), want)


def test_other_dtypes_keep_transformers_forward():
    model = load_model("tiny-llama")
    norm = model.model.norm
    x = torch.randn(2, 7, norm.weight.shape[0])
    model.to(torch.bfloat16)
    assert torch.equal(norm(x.bfloat16()), type(norm).forward(norm, x.bfloat16()))
    assert fuse_rms_norms(model) == 0  # nothing float32 left to fuse
