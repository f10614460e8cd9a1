"""Runs one scheduled batch through the model: packs the tokens, builds the attention context,
computes logits only where a request samples."""

from __future__ import annotations

from array import array
from typing import Any, Callable, Optional

import torch

from pdlab.constants import cdiv
from pdlab.engine.attention import AttnContext, PrefillSegment, set_context
from pdlab.engine.sequence import Sequence

# Decode requests with at least this much context, whose blocks are one contiguous run, attend to their
# KV in place (a view of the pool) instead of through the batched gather: at long contexts the gather's
# copy costs more than a few small per-request kernels. Below it, one batched call is cheaper. CPU only.
VIEW_MIN_CONTEXT = 512


def _long(xs: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor from a list of ints; through array() it is ~7x faster than torch.tensor(list)."""
    if not xs:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", xs), dtype=torch.long).to(device)


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

    def prepare(self, seqs: list[Sequence], num_tokens: list[int],
                decode: list[bool]) -> tuple[list[int], list[int], AttnContext, list[int]]:
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
        for seq, n, is_decode in zip(seqs, num_tokens, decode):
            start, end = seq.num_computed, seq.num_computed + n
            row = len(input_ids)
            table = seq.block_table
            if is_decode:  # the common case, kept lean: one token, its slot, its block table
                input_ids.append(seq.output_ids[-1])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                sample_rows.append(row)
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
                prefills.append(PrefillSegment(row, row + n, end, blocks, mask.to(self.device)))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
        ctx = AttnContext(kv=self.kv, slots=_long(slots, self.device), prefills=prefills,
                          decode_views=views, layer_hook=self.layer_hook)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            flat: list[int] = []
            for t in decode_tables:
                flat += t
                flat += [0] * (width - len(t))
            ctx.decode_rows = _long(decode_rows, self.device)
            ctx.decode_blocks = _long(flat, self.device).view(len(decode_tables), width)
            lens = _long(decode_lens, torch.device("cpu"))
            ctx.decode_mask = (torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)).to(self.device)[:, None, None, :]
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
