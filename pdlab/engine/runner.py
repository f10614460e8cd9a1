"""Runs one scheduled batch through the model: packs the tokens, builds the attention context,
computes logits only where a request samples."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pdlab.engine.attention import AttnContext, PrefillSegment, set_context
from pdlab.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: Any, kv: torch.Tensor, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.device
        self.backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.layer_hook: Optional[Callable[[int], None]] = None

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[int], list[int], AttnContext, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        prefills: list[PrefillSegment] = []
        sample_rows: list[int] = []
        for seq, n in zip(seqs, num_tokens):
            start, end = seq.num_computed, seq.num_computed + n
            row = len(input_ids)
            input_ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            if n == 1 and seq.is_decode:
                decode_rows.append(row)
                decode_seqs.append(seq)
                slots.append(self._slots(seq, start, end))
            else:
                all_slots = self._slots(seq, 0, end)
                slots.append(all_slots[start:])
                if start == 0:
                    prefills.append(PrefillSegment(row, row + n, None, None))
                else:
                    q_pos = torch.arange(start, end).unsqueeze(1)
                    mask = torch.arange(end).unsqueeze(0) <= q_pos
                    prefills.append(PrefillSegment(row, row + n, all_slots.to(self.device), mask.to(self.device)))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
        ctx = AttnContext(kv=self.kv, slots=torch.cat(slots).to(self.device), prefills=prefills,
                          layer_hook=self.layer_hook)
        if decode_seqs:
            lens = [s.num_tokens for s in decode_seqs]
            max_len = max(lens)
            index = torch.zeros(len(decode_seqs), max_len, dtype=torch.long)
            for i, s in enumerate(decode_seqs):
                index[i, : lens[i]] = self._slots(s, 0, lens[i])
            ctx.decode_rows = torch.tensor(decode_rows, device=self.device)
            ctx.decode_kv_index = index.to(self.device)
            ctx.decode_mask = (torch.arange(max_len).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).to(
                self.device)[:, None, None, :]
        return input_ids, positions, ctx, sample_rows

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], ctx: AttnContext,
                sample_rows: list[int]) -> Optional[torch.Tensor]:
        """Logits [len(sample_rows), vocab] in float32 (None when no request samples this step)."""
        ids = torch.tensor(input_ids, device=self.device).unsqueeze(0)
        pos = torch.tensor(positions, device=self.device).unsqueeze(0)
        set_context(ctx)
        try:
            hidden = self.backbone(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        finally:
            set_context(None)
        if not sample_rows:
            return None
        rows = torch.tensor(sample_rows, device=self.device)
        return self.lm_head(hidden[0, rows]).float()
