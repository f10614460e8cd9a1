"""A request inside the engine: its tokens, how many of them have KV in the pool, and its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from pdlab.engine.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued; may hold blocks (decode role: KV arrived from outside)
    RUNNING = "running"
    RESERVED = "reserved"  # decode role: blocks held, KV transfer in flight
    HANDOFF = "handoff"  # prefill role: first token sampled, blocks held until released
    FINISHED = "finished"


@dataclass
class Sequence:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the pool
    num_cached: int = 0  # prompt tokens served from the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks registered so far
    contiguous: bool = True  # block_table is one run of consecutive block ids
    finish_reason: Optional[str] = None
    preemptions: int = 0
    t_arrival: float = 0.0  # engine add() time
    t_first_scheduled: Optional[float] = None
    t_prefill_end: Optional[float] = None  # when the prompt's last chunk finished computing
    generator: Optional[object] = None  # torch.Generator for seeded sampling

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def is_decode(self) -> bool:
        """Only the newest token lacks KV: the next step is a decode step for this request."""
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1
