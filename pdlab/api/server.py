"""pdlab serve's HTTP side: an aiohttp application with OpenAI's routes in front of the bridge.

    GET  /health                200 while serving, 503 while starting, shutting down or after a failure
    GET  /v1/models             the served model
    POST /v1/completions        text or token-id prompts (a list of either: one choice each), streamed or not
    POST /v1/chat/completions   through the tokenizer's chat template
    GET  /metrics               Prometheus text (pdlab.api.metrics)

aiohttp serves it: a mature asyncio server with streaming responses, and the same library as pdlab's
client of external servers. With an API key every route but /health needs `Authorization: Bearer KEY`.
Every refusal is OpenAI's JSON error with a 4xx status; one request's mistake never reaches another's.
A stream's headers go out with its first token, so a request the engine refuses before any token still
gets a status code; after that, a failure is an `error` event before `[DONE]`.
"""

from __future__ import annotations

import hmac
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from pdlab.api.bridge import Bridge
from pdlab.api.job import Job
from pdlab.api.metrics import ServeMetrics
from pdlab.api.model import ServedModel
from pdlab.api.output import Piece, Shape
from pdlab.api.protocol import ApiError, Output, Sampling, parse_chat, parse_completion
from pdlab.constants import SERVE_MAX_BODY_BYTES

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default); chat: the rest
CLIENT_LEFT = "the client went away"


@dataclass
class ServeState:
    """What the routes share: the model, the bridge, the metrics, and whether new requests are admitted."""

    served: ServedModel
    bridge: Bridge
    metrics: ServeMetrics
    api_key: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))
    closing: Optional[str] = None  # why new requests are refused (503)
    jobs: set = field(default_factory=set)

    def admit(self) -> None:
        if self.closing is not None:
            raise ApiError(503, f"not admitting requests: {self.closing}", type="server_error", code="unavailable")

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.served.name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.served.name}`", "model",
                           code="model_not_found")


STATE = web.AppKey("state", ServeState)


def build_app(state: ServeState) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=SERVE_MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return web.json_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                                          type=kind).body(), status=e.status)
    except Exception as e:  # noqa: BLE001 - a bug answers this request with a 500; the server keeps serving
        print(f"pdlab serve: error in {request.method} {request.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return web.json_response(ApiError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                                 status=500)


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path != "/health":
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                           type="authentication_error", code="invalid_api_key")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    s = request.app[STATE]
    if s.closing is not None:
        return web.json_response({"status": "unavailable", "reason": s.closing}, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    s = request.app[STATE]
    card = {"id": s.served.name, "object": "model", "created": s.created, "owned_by": "pdlab",
            "root": s.served.source, "max_model_len": s.served.limit}
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    s = request.app[STATE]
    req = parse_completion(await _body(request))
    s.check_model(req.model)
    s.served.text.check_stops(req.sampling.stop)
    s.served.check_stop_ids(req.sampling.stop_token_ids)
    prompts = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        ids = s.served.text.encode(p, param) if isinstance(p, str) else list(p)
        s.served.check_prompt(ids, param)
        prompts.append(ids)
    budgets = [s.served.max_tokens(len(p), req.sampling.max_tokens, COMPLETION_MAX_TOKENS, "max_tokens")
               for p in prompts]
    return await _answer(request, "completion", "cmpl", prompts, budgets, req.sampling, req.output, arrival)


async def chat(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    s = request.app[STATE]
    req = parse_chat(await _body(request))
    s.check_model(req.model)
    s.served.text.check_stops(req.sampling.stop)
    s.served.check_stop_ids(req.sampling.stop_token_ids)
    ids = s.served.text.chat(req.messages)
    s.served.check_prompt(ids, "messages")
    budget = s.served.max_tokens(len(ids), req.sampling.max_tokens, None, "max_tokens")
    return await _answer(request, "chat", "chatcmpl", [ids], [budget], req.sampling, req.output, arrival)


async def _answer(request: web.Request, kind: str, prefix: str, prompts: list[list[int]], budgets: list[int],
                  sampling: Sampling, output: Output, arrival: float) -> web.StreamResponse:
    s = request.app[STATE]
    s.admit()
    rid = f"{prefix}-{uuid.uuid4().hex}"
    shape = Shape(kind, rid, s.served.name, int(time.time()),
                  output.return_token_ids or s.served.text.tokenizer is None, output.include_usage)
    job = Job(s.bridge, s.served, rid, prompts, budgets, sampling, arrival)
    s.jobs.add(job)
    s.metrics.in_flight.labels(s.served.name).inc()
    try:
        job.start()
        if output.stream:
            return await _stream(request, job, shape)
        while not job.done:
            await job.next()
        if any(c.error for c in job.choices):
            raise job.error()
        return web.json_response(shape.response(job.choices))
    finally:
        job.release_all(CLIENT_LEFT)  # only what is still open: the handler was cancelled or failed
        s.jobs.discard(job)
        s.metrics.in_flight.labels(s.served.name).dec()


async def _stream(request: web.Request, job: Job, shape: Shape) -> web.StreamResponse:
    pieces = await job.next()
    if all(c.error and not c.token_ids for c, _ in pieces) and pieces:
        raise job.error()  # nothing sent yet: a status code says it
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    fresh = {c.index for c in job.choices}  # choices whose first chunk has not gone out
    if shape.kind == "chat":  # the assistant's role first, as OpenAI's streams begin
        for c in job.choices:
            await send(shape.chunk(c, Piece(), first=True))
        fresh.clear()
    while True:
        for c, p in pieces:
            if c.error:
                await send(job.error().body())
                for other in job.choices:
                    job.release(other.index, f"the response ended: {c.error}")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if p.text or p.token_ids or p.finish_reason:
                await send(shape.chunk(c, p, first=c.index in fresh))
                fresh.discard(c.index)
        if job.done:
            break
        pieces = await job.next()
    if shape.include_usage:
        await send(shape.usage_chunk(job.choices))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
