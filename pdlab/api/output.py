"""One choice of a response as the engine's tokens come in, and the JSON OpenAI's clients expect of it.

`Choice` turns tokens into text (pdlab.api.text), ends the choice where the engine ended it (`stop` on a
stop token or EOS, whose text is left out; `length` otherwise) or where a stop string appears in the text,
which is cut before it (OpenAI's behaviour; the token that completed it is the last one served). While
the choice runs, the last len(longest stop string) - 1 characters are held back, so a stream never sends
the start of a stop string it will later cut.

`Shape` writes the chunks and responses of /v1/completions (`text_completion`) and /v1/chat/completions
(`chat.completion`), with vLLM's `stop_reason` and, when asked (`return_token_ids`, or always when the model
has no tokenizer), `token_ids` per choice and `prompt_token_ids` in its first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pdlab.api.protocol import Sampling


@dataclass
class Piece:
    """What a choice adds to the response at one moment."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None


class Choice:
    def __init__(self, index: int, prompt_ids: list[int], sampling: Sampling, eos_ids: frozenset[int],
                 detok: Any = None):
        self.index, self.prompt_ids, self.sampling = index, prompt_ids, sampling
        self.eos_ids, self.detok = eos_ids, detok
        self.token_ids: list[int] = []  # served
        self.text = ""  # served
        self._full = ""  # detokenized so far (cut at a stop string)
        self.hold = max((len(s) for s in sampling.stop), default=1) - 1
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[str, int, None] = None
        self.error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def stop_token(self, token_id: int) -> bool:
        s = self.sampling
        return (token_id in self.eos_ids and not s.ignore_eos) or token_id in s.stop_token_ids

    def update(self, ids: list[int], last: bool = False, end: Optional[tuple[bool, str]] = None) -> Piece:
        """New tokens from the engine (`last`: it finished the request with the last of them) and, with `end`
        (ok, error), the engine's word that it is done: what they add to the response."""
        if self.done:
            return Piece()  # cut by a stop string: the engine's later tokens are not served
        new: list[int] = []
        for tid in ids:
            if self.done:
                break
            self.token_ids.append(tid)
            new.append(tid)
            if self.detok is not None and not self.stop_token(tid):  # a stop token's text is left out
                self._add_text(self.detok.add(tid))
        if not self.done and (last or end is not None):
            if (last or end[0]) and self.token_ids:
                self._finish()
            else:
                self.error = (end[1] if end else "") or "the engine returned no token"
        return self._emit(new)

    def fail(self, error: str) -> Piece:
        """The response ends without the engine (cancelled at shutdown, another choice failed)."""
        if self.done:
            return Piece()
        self.error = error
        return self._emit([])

    def _finish(self) -> None:
        last = self.token_ids[-1]
        stop = self.stop_token(last)
        self.finish_reason = "stop" if stop else "length"
        self.stop_reason = last if stop and last in self.sampling.stop_token_ids else None
        if self.detok is not None:
            self._add_text(self.detok.flush())

    def _add_text(self, piece: str) -> None:
        if not piece:
            return
        self._full += piece
        if not self.sampling.stop:
            return
        start = max(0, len(self._full) - len(piece) - self.hold)
        hits = [(i, s) for s in self.sampling.stop if (i := self._full.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self._full = self._full[:i]
            self.finish_reason, self.stop_reason = "stop", s

    def _emit(self, new: list[int]) -> Piece:
        upto = len(self._full) if self.done else max(len(self.text), len(self._full) - self.hold)
        piece = self._full[len(self.text):upto]
        self.text += piece
        return Piece(piece, new, self.finish_reason, self.stop_reason)


def usage(choices: list[Choice]) -> dict:
    p = sum(len(c.prompt_ids) for c in choices)
    n = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


class Shape:
    """The JSON of one endpoint's responses: kind `completion` or `chat`."""

    def __init__(self, kind: str, rid: str, model: str, created: int, token_ids: bool, include_usage: bool):
        self.kind, self.rid, self.model, self.created = kind, rid, model, created
        self.token_ids, self.include_usage = token_ids, include_usage

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _ids(self, out: dict, c: Choice, ids: list[int], first: bool) -> dict:
        if self.token_ids:
            out["token_ids"] = ids
            if first:
                out["prompt_token_ids"] = c.prompt_ids
        return out

    def chunk(self, c: Choice, p: Piece, first: bool) -> dict:
        body = {"index": c.index}
        if self.kind == "chat":
            body["delta"] = ({"role": "assistant", "content": p.text} if first else {"content": p.text}
                             if p.text or not p.finish_reason else {})
        else:
            body["text"] = p.text
        body.update(logprobs=None, finish_reason=p.finish_reason, stop_reason=p.stop_reason)
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out["choices"] = [self._ids(body, c, p.token_ids, first)]
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict:
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage(choices))
        return out

    def response(self, choices: list[Choice]) -> dict:
        items = []
        for c in choices:
            body: dict[str, Any] = {"index": c.index}
            if self.kind == "chat":
                body["message"] = {"role": "assistant", "content": c.text}
            else:
                body["text"] = c.text
            body.update(logprobs=None, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            items.append(self._ids(body, c, list(c.token_ids), True))
        out = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        out.update(choices=items, usage=usage(choices))
        return out
