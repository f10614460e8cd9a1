"""pdlab serve's OpenAI API, in process: the aiohttp app and the bridge in front of one real engine (no worker
processes; tests/test_serve.py runs `pdlab serve` itself with workers).

The answers must be the engine's greedy tokens, in OpenAI's shapes (whole and streamed as server-sent events
ending in [DONE], with a usage chunk when asked); stop strings cut the text and abort the request in the
engine; a bad request gets OpenAI's JSON error with a 4xx status and never disturbs a stream in flight; the
records in the run directory are what was served; /metrics parses and its counters move."""

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine_helpers as eh
from serve_helpers import EOS, ENGINE, EngineCluster, records, served_model, serving, sse, word_tokenizer

PROMPTS = eh.prompts([12, 30], seed=5)


def reference(prompt, n):
    """The engine's greedy tokens for `prompt`, EOS ignored."""
    return eh.run(eh.engine("tiny-llama", **ENGINE), [prompt], max_tokens=n)[0]["0"]


def run(coro):
    return asyncio.run(coro)


async def post(session, url, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, (await r.text())


def test_completion_gives_the_engines_greedy_tokens_whole_and_streamed(tmp_path):
    want = [reference(p, 9) for p in PROMPTS]

    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run")) as (state, url), aiohttp.ClientSession() as s:
            base = {"max_tokens": 9, "temperature": 0, "ignore_eos": True}
            status, text = await post(s, f"{url}/v1/completions", {**base, "prompt": PROMPTS[0]})
            assert status == 200, text
            whole = json.loads(text)
            status, text = await post(s, f"{url}/v1/completions", {**base, "prompt": PROMPTS, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
            assert status == 200, text
            return whole, sse(text), state.bridge.cluster.params

    whole, events, params = run(body())
    assert whole["object"] == "text_completion" and whole["model"] == "tiny-llama"
    (c,) = whole["choices"]
    # no tokenizer (a synthetic preset): the token ids are the answer, and come without being asked for
    assert (c["token_ids"], c["text"], c["finish_reason"], c["prompt_token_ids"]) == (want[0], "", "length", PROMPTS[0])
    assert whole["usage"] == {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}
    assert all(p == {"max_tokens": 9, "temperature": 0.0, "top_p": 1.0, "seed": None, "ignore_eos": True,
                     "stop_token_ids": []} for p in params.values())
    # streamed, a batch of two prompts: chunks per choice, a usage chunk with no choices, then [DONE]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 42, "completion_tokens": 18,
                                                          "total_tokens": 60}
    assert all(e["usage"] is None and e["object"] == "text_completion" and len(e["choices"]) == 1 for e in chunks)
    for i in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert [t for ch in mine for t in ch["token_ids"]] == want[i]
        assert [ch["finish_reason"] for ch in mine] == [None] * (len(mine) - 1) + ["length"]
        assert "prompt_token_ids" in mine[0] and not any("prompt_token_ids" in ch for ch in mine[1:])
    recs = records(str(tmp_path / "run"))
    assert sorted(r["output_ids"] for r in recs) == sorted([want[0], *want])
    assert all(r["ok"] and r["finish_reason"] == "length" and len(r["token_times"]) == 9 and r["ttft"] > 0
               for r in recs)
    assert (tmp_path / "run" / "trace.json").exists() and (tmp_path / "run" / "steps.jsonl").stat().st_size > 0


def test_a_stream_without_usage_has_no_usage_field(tmp_path):
    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run")) as (_, url), aiohttp.ClientSession() as s:
            return await post(s, f"{url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "stream": True})

    status, text = run(body())
    events = sse(text)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 4
    assert all("usage" not in e for e in events[:-1])


def test_stop_token_ids_end_the_choice_with_that_token(tmp_path):
    want = reference(PROMPTS[1], 20)
    stop = next(t for i, t in enumerate(want) if i >= 2 and t not in want[:i])  # a token not seen before it

    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run")) as (_, url), aiohttp.ClientSession() as s:
            return await post(s, f"{url}/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0,
                                                          "ignore_eos": True, "stop_token_ids": [stop]})

    status, text = run(body())
    (c,) = json.loads(text)["choices"]
    n = want.index(stop) + 1
    assert (c["token_ids"], c["finish_reason"], c["stop_reason"]) == (want[:n], "stop", stop)
    assert json.loads(text)["usage"]["completion_tokens"] == n


@pytest.mark.parametrize("span", [1, 2])
def test_stop_strings_cut_the_text_and_abort_the_engine(tmp_path, span):
    """Text comes from the model's tokenizer (here word-level: token N is the word wN); a stop string ends the
    choice before it, in the whole response and in the stream (which never sends a piece of it, even when
    it spans two tokens), and the request is aborted in the engine instead of running to max_tokens."""
    tok = word_tokenizer()
    prompt = "w40 w41 w42 w43 w44 w45"
    ids = tok.encode(prompt)
    want = reference(ids, 60)
    k = next(i for i in range(3, 20) if f"w{want[i]}" not in tok.decode(want[:i]) and min(want[i:i + span]) >= 6)
    stop = " " + tok.decode(want[k:k + span])
    text_before = tok.decode(want[:k])

    async def body():
        cluster = EngineCluster()
        async with serving(cluster, str(tmp_path / "run"), tokenizer=tok) as (_, url), aiohttp.ClientSession() as s:
            base = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": [stop, "zz"]}
            whole = await post(s, f"{url}/v1/completions", base)
            streamed = await post(s, f"{url}/v1/completions", {**base, "stream": True, "return_token_ids": True})
        return whole, streamed, cluster.aborted

    (st1, t1), (st2, t2), aborted = run(body())
    c = json.loads(t1)["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (" " + text_before, "stop", stop)
    assert "token_ids" not in c  # a model with a tokenizer returns ids when asked
    events = sse(t2)[:-1]
    pieces = [e["choices"][0]["text"] for e in events]
    assert "".join(pieces) == " " + text_before and events[-1]["choices"][0]["finish_reason"] == "stop"
    served = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert served == want[:k + span]  # the token that completed the stop string is the last one served
    assert len(aborted) == 2 and all(reason.startswith("finished (stop)") for _, reason in aborted)
    recs = records(str(tmp_path / "run"))
    assert all(r["ok"] and r["finish_reason"] == "stop" and r["output_ids"] == want[:k + span] for r in recs)


def test_chat_goes_through_the_chat_template(tmp_path):
    tok = word_tokenizer()
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": [{"type": "text", "text": "w11"}]}]
    flat = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11"}]  # text parts joined
    ids = tok.encode(tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    want = reference(ids, 5)

    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run"), tokenizer=tok) as (_, url), \
                aiohttp.ClientSession() as s:
            base = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            return (await post(s, f"{url}/v1/chat/completions", base),
                    await post(s, f"{url}/v1/chat/completions", {**base, "stream": True}))

    (st1, t1), (st2, t2) = run(body())
    whole = json.loads(t1)
    c = whole["choices"][0]
    assert whole["object"] == "chat.completion" and c["prompt_token_ids"] == ids and c["token_ids"] == want
    # the text continues the prompt's: this tokenizer joins words with spaces, so it begins with one
    assert c["message"] == {"role": "assistant", "content": " " + tok.decode(want)}
    events = sse(t2)[:-1]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == " " + tok.decode(want)


def test_chat_and_text_need_a_tokenizer_and_a_template(tmp_path):
    async def body(tokenizer):
        async with serving(EngineCluster(), str(tmp_path / f"run{id(tokenizer)}"), tokenizer=tokenizer) as (_, url), \
                aiohttp.ClientSession() as s:
            chat = await post(s, f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "w7"}]})
            text = await post(s, f"{url}/v1/completions", {"prompt": "w7 w8", "max_tokens": 2})
            stop = await post(s, f"{url}/v1/completions", {"prompt": [7, 8], "max_tokens": 2, "stop": "x"})
            ids = await post(s, f"{url}/v1/completions", {"prompt": [7, 8], "max_tokens": 2})
            return chat, text, stop, ids

    chat, text, stop, ids = run(body(None))  # a synthetic preset: token ids only
    for (status, t), param in ((chat, "messages"), (text, "prompt"), (stop, "stop")):
        err = json.loads(t)["error"]
        assert status == 400 and err["param"] == param and "tokenizer" in err["message"]
    assert ids[0] == 200
    chat, text, _, _ = run(body(word_tokenizer(chat_template=False)))
    assert chat[0] == 400 and "chat template" in json.loads(chat[1])["error"]["message"]
    assert text[0] == 200


BAD = [  # (body, status, param)
    ({"max_tokens": 2}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [5, "a"], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": [5, 6], "temperature": -1}, 400, "temperature"),
    ({"prompt": [5, 6], "top_p": 0}, 400, "top_p"),
    ({"prompt": [5, 6], "seed": -3}, 400, "seed"),
    ({"prompt": [5, 6], "n": 2}, 400, "n"),
    ({"prompt": [5, 6], "logprobs": 3}, 400, "logprobs"),
    ({"prompt": [5, 6], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [5, 6], "stop_token_ids": [9999]}, 400, "stop_token_ids"),
    ({"prompt": [5, 9999]}, 400, "prompt"),
    ({"prompt": [5] * 600, "max_tokens": 1}, 400, "prompt"),  # longer than the KV pool (64 blocks of 8)
    ({"prompt": [5] * 500, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": [5, 6], "model": "gpt-4"}, 404, "model"),
]


def test_bad_requests_get_openai_errors_and_do_not_disturb_a_stream(tmp_path):
    want = reference(PROMPTS[1], 120)

    async def body():
        cluster = EngineCluster(step_s=0.003)
        async with serving(cluster, str(tmp_path / "run")) as (_, url), aiohttp.ClientSession() as s:
            stream = asyncio.ensure_future(post(s, f"{url}/v1/completions", {
                "prompt": PROMPTS[1], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}))
            while not cluster.outputs.get(next(iter(cluster.params), ""), []):  # the stream is under way
                await asyncio.sleep(0.005)
            answers = [await post(s, f"{url}/v1/completions", b) for b, _, _ in BAD]
            async with s.post(f"{url}/v1/completions", data=b"{not json") as r:
                answers.append((r.status, await r.text()))
            async with s.get(f"{url}/v1/nothing") as r:
                answers.append((r.status, await r.text()))
            async with s.post(f"{url}/v1/completions", data=b"[" + b"1," * (20 * 1024 * 1024) + b"1]") as r:
                answers.append((r.status, await r.text()))
            assert not stream.done()
            return answers, await stream

    answers, (status, text) = run(body())
    expected = [(st, p) for _, st, p in BAD] + [(400, None), (404, None), (413, None)]
    for (st, t), (want_status, param) in zip(answers, expected):
        err = json.loads(t)["error"]
        assert st == want_status and err["param"] == param, (t, want_status, param)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert status == 200
    assert [t for e in sse(text)[:-1] for t in e["choices"][0]["token_ids"]] == want


def test_api_key_guards_every_route_but_health(tmp_path):
    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run"), api_key="s3cret") as (_, url), \
                aiohttp.ClientSession() as s:
            out = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Bearer s3cret"}):
                for path in ("/v1/models", "/metrics", "/health"):
                    async with s.get(url + path, headers=headers) as r:
                        out.append((path, headers.get("Authorization"), r.status, await r.text()))
            out.append(("/v1/completions", None, *await post(s, f"{url}/v1/completions", {"prompt": [5, 6]})))
            ok = await post(s, f"{url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, key="s3cret")
            return out, ok

    out, ok = run(body())
    for path, auth, status, text in out:
        if path == "/health" or auth == "Bearer s3cret":
            assert status == 200, (path, auth, text)
        else:
            assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (path, auth, text)
    assert ok[0] == 200
    assert "s3cret" not in "".join(p.read_text() for p in (tmp_path / "run").iterdir() if p.is_file())


def metric_values(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_metrics_parse_and_count_what_was_served(tmp_path):
    async def body():
        async with serving(EngineCluster(), str(tmp_path / "run")) as (_, url), aiohttp.ClientSession() as s:
            async with s.get(f"{url}/metrics") as r:
                before = await r.text()
                ctype = r.headers["Content-Type"]
            await post(s, f"{url}/v1/completions", {"prompt": PROMPTS, "max_tokens": 7, "ignore_eos": True})
            for _ in range(500):  # a request is counted as done once the bridge has recorded it, just after
                async with s.get(f"{url}/metrics") as r:
                    after = await r.text()
                if metric_values(after).get(("vllm:request_success_total", (("finished_reason", "length"),))) == 2:
                    break
                await asyncio.sleep(0.01)
            return ctype, before, after

    ctype, before, after = run(body())
    assert ctype.startswith("text/plain; version=0.0.4")
    b, a = metric_values(before), metric_values(after)
    assert a[("vllm:generation_tokens_total", ())] - b.get(("vllm:generation_tokens_total", ()), 0) == 14
    assert a[("vllm:prompt_tokens_total", ())] == 42 and a[("vllm:prefix_cache_queries_total", ())] == 42
    assert a[("vllm:time_to_first_token_seconds_count", ())] == 2
    assert a[("vllm:inter_token_latency_seconds_count", ())] == 12
    assert a[("vllm:e2e_request_latency_seconds_count", ())] == 2
    assert a[("vllm:request_success_total", (("finished_reason", "length"),))] == 2
    assert a[("vllm:kv_cache_usage_perc", (("engine", "engine0"),))] >= 0
    assert ("vllm:num_requests_running", (("engine", "engine0"),)) in a
    assert a[("pdlab:requests_in_flight", ())] == 0
    for name in ("pdlab:prefill_interruptions", "pdlab:handover_seconds", "pdlab:handover_bytes",
                 "pdlab:transport_path", "vllm:num_requests_waiting", "vllm:prefix_cache_hits"):
        assert f"# HELP {name}" in after


def test_a_client_that_leaves_mid_stream_aborts_its_request(tmp_path):
    async def body():
        cluster = EngineCluster(step_s=0.003)
        async with serving(cluster, str(tmp_path / "run")) as (state, url):
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 400,
                                                                 "ignore_eos": True, "stream": True}) as r:
                    await r.content.readline()  # the first chunk, then the client hangs up
            for _ in range(400):
                if cluster.aborted:
                    break
                await asyncio.sleep(0.01)
            return cluster.aborted

    aborted = run(body())
    assert [reason for _, reason in aborted] == ["the client went away"]
    (rec,) = records(str(tmp_path / "run"))
    assert not rec["ok"] and rec["error"] == "the client went away" and 1 <= rec["output_len"] < 400


def test_shutdown_refuses_new_requests_and_cancels_those_in_flight(tmp_path):
    async def body():
        async with serving(EngineCluster(step_s=0.003), str(tmp_path / "run")) as (state, url), \
                aiohttp.ClientSession() as s:
            whole = asyncio.ensure_future(post(s, f"{url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 400}))
            stream = asyncio.ensure_future(post(s, f"{url}/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 400,
                                                                             "stream": True}))
            while len(state.jobs) < 2:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            state.closing = "shutting down (test)"
            new = await post(s, f"{url}/v1/completions", {"prompt": PROMPTS[0]})
            async with s.get(f"{url}/health") as r:
                health = r.status
            for job in list(state.jobs):
                job.cancel("cancelled: the server is shutting down")
            return new, health, await whole, await stream

    new, health, whole, stream = run(body())
    assert new[0] == 503 and health == 503 and whole[0] == 503
    assert json.loads(whole[1])["error"]["code"] == "cancelled"
    events = sse(stream[1])
    assert stream[0] == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert all(not r["ok"] and r["error"].startswith("cancelled") for r in records(str(tmp_path / "run")))


def test_served_model_limits_follow_the_kv_pool():
    m = served_model(kv_tokens=100)
    assert m.limit == 100 and m.max_tokens(90, None, 16, "max_tokens") == 10 and m.max_tokens(10, None, None, "x") == 90
    with pytest.raises(Exception, match="KV pool holds 100"):
        m.check_prompt([5] * 100, "prompt")
    assert EOS in m.eos_ids


def test_prefill_interruptions_and_handovers_are_counted_from_the_workers_records():
    """A gap over the ITL target counts as a prefill interruption when the worker that produced the later token
    ran a step with prefill tokens inside it; a gap spanned by decode-only steps, or under the target, does not.
    Each KV hand-over adds its copy time, its bytes and the path it took."""
    from types import SimpleNamespace

    from pdlab.api.ledger import Live, Submission
    from pdlab.api.metrics import ServeMetrics
    from pdlab.serve.events import TokenEvent

    m = ServeMetrics("tiny-llama", itl_target_s=0.05)
    live = Live(Submission("r", [1, 2, 3], {}, 10.0, lambda e: None))

    def token(t, worker="decode0"):
        m.token(live, TokenEvent("r", 7, t, len(live.token_times), False, worker, t))
        live.token_times.append(t)

    def step(start, end, prefill, worker="decode0"):
        m.step(worker, {"start": start, "end": end, "prefill_tokens": prefill, "decode_seqs": 1, "running": 1,
                        "waiting": 0, "kv_blocks_used": 3, "kv_blocks_total": 12, "preempted": 0})

    token(10.5)                          # TTFT 0.5
    step(10.50, 10.62, prefill=64)       # a prefill shares the step that produces the next token: 120 ms gap
    token(10.62)
    step(10.62, 10.70, prefill=0)        # slow, but decode only
    token(10.70)
    step(10.70, 10.73, prefill=32)       # a prefill, but the gap (30 ms) is under the target
    token(10.73)
    step(10.73, 10.90, prefill=16, worker="decode1")  # another worker's prefill
    token(10.90)
    m.transfer({"start": 1.0, "end": 1.25, "bytes": 4096, "transport": "shm", "mode": "pull", "src": "prefill0",
                "dst": "decode0", "path": "shm"})
    v = metric_values(m.render()[0].decode())
    assert v[("pdlab:prefill_interruptions_total", (("engine", "decode0"),))] == 1
    assert ("pdlab:prefill_interruptions_total", (("engine", "decode1"),)) not in v
    assert v[("vllm:inter_token_latency_seconds_count", ())] == 4
    assert v[("vllm:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert v[("vllm:kv_cache_usage_perc", (("engine", "decode0"),))] == pytest.approx(0.25)
    assert v[("pdlab:handover_seconds_sum", (("mode", "pull"), ("transport", "shm")))] == pytest.approx(0.25)
    assert v[("pdlab:handover_bytes_total", (("mode", "pull"), ("transport", "shm")))] == 4096
    assert v[("pdlab:transport_path_info", (("dst", "decode0"), ("mode", "pull"), ("path", "shm"), ("src", "prefill0"),
                                            ("transport", "shm")))] == 1
    live.done = SimpleNamespace(phases={"prefill_start": 10.1, "prefill_end": 10.4}, cached_tokens=2)
    m.done(live, "length")
    v = metric_values(m.render()[0].decode())
    assert v[("vllm:prefix_cache_hits_total", ())] == 2 and v[("vllm:prefix_cache_queries_total", ())] == 3
    assert v[("vllm:request_queue_time_seconds_sum", ())] == pytest.approx(0.1)
    assert v[("vllm:e2e_request_latency_seconds_sum", ())] == pytest.approx(0.9)
