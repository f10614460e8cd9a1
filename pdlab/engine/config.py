"""Engine knobs and per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, bad parameters). The engine keeps serving others."""


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_blocks: Union[int, str] = "auto"  # "auto": sized from memory and max_running
    token_budget: int = 2048  # tokens per step, decode and prefill together
    chunked_prefill: bool = False
    chunk_size: int = 512
    prefix_caching: bool = True
    max_running: int = 64
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    kv_memory_fraction: float = 0.5  # share of free memory "auto" may take for the KV pool

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.block_size >= 1, f"engine.block_size must be >= 1, got {self.block_size}")
        need(self.token_budget >= 1, f"engine.token_budget must be >= 1, got {self.token_budget}")
        need(self.chunk_size >= 1, f"engine.chunk_size must be >= 1, got {self.chunk_size}")
        need(self.max_running >= 1, f"engine.max_running must be >= 1, got {self.max_running}")
        need(
            self.kv_blocks == "auto" or (isinstance(self.kv_blocks, int) and self.kv_blocks >= 1),
            f"engine.kv_blocks must be 'auto' or an integer >= 1, got {self.kv_blocks!r}",
        )
        if self.chunked_prefill:
            need(
                self.chunk_size <= self.token_budget,
                f"engine.chunk_size ({self.chunk_size}) must be <= engine.token_budget ({self.token_budget})",
            )


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: Optional[int] = None  # per-request generator seed for temperature sampling
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
