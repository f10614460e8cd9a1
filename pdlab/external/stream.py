"""The HTTP client's requests, as coroutines on one aiohttp session (pdlab.external.loop): OpenAI
`/v1/completions` streamed as server-sent events, and plain JSON calls.

Token times are stamped at the client in time.monotonic() (pdlab's one clock) when the chunk's bytes reached
the client: when the kernel received them, or when its socket was first seen readable where the kernel keeps
no receive times (pdlab.external.arrival), not when the loop got round to its line (`vllm bench serve`'s
stamp, which includes the loop's work on other streams; PDLAB_ARRIVAL_STAMPS=0 gives that one). A chunk may
carry several tokens; the caller gets the chunk and its one time (pdlab.external.client keeps chunk sizes for
ITL per chunk).

Errors are StreamError, one line naming the URL and what went wrong; they never quote request headers (an
API key travels in them). `status` is the HTTP status when the server answered, `connection` tells a
server that could not be reached or broke the connection off from one that refused the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional, Union

import aiohttp

from pdlab.constants import SERVED_MODEL_NAME
from pdlab.external.arrival import clock_for
from pdlab.external.silence import watchdog

ERROR_TEXT = 300  # characters of a server's error message quoted
MAX_LINE = 1 << 24  # bytes of one server-sent line; a longer one is a broken stream


class StreamError(RuntimeError):
    """A request the server refused or broke off; one line."""

    def __init__(self, message: str, status: Optional[int] = None, connection: bool = False,
                 not_streamed: bool = False):
        super().__init__(message)
        self.status, self.connection, self.not_streamed = status, connection, not_streamed


def completion_body(prompt: Union[list[int], str], max_tokens: int, *, stream: bool, model: str = SERVED_MODEL_NAME,
                    ignore_eos: bool = True, extra: Optional[dict] = None) -> dict:
    """Greedy, fixed-length: temperature 0 and ignore_eos (vLLM's extension), as the in-house run asks of
    pdlab's engine. `return_token_ids` asks vLLM for the ids of each chunk; servers that do not know it
    ignore it (then the chunk's text is counted, pdlab.external.endpoint)."""
    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": ignore_eos, "stream": stream,
            "return_token_ids": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body | (extra or {})


def server_message(text: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the text, on one line."""
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            text = str(err.get("message") or err.get("detail") or err)
        elif isinstance(err, str):
            text = err
    except ValueError:
        pass
    return " ".join(text.split())[:ERROR_TEXT]


def _broken(url: str, e: BaseException) -> StreamError:
    what = "no answer in time" if isinstance(e, asyncio.TimeoutError) else f"{e.__class__.__name__}: {e}"
    return StreamError(f"{url}: {' '.join(what.split())[:ERROR_TEXT]}", connection=True)


async def _refused(url: str, resp: aiohttp.ClientResponse) -> StreamError:
    text = (await resp.content.read(2000)).decode(errors="replace")
    return StreamError(f"{url}: HTTP {resp.status}: {server_message(text) or resp.reason}", status=resp.status)


async def request_json(session: aiohttp.ClientSession, method: str, url: str, body: Optional[dict] = None,
                       headers: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
    """One JSON call; the decoded body of a 200 answer."""
    kw: dict = {"headers": headers or {}}
    if body is not None:
        kw["json"] = body
    if timeout is not None:
        kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.request(method, url, **kw) as resp:
            if resp.status != 200:
                raise await _refused(url, resp)
            data = await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise _broken(url, e) from None
    try:
        return json.loads(data)
    except ValueError:
        raise StreamError(f"{url}: an answer that is not JSON: {data[:100]!r}", status=200) from None


def chunk_tokens(event: dict) -> list[int]:
    """The token ids one streamed chunk carries (vLLM's `token_ids`; none for the usage chunk)."""
    return [int(t) for c in event.get("choices") or [] for t in (c.get("token_ids") or [])]


def chunk_text(event: dict) -> str:
    return "".join(str(c.get("text") or "") for c in event.get("choices") or [])


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict,
                            on_chunk: Callable[[dict, float], None], headers: Optional[dict] = None,
                            timeout: Optional[float] = None) -> dict:
    """POST a streaming completion; `on_chunk(event, t)` for every chunk with choices, `t` stamped when its
    line was read. Returns {"usage": ..., "finish_reason": ...} as far as the server sent them."""
    final: dict = {}
    # the session's read timeout (silence between two reads) is kept by the loop's watchdog, not by aiohttp's
    # per-read timer (pdlab.external.silence); the connect timeout and `timeout` (the whole request) stay
    limit = session.timeout.sock_read
    task = asyncio.current_task()
    dog = watchdog() if limit and task is not None else None
    kw: dict = {"headers": headers or {}, "json": body,
                "timeout": aiohttp.ClientTimeout(total=timeout, sock_connect=session.timeout.sock_connect,
                                                 sock_read=None if dog is not None else limit)}
    beat = dog.watch(task, limit) if dog is not None else [0.0]
    try:
        async with session.post(url, **kw) as resp:
            if resp.status != 200:
                raise await _refused(url, resp)
            ctype = resp.headers.get("Content-Type", "")
            if "text/event-stream" not in ctype:
                raise StreamError(f"{url}: does not stream: it answered stream: true with {ctype or 'no content type'}"
                                  ", not server-sent events", status=200, not_streamed=True)
            arrived = clock_for(resp.connection.transport if resp.connection is not None else None)
            tail = b""  # a line not yet whole
            async for data in resp.content.iter_any():  # what each read brought: fewer wake-ups than per line
                beat[0] = handed = time.monotonic()
                *lines, tail = (tail + data).split(b"\n")
                if len(tail) > MAX_LINE:
                    raise StreamError(f"{url}: a line longer than {MAX_LINE} bytes")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments (": ping"), event names
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return final
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        raise StreamError(f"{url}: a chunk that is not JSON: {payload[:100]!r}") from None
                    if event.get("error") and not event.get("choices"):
                        raise StreamError(f"{url}: {server_message(json.dumps(event))}")
                    if event.get("choices"):
                        on_chunk(event, arrived(handed))  # a second chunk of one read: when it was handed over
                        for c in event["choices"]:
                            if c.get("finish_reason"):
                                final["finish_reason"] = c["finish_reason"]
                    if event.get("usage"):
                        final["usage"] = event["usage"]
    except StreamError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise _broken(url, e) from None
    except asyncio.CancelledError:
        if dog is None or not dog.expired(task):
            raise
        task.uncancel()  # the watchdog's cancel, not the caller's: a timeout
        raise _broken(url, asyncio.TimeoutError()) from None
    finally:
        if dog is not None:
            dog.forget(task)
    raise StreamError(f"{url}: the stream ended without [DONE]", connection=True)
