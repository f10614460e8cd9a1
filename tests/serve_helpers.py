"""Helpers for pdlab serve's tests: an in-process cluster over one real engine (the Cluster's surface without
worker processes), a word-level tokenizer with a chat template, and the HTTP app on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from typing import Any, Optional

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import engine_helpers as eh
from pdlab.api.bridge import Bridge
from pdlab.api.ledger import Ledger
from pdlab.api.metrics import ServeMetrics
from pdlab.api.model import ServedModel
from pdlab.api.server import ServeState, build_app
from pdlab.api.text import Text
from pdlab.engine.config import RequestError, SamplingParams
from pdlab.measure.records import RunDir
from pdlab.recipe.slo import SLO
from pdlab.serve.events import RequestDone, StepEvent, TokenEvent

ENGINE = {"block_size": 8, "kv_blocks": 64, "token_budget": 256, "max_running": 16}
EOS = 2  # tiny-llama's


class EngineCluster:
    """What the bridge drives (submit, poll, abort, stop), played by one in-process engine: one step per poll,
    its tokens stamped with the step's end, as a worker stamps them. `step_s`: a pause per step, so a stream
    lasts long enough for something to happen during it."""

    def __init__(self, step_s: float = 0.0, **engine: Any):
        self.eng = eh.engine("tiny-llama", **{**ENGINE, **engine})
        self.step_s = step_s
        self.events: list = []
        self.params: dict[str, dict] = {}
        self.outputs: dict[str, list[int]] = {}
        self.aborted: list[tuple[str, str]] = []
        self.stopped = False

    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        self.params[req_id] = params
        try:
            self.eng.add(req_id, prompt_ids, SamplingParams(**params))
        except RequestError as e:
            self.events.append(RequestDone(req_id, False, str(e), [], 0, "engine0", None, {}))
            return
        self.outputs[req_id] = []

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        self.aborted.append((req_id, reason))
        if self.eng.abort(req_id):
            self.events.append(RequestDone(req_id, False, reason, self.outputs.pop(req_id), 0, "engine0", None, {}))

    def poll(self, timeout: float) -> list:
        if not self.events and self.eng.has_work():
            time.sleep(self.step_s)
            out = self.eng.step()
            if out.record is not None:
                self.events.append(StepEvent("engine0", "unified", asdict(out.record)))
            for t in out.tokens:
                self.outputs[t.req_id].append(t.token_id)
                self.events.append(TokenEvent(t.req_id, t.token_id, out.record.end, t.num_output - 1, t.finished,
                                              "engine0", time.monotonic()))
                if t.finished:
                    self.events.append(RequestDone(t.req_id, True, "", self.outputs.pop(t.req_id), t.cached_tokens,
                                                   "engine0", None, {}))
        elif not self.events:
            time.sleep(timeout)
        events, self.events = self.events, []
        return events

    def stop(self) -> None:
        self.stopped = True


def word_tokenizer(chat_template: bool = True) -> Any:
    """Words w6 .. w511 are tokens 6 .. 511 (tiny-llama's vocabulary): decoding gives ' wN' per token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, "system": 5}
    vocab.update({f"w{i}": i for i in range(6, 512)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                              "{% if add_generation_prompt %}assistant{% endif %}")
    return fast


def served_model(tokenizer: Any = None, kv_tokens: Optional[int] = None) -> ServedModel:
    return ServedModel("tiny-llama", "tiny-llama", Text(tokenizer, "tiny-llama"), frozenset({EOS}), 512, 2048,
                       kv_tokens=kv_tokens if kv_tokens is not None else ENGINE["kv_blocks"] * ENGINE["block_size"])


@contextlib.asynccontextmanager
async def serving(cluster: Any, run_dir: str, tokenizer: Any = None, api_key: Optional[str] = None):
    """The app over `cluster` on a free loopback port: yields (state, base URL). On exit the bridge stops the
    cluster and the run directory is closed (trace.json written)."""
    from aiohttp import web

    rd = RunDir(run_dir)
    metrics = ServeMetrics("tiny-llama", 0.05)
    failures: list = []
    state = ServeState(served_model(tokenizer), Bridge(cluster, Ledger(rd, "unified", SLO(ttft_ms=1000, itl_ms=50)),
                                                       metrics, failures.append), metrics, api_key)
    state.bridge.start()
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield state, f"http://{host}:{port}"
    finally:
        await runner.cleanup()
        state.bridge.stop()
    assert not failures, failures


def sse(text: str) -> list:
    """The events of a server-sent stream: JSON objects, and the final "[DONE]"; every event is one `data:`
    line followed by a blank line."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: ") and "\n" not in b, b
        data = b[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def records(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/requests.jsonl") as f:
        return [json.loads(line) for line in f]
