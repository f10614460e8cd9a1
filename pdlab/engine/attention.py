"""pdlab's attention, registered with transformers' AttentionInterface.

The model runs on a packed batch of one: every scheduled token of every request is laid end to end
([1, T]) with its own position id. transformers computes q/k/v and rotary embeddings per token as usual
and then calls `paged_attention` once per layer. There we write the new K/V into the paged pool and
attend each request to its own context:
- decode requests (one query token), CPU float32: all of them in one call of pdlab's C kernel, reading K/V in
  place from their blocks (pdlab.engine.cpu_kernel); where it cannot be built, the torch paths: long
  contiguous contexts in place (`_attend_in_place`), the others in one padded SDPA call over K/V gathered
  from their blocks, the query heads that share a K/V head laid out as rows of one query (25-35% faster
  than `enable_gqa` on CPU, and exact: with one query token no row masks another);
- prefill chunks one call each: plain causal over the chunk's own K/V when the request has no earlier
  context (the common case; CPU float32: pdlab's C kernel, else SDPA), else, after earlier context, on CPU two
  unmasked SDPA calls merged by their log-sum-exps (`prefill_after`: over the earlier tokens gathered from the
  blocks, and over the chunk itself, causally), on CUDA one SDPA call with an offset causal mask.
GQA uses SDPA's `enable_gqa`, so K/V heads are never repeated (CPU). On CUDA the runner picks a fused kernel
instead (pdlab.engine.cuda_attention): flash-attn's varlen call (`ctx.flash`), or SDPA with K/V heads expanded
(`ctx.expand_kv`), since a masked `enable_gqa` call there falls back to the math kernel.

The per-step metadata lives in a module-level context set by the runner around the forward pass
(the model call cannot carry it): tensors are built once per step and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from pdlab.engine import cpu_kernel
from pdlab.engine.cuda_attention import FlashMeta, expand_kv, flash_attend

ATTN_NAME = "pdlab_paged"


@dataclass
class PrefillSegment:
    q_start: int  # first row of this request's tokens in the packed batch
    q_end: int
    ctx_len: int  # tokens of context the chunk attends to (earlier tokens + the chunk itself)
    blocks: Optional[torch.Tensor]  # [n_blocks] the request's blocks; None when the chunk is the whole context
    mask: Optional[torch.Tensor]  # [q_len, ctx_len] bool, None when plain causal


@dataclass
class AttnContext:
    kv: torch.Tensor  # pool [layers, 2, blocks, block_size, kv_heads, head_dim]
    slots: torch.Tensor  # [T] pool slot (block * block_size + offset) of each new token
    decode_rows: Optional[torch.Tensor] = None  # [B] rows of the decode tokens in the packed batch
    decode_blocks: Optional[torch.Tensor] = None  # [B, max_blocks] block tables (padded)
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSegment] = field(default_factory=list)
    decode_views: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first block, context len)
    layer_hook: Optional[Callable[[int], None]] = None
    decode_batch: Optional[Any] = None  # CPU float32: every decode request, for pdlab.engine.cpu_kernel
    prefill_kernel: bool = False  # CPU float32: a chunk without earlier context through cpu_kernel's prefill
    flash: Optional[FlashMeta] = None  # CUDA, kernel flash-attn: the whole batch in one varlen call
    expand_kv: bool = False  # CUDA, kernel sdpa-expanded: K/V heads repeated instead of enable_gqa


_CTX: Optional[AttnContext] = None


def set_context(ctx: Optional[AttnContext]) -> None:
    global _CTX
    _CTX = ctx


def paged_attention(
    module: Any,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx = _CTX
    if ctx is None:
        raise RuntimeError("pdlab attention called outside an engine step")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_blocks, v_blocks = ctx.kv[layer, 0], ctx.kv[layer, 1]  # [blocks, block_size, Hkv, D]
    k_blocks.view(-1, kv_heads, head_dim).index_copy_(0, ctx.slots, k)
    v_blocks.view(-1, kv_heads, head_dim).index_copy_(0, ctx.slots, v)
    if ctx.flash is not None:
        out = flash_attend(ctx.flash, q.contiguous(), k_blocks, v_blocks, scaling)
        if ctx.layer_hook is not None:
            ctx.layer_hook(layer)
        return out.unsqueeze(0), None
    k_rows, v_rows = k_blocks.view(k_blocks.shape[0], -1), v_blocks.view(v_blocks.shape[0], -1)  # a block a row
    expand = ctx.expand_kv

    out = torch.empty_like(q)
    if ctx.decode_rows is not None:
        out[ctx.decode_rows] = decode_gathered(q[ctx.decode_rows], k_rows, v_rows, ctx.decode_blocks,
                                               ctx.decode_mask, kv_heads, scaling, expand)
    scale = scaling if scaling is not None else head_dim ** -0.5  # the C kernels take it resolved
    if ctx.decode_batch is not None:
        cpu_kernel.decode_attention(q, k_blocks, v_blocks, ctx.decode_batch, scale, out)
    if ctx.decode_views:
        _attend_in_place(q, out, k_blocks, v_blocks, ctx.decode_views, scaling)
    for seg in ctx.prefills:
        rows = slice(seg.q_start, seg.q_end)
        if seg.blocks is None and ctx.prefill_kernel:
            cpu_kernel.prefill_attention(q[rows], k[rows], v[rows], scale, out[rows])
            continue
        if seg.blocks is None:
            out[rows] = prefill_sdpa(q[rows], k[rows], v[rows], scaling, expand)
            continue
        if q.device.type == "cpu" and not expand:  # earlier context, then the chunk: two unmasked calls, merged
            prior = seg.ctx_len - (seg.q_end - seg.q_start)
            earlier = seg.blocks[: -(-prior // k_blocks.shape[1])]
            ke = k_rows.index_select(0, earlier).view(-1, kv_heads, head_dim)[:prior]
            ve = v_rows.index_select(0, earlier).view(-1, kv_heads, head_dim)[:prior]
            out[rows] = prefill_after(q[rows], k[rows], v[rows], ke, ve, scaling)
            continue
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ks = k_rows.index_select(0, seg.blocks).view(-1, kv_heads, head_dim)[: seg.ctx_len]
        vs = v_rows.index_select(0, seg.blocks).view(-1, kv_heads, head_dim)[: seg.ctx_len]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        o = _sdpa(qs, ks, vs, expand, attn_mask=seg.mask, scale=scaling)
        out[seg.q_start:seg.q_end] = o[0].transpose(0, 1)
    if ctx.layer_hook is not None:
        ctx.layer_hook(layer)
    return out.unsqueeze(0), None


def decode_gathered(qd: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, blocks: torch.Tensor,
                    mask: Optional[torch.Tensor], kv_heads: int, scaling: Optional[float],
                    expand: bool = False) -> torch.Tensor:
    """Decode attention in one padded SDPA call over K/V gathered from the requests' blocks: qd [B, H, D] (one
    query token each), k_rows / v_rows a layer's pool with a block a row, blocks [B, max_blocks] (padded), mask
    [B, 1, 1, max_blocks * block_size] bool. Returns [B, H, D]. The torch path the decode kernel replaces
    (pdlab.engine.kernel_check times the two against each other)."""
    b, head_dim = blocks.shape[0], qd.shape[-1]
    flat = blocks.view(-1)  # whole blocks, one row each: index_select on 2-D is ~5x faster
    kd = k_rows.index_select(0, flat).view(b, -1, kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, n, D]
    vd = v_rows.index_select(0, flat).view(b, -1, kv_heads, head_dim).transpose(1, 2)
    if expand:
        od = _sdpa(qd.unsqueeze(2), kd, vd, expand, attn_mask=mask, scale=scaling)  # [B, H, 1, D]
    else:  # one query token: a K/V head's query heads are rows of one query ([B, Hkv, G, D]), no GQA
        od = F.scaled_dot_product_attention(qd.view(b, kv_heads, -1, head_dim), kd, vd, attn_mask=mask,
                                            scale=scaling)
    return od.reshape(b, -1, head_dim)


def prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Optional[float],
                 expand: bool = False) -> torch.Tensor:
    """A chunk over itself, causally, by SDPA: q [n, H, D], k / v [n, Hkv, D] -> [n, H, D]. The torch path the
    prefill kernel replaces (pdlab.engine.kernel_check times the two against each other)."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return _sdpa(qs, ks, vs, expand, is_causal=True, scale=scaling)[0].transpose(0, 1)


def prefill_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_earlier: torch.Tensor,
                  v_earlier: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
    """A chunk after earlier context (CPU): q, k, v [n, H or Hkv, D] the chunk's own, k_earlier / v_earlier
    [P, Hkv, D] the P tokens before it -> [n, H, D].

    The same softmax over all P + n keys as one SDPA call with the offset causal mask, computed as two calls
    without a mask, merged by their log-sum-exps: every query over the earlier tokens (all visible), and the
    chunk over itself, causally. Why: with a mask torch's CPU flash kernel reads the whole mask and computes
    every block of it, masked or not; without one it skips the blocks above the diagonal. The result differs
    from the masked call's by float rounding."""
    qs, ks, vs, ke, ve = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, k_earlier, v_earlier))
    try:  # GQA as it is (torch 2.13's CPU flash kernel reads K/V head h // group for query head h)
        o_earlier, lse_earlier = _flash(qs, ke, ve, False, scaling)
        o_own, lse_own = _flash(qs, ks, vs, True, scaling)
    except RuntimeError:  # a torch whose kernel wants as many K/V heads as query heads
        if ks.shape[1] == qs.shape[1]:
            raise  # not GQA: a real error
        (ke, ve), (ks, vs) = expand_kv(ke, ve, qs.shape[1], 1), expand_kv(ks, vs, qs.shape[1], 1)
        o_earlier, lse_earlier = _flash(qs, ke, ve, False, scaling)
        o_own, lse_own = _flash(qs, ks, vs, True, scaling)
    lse = torch.logaddexp(lse_earlier, lse_own)
    out = (o_earlier.float() * (lse_earlier - lse).exp_().unsqueeze(-1)
           + o_own.float() * (lse_own - lse).exp_().unsqueeze(-1))
    return out.to(q.dtype)[0].transpose(0, 1)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scaling: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: [1, H, n, D] out and [1, H, n] log-sum-exp of each query's scores."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)[:2]
    return out, lse


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool, **kw: Any) -> torch.Tensor:
    """SDPA over [B, H, n, D] queries and [B, Hkv, m, D] K/V: `enable_gqa` (CPU, as always), or K/V heads
    repeated to H first (CUDA), so that the fused kernels, which do not take `enable_gqa` with a mask, apply."""
    if expand:
        k, v = expand_kv(k, v, q.shape[1], 1)
        return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _attend_in_place(q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                     views: list[tuple[int, int, int]], scaling: Optional[float]) -> None:
    """Decode attention over a contiguous run of blocks, read as a view of the pool (no copy).
    Query heads are grouped by the K/V head they share, as transformers' GQA does (head h uses kv head
    h // group)."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[2]
    group = heads // kv_heads
    bs = k_blocks.shape[1]
    scale = scaling if scaling is not None else head_dim ** -0.5
    k_tokens = k_blocks.view(-1, kv_heads, head_dim)  # [slots, Hkv, D]: a request's run is one slice of it
    v_tokens = v_blocks.view(-1, kv_heads, head_dim)
    upcast = v_blocks.dtype != torch.float32
    # few ops per request: at decode sizes each costs more in dispatch than in arithmetic
    for row, first, n in views:
        k = k_tokens[first * bs:first * bs + n]  # [n, Hkv, D], a view
        v = v_tokens[first * bs:first * bs + n]
        scores = torch.matmul(q[row].view(kv_heads, group, head_dim), k.permute(1, 2, 0)).mul_(scale)  # [Hkv, G, n]
        if upcast:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        torch.matmul(probs, v.transpose(0, 1), out=out[row].view(kv_heads, group, head_dim))


def register() -> None:
    """Make `attn_implementation=ATTN_NAME` resolve to pdlab's attention (idempotent).

    The name is deliberately absent from transformers' mask registry, so the model builds no
    attention mask: masking is ours, per request.
    """
    # deferred: transformers
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
