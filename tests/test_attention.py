"""pdlab.engine.attention.prefill_after: a chunk after earlier context attends to every earlier token and to
itself causally, as one SDPA call with the offset causal mask does, to float rounding, with and without GQA, for
one query row or many, one earlier token or many; in bfloat16 too. (The engine's whole path against
transformers, prompts in chunks: tests/test_engine.py.)"""

import pytest
import torch
import torch.nn.functional as F

from pdlab.engine.attention import prefill_after


def masked_reference(q, k, v, ke, ve, scale):
    """One float64 SDPA call over earlier + own keys with the offset causal mask, K/V heads repeated."""
    n, prior = q.shape[0], ke.shape[0]
    keys, values = torch.cat([ke, k]).double(), torch.cat([ve, v]).double()
    group = q.shape[1] // k.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    mask = torch.arange(prior + n)[None, :] <= torch.arange(prior, prior + n)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 128), (8, 2, 64), (8, 1, 32)])
@pytest.mark.parametrize("prior,n", [(1, 1), (1, 37), (300, 1), (700, 203), (2048, 952)])
def test_a_chunk_after_earlier_context_is_the_masked_softmax(heads, kv_heads, head_dim, prior, n):
    g = torch.Generator().manual_seed(prior * 7 + n + head_dim)
    q = torch.randn(n, heads, head_dim, generator=g)
    k, v = torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g)
    ke = torch.randn(prior, kv_heads, head_dim, generator=g)
    ve = torch.randn(prior, kv_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    out = prefill_after(q, k, v, ke, ve, scale)
    assert out.shape == (n, heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), masked_reference(q, k, v, ke, ve, scale), rtol=1e-5, atol=2e-6)


def test_strided_views_and_bfloat16():
    """The chunk's q/k/v as the packed batch hands them over (views with row strides); bfloat16 within its
    rounding."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, n, prior = 8, 2, 64, 50, 130
    q = torch.randn(n + 4, heads, d, generator=g)[2:2 + n]
    kv = torch.randn(n, 2 * kv_heads, d, generator=g)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    ke, ve = torch.randn(prior, kv_heads, d, generator=g), torch.randn(prior, kv_heads, d, generator=g)
    ref = masked_reference(q, k, v, ke, ve, None)
    torch.testing.assert_close(prefill_after(q, k, v, ke, ve, None).double(), ref, rtol=1e-5, atol=2e-6)
    half = prefill_after(*(x.bfloat16() for x in (q, k, v, ke, ve)), None)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), ref, rtol=0.05, atol=0.03)
