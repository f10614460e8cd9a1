"""Text in and out of pdlab serve: the model's tokenizer, its chat template, and incremental detokenization.

Synthetic presets have no tokenizer: they are served with token ids only (a text prompt, a stop string or
a chat request is a 400 naming why). Detokenization is incremental and windowed, as vLLM does it: each new
token is decoded with a few tokens before it, and the text it adds is what that window decodes to beyond
what the window without it did; text that ends in an incomplete UTF-8 character (U+FFFD) waits for the
next token.
"""

from __future__ import annotations

from typing import Any, Optional

from pdlab.api.protocol import ApiError, Message

# tokens of the prompt a detokenizer starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): the first
# output token then decodes in context (a SentencePiece word start keeps its space)
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class Text:
    """The tokenizer of the served model, or None: what needs it says so in a 400."""

    def __init__(self, tokenizer: Any, model: str):
        self.tokenizer, self.model = tokenizer, model

    @property
    def chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def _need(self, param: str, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{param}: {what} needs the model's tokenizer, and {self.model} has none (a synthetic "
                                "preset): give the prompt as token ids", param)
        return self.tokenizer

    def encode(self, prompt: str, param: str = "prompt") -> list[int]:
        """A text prompt's token ids, with the special tokens the tokenizer adds (BOS), as vLLM encodes it."""
        ids = list(self._need(param, "a text prompt").encode(prompt, add_special_tokens=True))
        if not ids:
            raise ApiError(400, f"{param}: the prompt encodes to no token", param)
        return ids

    def chat(self, messages: tuple[Message, ...]) -> list[int]:
        """The chat template's prompt for `messages`, with the assistant's turn opened, as token ids."""
        tok = self._need("messages", "a chat request")
        if not self.chat_template:
            raise ApiError(400, f"messages: {self.model}'s tokenizer has no chat template; use /v1/completions",
                           "messages")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                           tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template raises what its author wrote (jinja's TemplateError)
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        ids = list(tok.encode(text, add_special_tokens=False))  # the template wrote the special tokens
        if not ids:
            raise ApiError(400, "messages: the chat template rendered no token", "messages")
        return ids

    def check_stops(self, stops: tuple[str, ...]) -> None:
        if stops:
            self._need("stop", "a stop string")

    def detokenizer(self, prompt_ids: list[int]) -> Optional["Detokenizer"]:
        return Detokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None


class Detokenizer:
    """Token ids in, text out, one token at a time."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # the window starts here
        self.read = len(self.ids)  # text of the tokens before this has been given out

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text `token_id` completes ("" while it ends in an incomplete character)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete character and all."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""
