"""The HTTP client of an external server: OpenAI `/v1/completions`, token-id prompts, streamed.

The standard library is enough: http.client decodes the chunked body and readline() returns each
server-sent event's `data:` line as soon as it is complete, so no HTTP dependency is added.

Token times are stamped at the client, as `vllm bench serve` stamps them: the moment a chunk's line has
been read (time.monotonic(), pdlab's one clock). A chunk may carry several tokens; they all get that
chunk's time (see docs/external.md for what that does to ITL).
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any, Callable, Optional

from pdlab.constants import SERVED_MODEL_NAME
from pdlab.external.server import HOST


class StreamError(RuntimeError):
    """A request the server refused or broke off; one line."""


def completion_body(prompt_ids: list[int], max_tokens: int, *, stream: bool, ignore_eos: bool = True,
                    extra: Optional[dict] = None) -> dict:
    """Greedy, fixed-length: temperature 0 and ignore_eos, as the in-house run asks of pdlab's engine."""
    body = {"model": SERVED_MODEL_NAME, "prompt": list(prompt_ids), "max_tokens": int(max_tokens),
            "temperature": 0.0, "ignore_eos": ignore_eos, "stream": stream, "return_token_ids": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body | (extra or {})


def _open(port: int, path: str, body: dict, timeout: float) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    data = json.dumps(body).encode()
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise StreamError(f"{HOST}:{port}{path}: {e.__class__.__name__}: {e}") from None
    if resp.status != 200:
        text = resp.read(2000).decode(errors="replace").strip().replace("\n", " ")
        conn.close()
        raise StreamError(f"{HOST}:{port}{path}: HTTP {resp.status}: {text[:300]}")
    return conn, resp


def post_json(port: int, path: str, body: dict, timeout: float) -> dict:
    conn, resp = _open(port, path, body, timeout)
    try:
        return json.loads(resp.read())
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise StreamError(f"{HOST}:{port}{path}: bad response ({e.__class__.__name__})") from None
    finally:
        conn.close()


def chunk_tokens(event: dict) -> list[int]:
    """The token ids one streamed chunk carries (none for the usage chunk)."""
    choices = event.get("choices") or []
    return [int(t) for c in choices for t in (c.get("token_ids") or [])]


def stream_completion(port: int, body: dict, on_tokens: Callable[[list[int], float], None],
                      timeout: float) -> dict:
    """POST a streaming completion; call `on_tokens(ids, t)` per chunk that carries tokens, `t` stamped when
    its line was read. Returns the last event that had a finish_reason (or {}) and the usage, if sent."""
    conn, resp = _open(port, "/v1/completions", body, timeout)
    final: dict = {}
    try:
        while True:
            line = resp.readline()
            if not line:
                break
            t = time.monotonic()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return final
            try:
                event = json.loads(data)
            except ValueError:
                raise StreamError(f"{HOST}:{port}: a chunk that is not JSON: {data[:100]!r}") from None
            if "error" in event and not event.get("choices"):
                raise StreamError(f"{HOST}:{port}: {str(event['error'])[:300]}")
            ids = chunk_tokens(event)
            if ids:
                on_tokens(ids, t)
            if event.get("usage"):
                final["usage"] = event["usage"]
            for c in event.get("choices") or []:
                if c.get("finish_reason"):
                    final["finish_reason"] = c["finish_reason"]
    except (OSError, http.client.HTTPException) as e:
        raise StreamError(f"{HOST}:{port}: stream broken off ({e.__class__.__name__})") from None
    finally:
        conn.close()
    raise StreamError(f"{HOST}:{port}: stream ended without [DONE]")
