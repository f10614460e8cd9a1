import json
import math
import os

import pytest
import yaml

from pdlab.measure.records import RunDir, RunDirError, collect_env, default_run_path, dumps, load_run, read_jsonl


def test_writes_and_reads_back_a_run(tmp_path):
    path = str(tmp_path / "run")
    with RunDir(path) as rd:
        rd.write_recipe({"name": "t", "rates": [1.0, math.inf]})
        rd.write_env({"python": "3.11"})
        rd.append("requests", [{"variant": "u", "rate": math.inf, "id": "a"}, {"variant": "u", "rate": 2.0, "id": "b"}])
        rd.append("requests", [{"variant": "u", "rate": 2.0, "id": "c"}])
        rd.append("steps", [{"worker": "u0", "start": 0.0, "end": 0.1}])
        rd.write_summary({"partial": False, "variants": {}})
        rd.write_trace({"traceEvents": []})
    text = open(os.path.join(path, "requests.jsonl")).read()
    assert '"inf"' in text and "Infinity" not in text  # strict JSON, readable without pdlab
    run = load_run(path)
    assert [r["id"] for r in run.requests] == ["a", "b", "c"]
    assert run.requests[0]["rate"] == math.inf
    assert run.recipe["rates"] == [1.0, math.inf]
    assert run.env == {"python": "3.11"} and run.transfers == []
    assert not any(n.endswith(".tmp") or ".tmp" in n for n in os.listdir(path))  # atomic writes left no temp files


def test_partial_marker(tmp_path):
    rd = RunDir(str(tmp_path / "r"))
    rd.mark_partial("interrupted (Ctrl-C) during variant disagg, rate 4")
    s = json.load(open(rd.file("summary.json")))
    assert s == {"partial": True, "reason": "interrupted (Ctrl-C) during variant disagg, rate 4"}
    rd.write_summary({"variants": {"u": {}}, "partial": False})
    rd.mark_partial("worker decode-0 died")
    s = json.load(open(rd.file("summary.json")))
    assert s["partial"] and s["variants"] == {"u": {}}


def test_torn_last_line_is_skipped_but_corruption_in_the_middle_is_an_error(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    assert [r["a"] for r in read_jsonl(str(p))] == [1, 2]
    p.write_text('{"a": 1}\nbroken\n{"a": 3}\n')
    with pytest.raises(RunDirError):
        read_jsonl(str(p))


def test_load_run_rejects_non_runs(tmp_path):
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(str(tmp_path / "nope"))
    with pytest.raises(RunDirError, match="not a pdlab run directory"):
        load_run(str(tmp_path))


def test_default_run_path_is_unique(tmp_path):
    a = default_run_path("long-input", root=str(tmp_path))
    os.makedirs(a)
    b = default_run_path("long-input", root=str(tmp_path))
    assert os.path.basename(a).startswith("long-input-") and b != a


def test_dumps_is_strict_json():
    assert json.loads(dumps({"x": [math.inf, float("nan"), 1.5]})) == {"x": ["inf", None, 1.5]}


def test_collect_env_has_the_basics():
    env = collect_env()
    for k in ("python", "host", "cpu_count", "memory_bytes", "torch_version", "transformers_version", "cuda"):
        assert k in env
    json.dumps(env)
    yaml.safe_dump(env)


def test_finalize_summary_equals_a_recomputation_from_requests_jsonl(tmp_path):
    from pdlab.measure.finish import finalize
    from pdlab.measure.metrics import build_request_record
    from pdlab.measure.summary import run_info, summarize_run

    from pdlab.recipe import SLO

    slo = SLO(ttft_ms=100.0, itl_ms=50.0, itl_stat="p99", attainment=0.9)
    rd = RunDir(str(tmp_path / "r"))
    for rate in (1.0, math.inf):
        rd.append("requests", [build_request_record(variant="u", rate=rate, id=str(i), prompt_ids=[1, 2],
                                                    output_ids=[3, 4], arrival=i * 0.1, slo=slo,
                                                    token_times=[i * 0.1 + 0.05, i * 0.1 + 0.09 + 0.03 * i],
                                                    workers={"unified": "unified-0"}) for i in range(4)])
        rd.append("steps", [{"variant": "u", "rate": rate, "worker": "unified-0", "role": "unified", "start": 0.0,
                             "end": 0.05, "prefill_tokens": 8, "decode_seqs": 0}])
    summary = finalize(rd, slo, grid={"u": [1.0, math.inf, 2.0]}, partial=True, reason="stopped at rate 2",
                       plots=False)
    on_disk = json.load(open(rd.file("summary.json")))
    run = load_run(rd.path)
    again = json.loads(dumps(summarize_run(run.requests, run.steps, run.transfers, slo, partial=True,
                                           reason="stopped at rate 2", run=run_info(run))))
    assert on_disk == again == json.loads(dumps(summary))
    assert on_disk["partial"] and list(on_disk["variants"]["u"]["rates"]) == ["1", "inf"]
    assert json.load(open(rd.file("trace.json")))["traceEvents"]
