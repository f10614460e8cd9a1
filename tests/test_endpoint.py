"""A running server as a variant (engine.backend: endpoint), end to end with `pdlab run` and `pdlab compare`
against fake OpenAI servers (tests/data/fake_openai.py): the recipe as it is, the records of an in-house run
plus what the client saw (chunks, the server's usage), the API key sent and written nowhere, each bad
endpoint one line and exit 2 with nothing measured, a server killed mid-run a partial run."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.external.server import free_port
from test_run_faults import wait_for_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "data", "fake_openai.py")
KEY = "sk-test-5f1e9c0a7b3d"  # what the servers want; must appear in no file of a run


class FakeServer:
    def __init__(self, tmp_path, *args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = tmp_path / f"server-{self.port}.jsonl"
        self.proc = subprocess.Popen([sys.executable, FAKE, "--port", str(self.port), *args],
                                     env={**os.environ, "FAKE_OPENAI_LOG": str(self.log), **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/version", timeout=1)
                return
            except OSError as e:
                if getattr(e, "code", None):  # it answered (401 when it wants a key)
                    return
                assert self.proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
                time.sleep(0.1)

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in open(self.log)] if self.log.exists() else []

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def servers(tmp_path):
    started = []

    def start(*args, env=None):
        started.append(FakeServer(tmp_path, *args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def endpoint(server, kind="unified", devices=1, label=None, **engine):
    ep = {"devices": devices, "kind": kind} | ({"label": label} if label else {})
    return {"engine": {"backend": "endpoint", "url": server if isinstance(server, str) else server.url,
                       "model": "fake-model", **engine}, "deployment": {"endpoint": ep}}


def recipe(tmp_path, variants: dict, **over) -> str:
    raw = {"name": "ep", "seed": 0, "warmup": 1, "model": {"preset": "tiny-llama"},
           "workload": {"requests": 6, "arrival": {"kind": "poisson"}, "input_len": {"kind": "uniform", "min": 16,
                                                                                       "max": 48},
                        "output_len": {"kind": "fixed", "value": 6}},
           "rates": [20, ".inf"], "slo": {"ttft_ms": 2000, "itl_ms": 500, "itl_stat": "p99", "attainment": 0.9},
           "variants": variants} | over
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw).replace("'.inf'", ".inf"))
    return str(path)


def pdlab(*args, env=None, timeout=None):
    return pdlab_here(*args, env=env)


def measured(out) -> list[dict]:
    with open(out / "requests.jsonl") as f:
        return [r for r in map(json.loads, f) if not r.get("warmup")]


def test_two_endpoints_run_and_compare_like_any_run(tmp_path, servers):
    a = servers()
    b = servers("--chunk", "4", "--api-key-env", "FAKE_KEY", env={"FAKE_KEY": KEY})
    path = recipe(tmp_path, {"unified": endpoint(a, label="svc-a"),
                             "disagg": endpoint(b, "disaggregated", 2, api_key_env="PDLAB_TEST_KEY")})
    out = tmp_path / "run"
    p = pdlab("run", path, "--out", str(out), env={"PDLAB_TEST_KEY": KEY})
    assert p.returncode == 0, p.stderr
    recs = measured(out)
    assert len(recs) == 24 and all(r["ok"] and r["output_len"] == 6 for r in recs)
    uni = [r for r in recs if r["variant"] == "unified"]
    dis = [r for r in recs if r["variant"] == "disagg"]
    # what the server said, beside what pdlab sent and counted
    assert all(r["usage"]["prompt_tokens"] == r["prompt_len"] and r["usage"]["completion_tokens"] == 6 for r in recs)
    assert all(r["prompt_as"] == "token_ids" for r in recs)
    assert all(r["chunks"] == [1] * 6 and r["prefill_worker"] == r["decode_worker"] == "svc-a" for r in uni)
    # four tokens in the first chunk: they share its time, ITL has one gap per chunk
    for r in dis:
        assert r["chunks"] == [4, 2] and len(set(r["token_times"][:4])) == 1 and len(r["itl"]) == 1
        assert r["tpot"] == pytest.approx((r["token_times"][-1] - r["token_times"][0]) / 5)
    # the second server wants the key: every request of pdlab's carried it (the first: this test's wait for it)
    seen = [e for e in b.requests() if "auth" in e][1:]
    assert seen and all(e["auth"] for e in seen)
    info = json.load(open(out / "servers" / "disagg.json"))
    assert info["backend"] == "endpoint" and info["api_key_env"] == "PDLAB_TEST_KEY" and info["devices"] == 2
    assert info["prefix_cache_reset"]["ok"] >= 2 and info["prefix_cache_reset"]["failed"] == 0
    summary = json.load(open(out / "summary.json"))
    assert set(summary["variants"]) == {"unified", "disagg"} and not summary.get("partial")
    for dirpath, _, files in os.walk(out):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert KEY.encode() not in f.read(), f"the API key is in {name}"
    c = pdlab("compare", str(out))
    assert c.returncode == 0, c.stderr
    assert "unified" in c.stdout and "disagg" in c.stdout and KEY not in c.stdout + c.stderr
    # M/D/1 needs the number of servers that prefill: behind a URL, pdlab does not know it, and says that
    assert "disagg: no check: an endpoint: how many servers prefill behind it is not known here" in \
        " ".join(c.stdout.split())


def test_text_prompts_and_outputs_go_through_the_recipes_tokenizer(tmp_path, servers):
    model = tmp_path / "model"
    make_wordlevel_model(model)
    s = servers("--text-prompts", "--text-output", "--no-reset")
    path = recipe(tmp_path, {"svc": endpoint(s)}, model={"path": str(model)}, rates=[20])
    out = tmp_path / "run"
    p = pdlab("run", path, "--out", str(out))
    assert p.returncode == 0, p.stderr
    recs = measured(out)
    assert recs and all(r["ok"] and r["prompt_as"] == "text" and r["output_len"] == 6 for r in recs)
    assert all(r["usage"]["prompt_tokens"] == r["prompt_len"] for r in recs)  # the text said the same tokens
    assert all(r["output_ids"] == expected_tokens(r["prompt_ids"], 6) for r in recs)
    info = json.load(open(out / "servers" / "svc.json"))
    assert info["prompt_as"] == info["output_as"] == "text"
    assert info["prefix_cache_reset"]["ok"] == 0 and "404" in info["prefix_cache_reset"]["error"]


def expected_tokens(prompt, n):
    return [(sum(prompt) * 31 + 7 * i + 3) % 512 for i in range(n)]


def make_wordlevel_model(path):
    """tiny-llama's config and a tokenizer whose words are t0..t511 (what the fake server speaks)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pdlab.engine.model import preset_config

    preset_config("tiny-llama").save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)} | {"[UNK]": 512}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


@pytest.mark.parametrize("case", ["unreachable", "no key", "wrong key", "unknown model", "no stream", "key unset",
                                  "text without tokenizer"])
def test_a_bad_endpoint_is_one_line_and_exit_2(tmp_path, servers, case):
    engine, env, args = {}, {}, []
    if case in ("no key", "wrong key"):
        args = ["--api-key-env", "FAKE_KEY"]
    if case == "wrong key":
        engine, env = {"api_key_env": "PDLAB_TEST_KEY"}, {"PDLAB_TEST_KEY": "not-" + KEY}
    if case == "key unset":
        engine = {"api_key_env": "PDLAB_UNSET_KEY"}
    if case == "unknown model":
        engine = {"model": "llama-9000"}
    args += {"no stream": ["--no-stream"], "text without tokenizer": ["--text-prompts"]}.get(case, [])
    url = f"http://127.0.0.1:{free_port()}/v1" if case == "unreachable" else servers(*args, env={"FAKE_KEY": KEY}).url
    path = recipe(tmp_path, {"svc": endpoint(url, **engine)})
    out = tmp_path / "run"
    p = pdlab("run", path, "--out", str(out), env={"PDLAB_UNSET_KEY": ""} | env)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    want = {"unreachable": "unreachable", "no key": "wants an API key", "wrong key": "refused the API key",
            "unknown model": "no model 'llama-9000' there; it serves: fake-model", "no stream": "does not stream",
            "key unset": "PDLAB_UNSET_KEY is not set", "text without tokenizer": "no tokenizer"}[case]
    assert want in line and (url in line or case == "key unset"), line
    assert KEY not in line  # "wrong key": the server quoted the key it got; pdlab takes it out
    assert not (out / "requests.jsonl").exists()  # nothing measured


@pytest.mark.slow
def test_a_server_killed_mid_run_ends_it_with_partial_records(tmp_path, servers):
    s = servers("--token-s", "0.05")
    path = recipe(tmp_path, {"svc": endpoint(s)}, rates=[2],
                  workload={"requests": 20, "arrival": {"kind": "poisson"}, "input_len": {"kind": "fixed", "value": 16},
                            "output_len": {"kind": "fixed", "value": 20}})
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "pdlab.cli", "run", path, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_requests(str(out), proc)
        s.proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr
    assert "stopped answering" in stderr and s.url in stderr
    summary = json.load(open(out / "summary.json"))
    assert summary["partial"] is True
    recs = measured(out)
    assert any(r["ok"] for r in recs) and any(not r["ok"] for r in recs)
