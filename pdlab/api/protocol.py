"""The OpenAI requests pdlab serve accepts, parsed from JSON into frozen dataclasses.

Every mistake is an `ApiError`: an HTTP status and OpenAI's error body, {"error": {"message", "type",
"param", "code"}}, naming the field. Unknown fields are ignored, as OpenAI's clients send their own; the
known ones pdlab cannot honour (n > 1, logprobs, penalties, tools, ...) are refused rather than silently
ignored, because each would change the answer. vLLM's extensions that pdlab's engine has are accepted:
`ignore_eos`, `stop_token_ids`, `return_token_ids` (token ids in each choice, as pdlab's own client reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

# A seed is a torch generator seed (pdlab.engine.sampler): a non-negative 64-bit integer
SEED_MAX = 2**63 - 1
# Known fields with the value that means "off": any other value is refused (400), never ignored
UNSUPPORTED = {"n": (1, None), "best_of": (1, None), "echo": (False, None), "suffix": (None, ""),
               "logprobs": (None, False, 0), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
               "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
               "repetition_penalty": (1, 1.0, None), "logit_bias": (None, {}), "min_tokens": (0, None),
               "top_k": (None, -1, 0), "min_p": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "response_format": (None, {"type": "text"}), "guided_json": (None,),
               "guided_regex": (None,), "guided_choice": (None,), "include_stop_str_in_output": (False, None)}


class ApiError(Exception):
    """A request pdlab serve refuses: `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: Optional[str], message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param)


@dataclass(frozen=True)
class Sampling:
    """What every request asks of the engine. `max_tokens` None: the endpoint's default."""

    max_tokens: Optional[int] = None
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()  # matched on the detokenized text; the text is cut before the match
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def engine_params(self, max_tokens: int) -> dict:
        """pdlab.engine.SamplingParams' fields (plain data: they travel to the workers as msgpack)."""
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "ignore_eos": self.ignore_eos, "stop_token_ids": list(self.stop_token_ids)}


@dataclass(frozen=True)
class Output:
    """How the answer is sent: streamed as server-sent events or whole, with usage and token ids or not."""

    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    model: Optional[str]
    prompts: tuple[Union[str, tuple[int, ...]], ...]  # one choice per prompt (a batch when several)
    sampling: Sampling
    output: Output


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    model: Optional[str]
    messages: tuple[Message, ...]
    sampling: Sampling
    output: Output


# ---- field readers: each names the field it refuses ----

def _int(body: dict, key: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise bad(key, f"expected an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v!r}")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v > hi or v < lo or (
            lo_open and v == lo):
        raise bad(key, f"expected a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"expected true or false, got {v!r}")
    return v


def _token_ids(v: Any, key: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise bad(key, "expected a list of token ids (integers >= 0)")
    return tuple(v)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "expected a non-empty string or a list of them")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    for key, off in UNSUPPORTED.items():
        if key in body and body[key] not in off:
            raise ApiError(400, f"{key}: not supported by pdlab serve (got {body[key]!r})", key,
                           code="unsupported_parameter")


def _common(body: dict, max_tokens_keys: tuple[str, ...]) -> tuple[Sampling, Output]:
    _refuse_unsupported(body)
    max_tokens = None
    for k in max_tokens_keys:  # chat: max_completion_tokens wins over the older max_tokens
        max_tokens = _int(body, k, 1)
        if max_tokens is not None:
            break
    seed = _int(body, "seed", 0, SEED_MAX)
    stop_ids = () if body.get("stop_token_ids") is None else _token_ids(body["stop_token_ids"], "stop_token_ids")
    sampling = Sampling(max_tokens, _float(body, "temperature", 1.0, 0.0, math.inf),
                        _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed, _stop(body), stop_ids,
                        _bool(body, "ignore_eos"))
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(opts, dict):
            raise bad("stream_options", "expected an object such as {\"include_usage\": true}")
        include_usage = _bool(opts, "include_usage")
    return sampling, Output(stream, include_usage, _bool(body, "return_token_ids"))


def _model(body: dict) -> Optional[str]:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad("model", f"expected a string, got {m!r}")
    return m


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    p = body.get("prompt")
    if isinstance(p, str):
        prompts: tuple = (p,)
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = tuple(p)  # a batch of texts
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = (_token_ids(p, "prompt"),)
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = tuple(_token_ids(x, f"prompt[{i}]") for i, x in enumerate(p))  # a batch of token-id prompts
    else:
        raise bad("prompt", "expected a string, a list of token ids, or a non-empty list of either "
                            f"(got {type(p).__name__ if p is not None else 'nothing'})")
    sampling, output = _common(body, ("max_tokens",))
    return CompletionRequest(_model(body), prompts, sampling, output)


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "expected a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, msg in enumerate(msgs):
        key = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad(key, "expected an object with a string role")
        out.append(Message(msg["role"], _content(msg.get("content"), f"{key}.content")))
    sampling, output = _common(body, ("max_completion_tokens", "max_tokens"))
    return ChatRequest(_model(body), tuple(out), sampling, output)


def _content(c: Any, key: str) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as vLLM does)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "\n".join(p["text"] for p in c)
    raise bad(key, "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts")
