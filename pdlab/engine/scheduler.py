"""Continuous batching on a per-step token budget.

Every request carries `num_computed`, the number of its tokens whose KV is in the pool. Each step the
scheduler hands out at most `token_budget` new tokens: first to running requests (a decode needs one
token, an unfinished chunked prefill its next chunk), then to waiting requests in arrival order (their
prompt, less what the prefix cache already holds). Decode, chunked prefill and prefix hits are one
mechanism. When blocks run out, the most recently admitted running request is preempted: its blocks
are released and it goes back to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdlab.constants import cdiv
from pdlab.engine.blocks import BlockManager
from pdlab.engine.config import EngineConfig
from pdlab.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens per request this step
    decode: list[bool] = field(default_factory=list)  # True where the request decodes one token
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # cannot fit even alone in the pool

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, n: int, decode: bool) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.decode.append(decode)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int, computed: int | None = None) -> int:
        remaining = seq.num_tokens - (seq.num_computed if computed is None else computed)
        if self.config.chunked_prefill:
            return min(remaining, self.config.long_prefill_token_threshold or budget, budget)
        # Unchunked: a prompt goes in whole, or waits for a step with room. One longer than the whole
        # budget (or a recompute of prompt + outputs after preemption) could never fit, so it runs in
        # pieces of whatever budget is left rather than never.
        if remaining > self.config.token_budget:
            return budget
        return remaining if remaining <= budget else 0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decode = seq.is_decode
            if decode and seq.num_computed < len(seq.block_table) * self.blocks.block_size:
                batch.add(seq, 1, True)  # its slot is in a block it holds: nothing to allocate
                budget -= 1
                i += 1
                continue
            n = 1 if decode else self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.can_allocate(seq, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, seq.num_computed + n)
                batch.add(seq, n, decode)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: nothing later in the list can run either
        if batch.preempted:
            return batch
        # New requests are admitted in arrival order: one that does not fit stops the admission of those behind
        # it. Waiting sequences that already hold their KV blocks (decode role: admitted after a hand-over)
        # may still run past it: they need a block at most, and if they waited behind a preempted sequence
        # that needs more blocks than are free, nothing would ever free any (a deadlock).
        held_only = False
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if held_only and not seq.block_table:
                continue
            hits = self._prefix_hits(seq)
            computed = seq.num_computed + len(hits) * self.blocks.block_size
            decode = seq.is_decode
            n = 1 if decode else self._chunk(seq, budget, computed)
            if n == 0 or not self.blocks.can_allocate(seq, computed + n, hits):
                self._fail_if_too_big(seq, batch)
                held_only = True
                continue
            self.waiting.remove(seq)
            if hits:
                self.blocks.take_prefix(seq, hits)
                seq.num_computed = computed
            if seq.preemptions == 0 and not decode:
                seq.num_cached = seq.num_computed
            self.blocks.allocate(seq, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n, decode)
            budget -= n
        return batch

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for a request not yet holding any. At least the last token is always
        computed, so the request has logits to sample from."""
        if seq.block_table or seq.num_computed:
            return []
        return self.blocks.match_prefix(seq.prompt_ids + seq.output_ids, seq.num_tokens - 1)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in batch.seqs:  # already handed tokens this step: take them back
            j = batch.seqs.index(seq)
            batch.seqs.pop(j)
            batch.num_tokens.pop(j)
            batch.decode.pop(j)
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self._fail_if_too_big(seq, batch)

    def _fail_if_too_big(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """A request needing more blocks than the whole pool never fits: fail it rather than wait forever."""
        if cdiv(seq.num_tokens, self.blocks.block_size) > self.blocks.num_blocks:
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in batch.preempted:
                batch.preempted.remove(seq)
            self.blocks.release(seq)
            batch.failed.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a request from the queues (its blocks are the engine's business)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
