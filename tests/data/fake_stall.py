"""An OpenAI-compatible server double with an engine's step loop, for pdlab diagnose's tests: decodes stall
while a prompt is prefilled beside them, as in a unified engine, or not, as in a disaggregated one.

One engine loop runs steps: each step prefills the waiting request at the head of the queue (whole, or a
chunk of at most --chunk tokens) and gives every running stream one token; it lasts
--step-ms + --prefill-ms-per-1k * prefill tokens / 1000 (asyncio.sleep: the server stays responsive). With
--disagg a second loop does the prefills, so decode steps never carry prefill tokens.

    python fake_stall.py --port P [--model NAME] [--max-model-len N] [--disagg] [--chunk B] [--step-ms MS]
                         [--prefill-ms-per-1k MS] [--record DIR] [--no-metrics] [--api-key-env VAR]

--record DIR writes what the server did as a pdlab serve run directory has it: DIR/steps.jsonl (start, end,
prefill_tokens, decode_seqs, worker) and DIR/requests.jsonl (id `<response id>-0`, decode_worker), the truth the
tests hold pdlab diagnose's tags against. $FAKE_STALL_LOG: one JSON line per HTTP request (path, prompt_len,
max_tokens, t: its time.monotonic() on arrival). GET /fake/stats: {"max_inflight": the most completions open at
once, "inflight": those open now}.
"""

import argparse
import asyncio
import itertools
import json
import os
import time
from collections import deque

from aiohttp import web

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--model", default="fake-model")
p.add_argument("--max-model-len", type=int, default=None)
p.add_argument("--disagg", action="store_true")
p.add_argument("--chunk", type=int, default=0)
p.add_argument("--step-ms", type=float, default=4.0)
p.add_argument("--prefill-ms-per-1k", type=float, default=60.0)
p.add_argument("--record", default=None)
p.add_argument("--no-metrics", action="store_true")
p.add_argument("--api-key-env", default=None)
args = p.parse_args()
KEY = os.environ[args.api_key_env] if args.api_key_env else None
IDS = itertools.count()
STATS = {"inflight": 0, "max_inflight": 0}
if args.record:
    os.makedirs(args.record, exist_ok=True)


def write(name: str, rec: dict) -> None:
    if name == "log":
        path = os.environ.get("FAKE_STALL_LOG")
        rec = {**rec, "t": time.monotonic()}
    else:
        path = os.path.join(args.record, f"{name}.jsonl") if args.record else None
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class Req:
    def __init__(self, rid: str, prompt_len: int, max_tokens: int):
        self.rid, self.left, self.max_tokens = rid, prompt_len, max_tokens
        self.out: asyncio.Queue = asyncio.Queue()
        self.sent = 0
        self.gone = False


class Engine:
    """One worker's step loop. `hand_to`: the decode engine a prefilled request moves to (disaggregated);
    None: it decodes here (unified)."""

    def __init__(self, name: str, hand_to=None):
        self.name, self.hand_to = name, hand_to
        self.waiting: deque = deque()
        self.running: list = []
        self.wake = asyncio.Event()

    def add(self, r: Req, prefill: bool) -> None:
        (self.waiting if prefill else self.running).append(r)
        self.wake.set()

    async def loop(self) -> None:
        while True:
            self.running = [r for r in self.running if not r.gone]
            while self.waiting and self.waiting[0].gone:
                self.waiting.popleft()
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            head = self.waiting[0] if self.waiting else None
            chunk = 0 if head is None else (min(head.left, args.chunk) if args.chunk else head.left)
            decoding = list(self.running)
            start = time.monotonic()
            await asyncio.sleep((args.step_ms + args.prefill_ms_per_1k * chunk / 1000.0) / 1000.0)
            end = time.monotonic()
            write("steps", {"worker": self.name, "start": start, "end": end, "prefill_tokens": chunk,
                            "decode_seqs": len(decoding)})
            for r in decoding:
                self.emit(r)
            if head is not None:
                head.left -= chunk
                if head.left <= 0:
                    self.waiting.popleft()
                    self.emit(head)  # the first token comes with the end of the prefill
                    if not head.gone and head.sent < head.max_tokens:
                        (self.hand_to or self).add(head, prefill=False)

    def emit(self, r: Req) -> None:
        if r.gone or r.sent >= r.max_tokens:
            return
        r.sent += 1
        r.out.put_nowait(r.sent)
        if r.sent >= r.max_tokens and r in self.running:
            self.running.remove(r)


async def start_engines(app: web.Application) -> None:
    if args.disagg:
        decode = Engine("decode0")
        app["engine"] = Engine("prefill0", hand_to=decode)
        app["decode"] = decode.name
        app["tasks"] = [asyncio.create_task(e.loop()) for e in (app["engine"], decode)]
    else:
        app["engine"] = Engine("engine0")
        app["decode"] = "engine0"
        app["tasks"] = [asyncio.create_task(app["engine"].loop())]
    app["all"] = [app["engine"]] + ([decode] if args.disagg else [])


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@web.middleware
async def auth(request: web.Request, handler):
    if KEY is not None and request.path != "/fake/stats" and request.headers.get("Authorization") != f"Bearer {KEY}":
        return error(401, "missing or wrong API key")
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    write("log", {"path": request.path})
    card = {"id": args.model, "object": "model"}
    if args.max_model_len:
        card["max_model_len"] = args.max_model_len
    return web.json_response({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    write("log", {"path": request.path})
    return web.json_response({"version": "fake-stall-1"})


async def metrics(request: web.Request) -> web.Response:
    write("log", {"path": request.path})
    if args.no_metrics:
        return error(404, "Not Found")
    running = sum(len(e.running) for e in request.app["all"])
    waiting = sum(len(e.waiting) for e in request.app["all"])
    return web.Response(text=f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\"}} "
                             f"{running}.0\nvllm:num_requests_waiting{{engine=\"0\"}} {waiting}.0\n")


async def stats(_: web.Request) -> web.Response:
    return web.json_response({"max_inflight": STATS["max_inflight"], "inflight": STATS["inflight"]})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt, n = body.get("prompt"), int(body.get("max_tokens") or 16)
    plen = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
    write("log", {"path": request.path, "prompt_len": plen, "max_tokens": n})
    if body.get("model") != args.model:
        return error(404, f"The model `{body.get('model')}` does not exist.")
    if args.max_model_len and plen + n > args.max_model_len:
        return error(400, f"{plen} + {n} tokens is over this model's context of {args.max_model_len}")
    rid = f"cmpl-{next(IDS)}"
    r = Req(rid, plen, n)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    STATS["inflight"] += 1
    STATS["max_inflight"] = max(STATS["max_inflight"], STATS["inflight"])
    request.app["engine"].add(r, prefill=True)
    try:
        while r.sent < n or not r.out.empty():
            k = await r.out.get()
            c = {"index": 0, "text": f" t{k}", "token_ids": [k], "finish_reason": "length" if k >= n else None}
            await resp.write(f"data: {json.dumps({'id': rid, 'choices': [c]})}\n\n".encode())
            if k >= n:
                break
        usage = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
        await resp.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
                         .encode())
        await resp.write_eof()
    finally:
        r.gone = True
        STATS["inflight"] -= 1
        write("requests", {"id": f"{rid}-0", "decode_worker": request.app["decode"], "prompt_len": plen})
    return resp


app = web.Application(middlewares=[auth])
app.on_startup.append(start_engines)
app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/version", version),
                web.get("/metrics", metrics), web.get("/fake/stats", stats)])
print(f"fake stall server on 127.0.0.1:{args.port}", flush=True)
web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
