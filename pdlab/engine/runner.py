"""Runs one scheduled batch through the model: packs the tokens, builds the attention context,
computes logits only where a request samples.

On CUDA the per-step metadata (token ids, positions, slots, block tables, masks) goes to the device from
pinned host memory without blocking (torch's caching host allocator keeps a pinned buffer alive until its
copy has run), the attention kernel is a fused one (pdlab.engine.cuda_attention), and `sync()` ends a step
only when its kernels have run, so step and prefill-end times are the GPU's, not the launch queue's."""

from __future__ import annotations

from array import array
from typing import Any, Callable, Optional

import torch

from pdlab.constants import PACKED_LINEAR, cdiv
from pdlab.engine import cuda_attention as ca
from pdlab.engine.attention import AttnContext, PrefillSegment, set_context
from pdlab.engine.blocks import padded_tables
from pdlab.engine.cpu_kernel import DecodeBatch
from pdlab.engine.fused_linear import fuse_projections
from pdlab.engine.packed_linear import pack_linears
from pdlab.engine.kernel_check import Choice, Shape, choose
from pdlab.engine.sequence import Sequence

# Decode requests with at least this much context, whose blocks are one contiguous run, attend to their
# KV in place (a view of the pool) instead of through the batched gather: at long contexts the gather's
# copy costs more than a few small per-request kernels. Below it, one batched call is cheaper. CPU only.
VIEW_MIN_CONTEXT = 512


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA staged through pinned memory and copied without blocking; on CPU
    the tensor itself."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _long(xs: list[int], device: torch.device, code: str = "q") -> torch.Tensor:
    """An int64 (code "q") or int32 ("i") tensor from a list of ints; through array() it is ~7x faster than
    torch.tensor(list)."""
    dtype = torch.long if code == "q" else torch.int32
    if not xs:
        return torch.empty(0, dtype=dtype, device=device)
    return to_device(torch.frombuffer(array(code, xs), dtype=dtype), device)


def kernel_shape(model: Any, kv: torch.Tensor) -> Shape:
    """What the CPU kernels see of the model on this rank: query heads and MLP width divided among
    tensor-parallel ranks (pdlab.engine.tensor_parallel), K/V heads and head_dim as the pool holds them."""
    cfg = model.config
    world = int(getattr(model, "pdlab_tp", {}).get("world", 1))
    return Shape(heads=cfg.num_attention_heads // world, kv_heads=kv.shape[-2], head_dim=kv.shape[-1],
                 hidden=cfg.hidden_size, intermediate=cfg.intermediate_size // world)


class ModelRunner:
    def __init__(self, model: Any, kv: torch.Tensor, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.device
        self.backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.layer_hook: Optional[Callable[[int], None]] = None
        # Per-request kernels are cheap on a CPU and expensive launches on a GPU: in place on CPU only.
        self.in_place = self.device.type == "cpu"
        # CPU, float32: pdlab's C kernels where they beat torch here (pdlab.engine.kernel_check): every decode
        # request of a step in one call, a prefill chunk over itself, rotary, SwiGLU, RMSNorm
        self.cpu_kernel = self.cpu_prefill = False
        self.kernels: dict[str, Any] = {}  # kernel -> kernel_check.Choice (its worker's Ready message reports them)
        packed = Choice(False, f"does not apply: {self.device.type}")
        if self.device.type == "cpu":
            fuse_projections(model)  # here, not at load: after any tensor-parallel sharding
            packed = pack_linears(model)  # after fusing: the fused weights are the ones multiplied
        self.kernels = choose(kernel_shape(model, kv), kv.dtype, self.device.type)
        self.kernels[PACKED_LINEAR] = packed
        self.cpu_kernel = self.kernels["decode_attention"].use
        self.cpu_prefill = self.kernels["prefill_attention"].use
        flash = ca.flash_module() if self.device.type == "cuda" else None
        self.kernel = ca.kernel_for(self.device.type, kv.dtype, kv.shape[-1], flash)
        self.paged = self.kernel == "flash-attn" and ca.supports_paged(flash, block_size)

    def sync(self) -> None:
        """Wait for the step's kernels (CUDA only; a CPU step has finished when forward returns). Only the
        compute stream: a whole-device synchronize would also wait for KV copies running on the pull and
        push side streams, stalling the decode steps those copies are meant to overlap."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def prepare(self, seqs: list[Sequence], num_tokens: list[int],
                decode: list[bool]) -> tuple[list[int], list[int], AttnContext, list[int]]:
        if self.kernel == "flash-attn":
            return self._prepare_flash(seqs, num_tokens)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        views: list[tuple[int, int, int]] = []
        sample_rows: list[int] = []
        kernel_rows: list[int] = []
        kernel_tables: list[list[int]] = []
        kernel_lens: list[int] = []
        for seq, n, is_decode in zip(seqs, num_tokens, decode):
            start, end = seq.num_computed, seq.num_computed + n
            row = len(input_ids)
            table = seq.block_table
            if is_decode:  # the common case, kept lean: one token, its slot, its block table
                input_ids.append(seq.output_ids[-1])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                sample_rows.append(row)
                if self.cpu_kernel:
                    kernel_rows.append(row)
                    kernel_tables.append(table)
                    kernel_lens.append(end)
                    continue
                if self.in_place and seq.contiguous and end >= VIEW_MIN_CONTEXT:
                    views.append((row, table[0], end))
                    continue
                decode_rows.append(row)
                need = cdiv(end, bs)
                decode_tables.append(table if len(table) == need else table[:need])
                decode_lens.append(end)
                continue
            input_ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if start == 0:
                prefills.append(PrefillSegment(row, row + n, end, None, None))
            else:
                blocks = _long(table[: cdiv(end, bs)], self.device)
                mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                prefills.append(PrefillSegment(row, row + n, end, blocks, to_device(mask, self.device)))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
        ctx = AttnContext(kv=self.kv, slots=_long(slots, self.device), prefills=prefills,
                          decode_views=views, layer_hook=self.layer_hook, expand_kv=self.kernel == "sdpa-expanded",
                          prefill_kernel=self.cpu_prefill)
        if kernel_rows:
            ctx.decode_batch = DecodeBatch(kernel_rows, kernel_tables, kernel_lens)
        if decode_rows:
            flat, width = padded_tables(decode_tables)
            ctx.decode_rows = _long(decode_rows, self.device)
            ctx.decode_blocks = _long(flat, self.device).view(len(decode_tables), width)
            lens = _long(decode_lens, torch.device("cpu"))
            ctx.decode_mask = to_device(torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1),
                                        self.device)[:, None, None, :]
        return input_ids, positions, ctx, sample_rows

    def _prepare_flash(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[int], list[int], AttnContext,
                                                                                    list[int]]:
        """The same packed batch, described for one flash-attn varlen call per layer (every request, decode
        or prefill chunk, is a query run against its whole context, causal from the end)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        cu_q, cu_k, tables = [0], [0], []
        for seq, n in zip(seqs, num_tokens):
            start, end = seq.num_computed, seq.num_computed + n
            table = seq.block_table
            input_ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == seq.num_tokens:
                sample_rows.append(cu_q[-1] + n - 1)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            tables.append(table[: cdiv(end, bs)])
        dev = self.device
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
        meta = ca.FlashMeta(_long(cu_q, dev, "i"), _long(cu_k, dev, "i"), max(q_lens), max(k_lens))
        if self.paged:
            flat, width = padded_tables(tables)
            meta.block_table = _long(flat, dev, "i").view(len(tables), width)
        else:
            starts = [0]
            for t in tables[:-1]:
                starts.append(starts[-1] + len(t))
            meta.kv_index = ca.gather_index(_long([b for t in tables for b in t], dev), _long(starts, dev),
                                            _long(k_lens, dev), meta.cu_k, cu_k[-1], bs)
        ctx = AttnContext(kv=self.kv, slots=_long(slots, dev), layer_hook=self.layer_hook, flash=meta)
        return input_ids, positions, ctx, sample_rows

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], ctx: AttnContext,
                sample_rows: list[int]) -> Optional[torch.Tensor]:
        """Logits [len(sample_rows), vocab] in float32 (None when no request samples this step)."""
        ids = _long(input_ids, self.device).unsqueeze(0)
        pos = _long(positions, self.device).unsqueeze(0)
        set_context(ctx)
        try:
            hidden = self.backbone(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        finally:
            set_context(None)
        if not sample_rows:
            return None
        rows = _long(sample_rows, self.device)
        return self.lm_head(hidden[0, rows]).float()
