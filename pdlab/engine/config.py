"""Engine knobs and per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pdlab.fields import RecipeError, Section, key_of, optional, spec, to_bool, to_float, to_int


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, bad parameters). The engine keeps serving others."""


def _kv_blocks(v: Any) -> Union[int, str]:
    return v if v == "auto" else to_int(1)(v)


@dataclass(frozen=True)
class EngineConfig(Section):
    """Engine knobs: the recipe's `engine` section, and what `Engine` takes in Python."""

    block_size: int = spec(16, "an integer >= 1 (tokens per KV block)", to_int(1))
    kv_blocks: Union[int, str] = spec("auto", "auto or an integer >= 1", _kv_blocks)  # auto: from memory
    token_budget: int = spec(2048, "an integer >= 1 (tokens per step)", to_int(1))  # decode and prefill together
    chunked_prefill: bool = spec(False, "true or false", to_bool)
    # with chunked_prefill, at most this many prompt tokens of one request per step (vLLM's name); 0: no cap
    # beyond the step's budget, so the chunk is what the budget leaves after the decodes
    long_prefill_token_threshold: int = spec(0, "an integer >= 0 (prompt tokens of one request per step; 0 = no "
                                                "cap)", to_int(0))
    prefix_caching: bool = spec(True, "true or false", to_bool)
    max_running: int = spec(64, "an integer >= 1 (sequences per step)", to_int(1))
    max_model_len: Optional[int] = spec(None, "null or an integer >= 1", optional(to_int(1)))  # None: the model's
    kv_memory_fraction: float = spec(0.5, "a fraction in (0, 1]", to_float(0.0, 1.0))  # of free memory, for auto

    def check(self, where: str) -> None:
        if self.chunked_prefill and self.long_prefill_token_threshold > self.token_budget:  # a cap that never binds
            raise RecipeError(f"{key_of(where, 'long_prefill_token_threshold')} ({self.long_prefill_token_threshold}) "
                              f"must be <= engine.token_budget ({self.token_budget}) when chunked_prefill is true")


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
