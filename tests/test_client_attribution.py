"""Client-side interference attribution: from token times alone, a slow gap is a prefill interruption when
another request prefilled on the same server was between its arrival and its first token. Checked by hand
on a few records, and against the engine-side attribution on a real run of pdlab's engine."""

import os
import sys

import pytest

from cli_helpers import pdlab as pdlab_here
from pdlab.measure.attribution import attribute_gaps
from pdlab.measure.client_attribution import attribute_gaps_client, client_interference_summary
from pdlab.measure.records import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")


def req(id, arrival, times, worker="unified0", decode=None):
    return {"id": id, "arrival": arrival, "token_times": times, "prefill_worker": worker,
            "decode_worker": decode or worker}


def test_a_slow_gap_during_another_prefill_is_an_interruption():
    a = req("a", 0.0, [0.1, 0.11, 0.50, 0.51])  # slow gap 0.11 -> 0.50
    b = req("b", 0.2, [0.45, 0.46])  # arrived and got its first token inside a's gap: its prefill ran then
    gaps = attribute_gaps_client([a, b], itl_ms=100)
    assert [(g["req_id"], g["cause"], g["prefills"]) for g in gaps] == [("a", "prefill", ["b"])]
    s = client_interference_summary(gaps, [a, b])
    assert s["prefill_interruptions"] == 1 and s["requests_interrupted"] == 1


def test_prefills_elsewhere_or_outside_the_gap_do_not_count():
    a = req("a", 0.0, [0.1, 0.11, 0.50])
    other_server = req("b", 0.2, [0.45], worker="unified1")
    before = req("c", 0.0, [0.05])  # its first token came before a's gap began
    disagg = req("d", 0.2, [0.45], worker="prefill0", decode="unified0")  # prefilled on another server
    gaps = attribute_gaps_client([a, other_server, before, disagg], itl_ms=100)
    assert [g["cause"] for g in gaps] == ["other"]


@pytest.mark.slow
def test_client_side_bounds_the_engine_side_on_a_real_run(tmp_path):
    """On pdlab's engine both attributions exist for the same run: every gap the engine's steps call a
    prefill interruption, the client's windows call one too, and they agree on most gaps."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pdlab.cli", "run", TINY, "--out", str(out), "--variants", "unified",
           "--set", "rates=[40]", "--set", "workload.requests=16", "--set", "workload.output_len.value=24",
           "--set", "workload.input_len={kind: uniform, min: 200, max: 600}",
           "--set", "engine.kv_blocks=1024", "--set", "slo={ttft_ms: 5000, itl_ms: 1, itl_stat: p99}"]
    p = pdlab_here(*cmd[3:])
    assert p.returncode == 0, p.stderr
    reqs = [r for r in read_jsonl(str(out / "requests.jsonl")) if not r.get("warmup") and r["ok"]]
    steps = [s for s in read_jsonl(str(out / "steps.jsonl")) if not s.get("warmup")]
    engine = {(g["req_id"], g["index"]): g["cause"] for g in attribute_gaps(reqs, steps, 1.0)}
    client = {(g["req_id"], g["index"]): g["cause"] for g in attribute_gaps_client(reqs, 1.0)}
    assert engine.keys() == client.keys()
    interrupted = [k for k, c in engine.items() if c == "prefill"]
    assert interrupted, "the workload should interrupt some decodes"
    assert all(client[k] == "prefill" for k in interrupted)
    agree = sum((engine[k] == "prefill") == (client[k] == "prefill") for k in engine) / len(engine)
    assert agree >= 0.7, agree
