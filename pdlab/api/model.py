"""What pdlab serve knows of the served model without loading its weights: its name, tokenizer, EOS tokens,
vocabulary and context, and so what a request may ask (the limits checked before anything is submitted)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.api.protocol import ApiError
from pdlab.api.text import Text


@dataclass(frozen=True)
class ServedModel:
    name: str  # what /v1/models lists and requests name
    source: str  # the recipe's preset name or path
    text: Text
    eos_ids: frozenset[int]
    vocab_size: int
    max_model_len: int  # engine.max_model_len, else the model's context
    backend: str = "pdlab"
    kv_tokens: Optional[int] = None  # the smallest worker's KV pool in tokens (pdlab's engine), once started

    @property
    def limit(self) -> int:
        """Prompt plus output tokens one request may take: the context, and what one worker's KV pool holds."""
        return min(self.max_model_len, self.kv_tokens or self.max_model_len)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param}: empty prompt", param)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.limit:
            raise ApiError(400, f"{param}: the prompt has {len(ids)} tokens; this deployment serves at most "
                                f"{self.limit} tokens per request (prompt and output), so at most {self.limit - 1} "
                                f"in the prompt{self._why()}", param, code="context_length_exceeded")

    def max_tokens(self, prompt_len: int, asked: Optional[int], default: Optional[int], param: str) -> int:
        """The output budget of a request: what it asked, else `default` (None: the rest of the context),
        within the limit; asking for more than fits is a 400, as vLLM answers it."""
        room = self.limit - prompt_len
        if asked is None:
            return room if default is None else min(default, room)
        if asked > room:
            raise ApiError(400, f"{param}: {prompt_len} prompt tokens + {asked} output tokens exceed the "
                                f"{self.limit} tokens this deployment serves per request{self._why()}", param,
                           code="context_length_exceeded")
        return asked

    def check_stop_ids(self, ids: tuple[int, ...]) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"stop_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})",
                           "stop_token_ids")

    def _why(self) -> str:
        if self.kv_tokens is not None and self.kv_tokens < self.max_model_len:
            return f" (the smallest worker's KV pool holds {self.kv_tokens} tokens; context {self.max_model_len})"
        return " (the model's context)"


def load_served_model(v: Any, served_name: Optional[str] = None) -> ServedModel:
    """The model of resolved variant `v` (raises pdlab.engine.model.ModelLoadError: a one-line user error)."""
    from pdlab.engine.model import load_tokenizer, model_config

    config = model_config(v.model)
    source = v.model.source
    context = v.engine.max_model_len or getattr(config, "max_position_embeddings", None) or 4096
    return ServedModel(served_name or source, source, Text(load_tokenizer(v.model), source),
                       frozenset(_eos_ids(v.model, config)), int(config.vocab_size), int(context), v.backend.backend)


def _eos_ids(spec: Any, config: Any) -> list[int]:
    """The tokens that end a request unless ignore_eos, as the engine reads them (pdlab.engine.model): the
    generation config's, else the model config's."""
    ids = None
    if spec.path is not None:
        try:
            from transformers import GenerationConfig

            ids = GenerationConfig.from_pretrained(os.path.expanduser(spec.path), local_files_only=True).eos_token_id
        except Exception:  # noqa: BLE001 - no generation_config.json: the model config says
            ids = None
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
