"""A running OpenAI-compatible server for the endpoint tests, on aiohttp: /v1/models, /v1/completions (streamed
or not, prompts as token ids or text), /version, /reset_prefix_cache. Tokens are a function of the prompt:
token i of prompt P is (sum(P) * 31 + 7 * i + 3) % 512, as in fake_vllm.py; a text prompt "t5 t9" is the ids
[5, 9], and output token k is streamed as the text " tk" (a WordLevel tokenizer of words t0..t511 reads it).

    python fake_openai.py --port P [--model NAME ...] [switches]
      --api-key-env VAR   require "Authorization: Bearer $VAR" on every route (401 without, 403 when wrong,
                          quoting the header it got)
      --text-prompts      refuse token-id prompts with 400, as a server without that extension does
      --text-output       stream text only (no token_ids in chunks)
      --no-stream         answer stream: true with one JSON body
      --no-reset          no /reset_prefix_cache (404)
      --token-s S         seconds between chunks (default 0.002)
      --chunk K           tokens per chunk (default 1)
      --hold N            start streams of more than 2 tokens (not pdlab's probe) only once N of them are open
                          (at most 30 s), so that a client that cannot open N at once shows it in /fake/stats
GET /fake/stats: {"max_inflight": the most streams of more than 2 tokens open at once}.
Every request it served is appended to $FAKE_OPENAI_LOG (one JSON line: path, model, prompt type,
authorization present) when that is set.
"""

import argparse
import asyncio
import json
import os

from aiohttp import web

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--model", action="append", default=None)
p.add_argument("--api-key-env", default=None)
p.add_argument("--text-prompts", action="store_true")
p.add_argument("--text-output", action="store_true")
p.add_argument("--no-stream", action="store_true")
p.add_argument("--no-reset", action="store_true")
p.add_argument("--token-s", type=float, default=0.002)
p.add_argument("--chunk", type=int, default=1)
p.add_argument("--hold", type=int, default=0)
args = p.parse_args()
MODELS = args.model or ["fake-model"]
KEY = os.environ[args.api_key_env] if args.api_key_env else None
STATS = {"inflight": 0, "max_inflight": 0}
HELD = asyncio.Event()


def tokens(prompt: list, n: int) -> list:
    return [(sum(prompt) * 31 + 7 * i + 3) % 512 for i in range(n)]


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


def log(entry: dict) -> None:
    if os.environ.get("FAKE_OPENAI_LOG"):
        with open(os.environ["FAKE_OPENAI_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\n")


@web.middleware
async def auth(request: web.Request, handler):
    given = request.headers.get("Authorization")
    log({"path": request.path, "auth": given is not None})
    if KEY is not None:
        if not given:
            return error(401, "missing API key")
        if given != f"Bearer {KEY}":
            return error(403, f"wrong API key: {given}")  # echoed, as a careless server might
    return await handler(request)


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]})


async def version(_: web.Request) -> web.Response:
    return web.json_response({"version": "fake-openai-1"})


async def stats(_: web.Request) -> web.Response:
    return web.json_response({"max_inflight": STATS["max_inflight"]})


async def reset(_: web.Request) -> web.Response:
    return error(404, "Not Found") if args.no_reset else web.json_response({})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") not in MODELS:
        return error(404, f"The model `{body.get('model')}` does not exist.")
    prompt, n = body.get("prompt"), int(body.get("max_tokens") or 16)
    if isinstance(prompt, str):
        ids = [int(w[1:]) for w in prompt.split() if w.startswith("t") and w[1:].isdigit()]
    elif isinstance(prompt, list) and not args.text_prompts:
        ids = [int(t) for t in prompt]
    else:
        return error(400, "prompt must be a string")
    log({"path": request.path, "prompt": "text" if isinstance(prompt, str) else "token_ids", "len": len(ids)})
    out = tokens(ids, n)
    usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    def choice(toks: list, last: bool) -> dict:
        c = {"index": 0, "text": "".join(f" t{t}" for t in toks), "finish_reason": "length" if last else None}
        if not args.text_output:
            c["token_ids"] = toks
        return c

    if not body.get("stream") or args.no_stream:
        return web.json_response({"id": "cmpl-fake", "object": "text_completion", "model": body["model"],
                                  "choices": [choice(out, True)], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    held = n > 2
    STATS["inflight"] += held
    STATS["max_inflight"] = max(STATS["max_inflight"], STATS["inflight"])
    if STATS["inflight"] >= args.hold:
        HELD.set()
    k = max(1, args.chunk)
    try:
        if held:
            try:
                await asyncio.wait_for(HELD.wait(), 30.0)
            except asyncio.TimeoutError:
                HELD.set()
        for i in range(0, n, k):
            await asyncio.sleep(args.token_s)
            event = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice(out[i:i + k], i + k >= n)]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    finally:
        STATS["inflight"] -= held
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


app = web.Application(middlewares=[auth])
app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/version", version),
                web.post("/reset_prefix_cache", reset), web.get("/fake/stats", stats)])
print(f"fake OpenAI server on {args.host}:{args.port}", flush=True)
web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, backlog=1024)
