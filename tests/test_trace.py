import json
import math

from pdlab.measure.trace import build_trace, request_phases


def records():
    reqs = [
        {"variant": "pd", "rate": 2.0, "id": "a", "arrival": 100.0, "token_times": [100.5, 100.6, 100.7],
         "prompt_len": 10, "output_len": 3, "ok": True, "slo_ok": True, "decode_worker": "decode-0",
         "phases": {"queued": 100.01, "prefill_start": 100.1, "prefill_end": 100.3, "transfer_start": 100.25,
                    "transfer_end": 100.35, "admitted": 100.4}},
        {"variant": "u", "rate": math.inf, "id": "b", "arrival": 100.0, "token_times": [100.2, 100.3],
         "ok": True, "phases": {}},
        {"variant": "u", "rate": math.inf, "id": "w", "arrival": 100.0, "token_times": [100.1], "warmup": True},
    ]
    steps = [{"variant": "u", "rate": math.inf, "worker": "unified-0", "role": "unified", "start": 100.0,
              "end": 100.2, "prefill_tokens": 10, "decode_seqs": 0, "kv_blocks_used": 4, "kv_blocks_total": 16,
              "waiting": 1, "running": 1, "preempted": 0},
             {"variant": "u", "rate": math.inf, "worker": "unified-0", "role": "unified", "start": 100.2,
              "end": 100.3, "prefill_tokens": 0, "decode_seqs": 1, "kv_blocks_used": 4, "kv_blocks_total": 16,
              "waiting": 0, "running": 1, "preempted": 0}]
    transfers = [{"variant": "pd", "rate": 2.0, "request": "a", "bytes": 2_000_000, "blocks": 2, "start": 100.25,
                  "end": 100.35, "transport": "shm", "mode": "push", "src": "prefill-0", "dst": "decode-0"}]
    return reqs, steps, transfers


def test_request_phases_are_sequential():
    reqs, _, _ = records()
    ph = request_phases(reqs[0])
    assert [p[0] for p in ph] == ["queue", "prefill", "transfer", "admission", "decode"]
    for (_, a, b), (_, c, _) in zip(ph, ph[1:]):
        assert a <= b <= c + 1e-12
    assert ph[2][1:] == (100.3, 100.35)  # exposed transfer: after prefill_end
    assert [p[0] for p in request_phases(reqs[1])] == ["ttft", "decode"]


def test_trace_is_valid_chrome_json_with_the_required_tracks():
    reqs, steps, transfers = records()
    trace = json.loads(json.dumps(build_trace(reqs, steps, transfers), allow_nan=False))
    ev = trace["traceEvents"]
    assert {e["ph"] for e in ev} <= {"X", "b", "e", "C", "M"}
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"u/unified-0 (unified)", "pd/requests", "u/requests", "pd/transfers", "run"} <= names
    step = next(e for e in ev if e["ph"] == "X" and e.get("cat") == "step")
    assert step["ts"] == 0.0 and step["dur"] == 200000.0  # microseconds from the run start
    assert step["name"] == "prefill" and step["args"]["prefill_tokens"] == 10 and step["args"]["kv_use_pct"] == 25.0
    assert {e["name"] for e in ev if e["ph"] == "C"} == {"waiting", "kv_use_pct"}
    xfer = next(e for e in ev if e.get("cat") == "transfer")
    assert xfer["dur"] == 100000.0 and abs(xfer["args"]["gb_s"] - 0.02) < 1e-9
    # async begin/end pair up per request id; warm-up requests are left out
    b = [e for e in ev if e["ph"] == "b"]
    e_ = [e for e in ev if e["ph"] == "e"]
    assert len(b) == len(e_) and all("pd/2/a" == x["id"] or "u/inf/b" == x["id"] for x in b)
    for e in ev:
        if "ts" in e:
            assert e["ts"] >= 0


def test_a_rate_run_twice_is_one_run_slice_per_repeat():
    """Repeats of a rate run apart, other rates between them: one slice per repeat, none spanning the gap."""
    reqs = [{"variant": "u", "rate": r, "repeat": rep, "id": f"{r}-{rep}", "arrival": t, "token_times": [t + 0.5],
             "ok": True, "phases": {}}
            for rep, base in ((0, 100.0), (1, 200.0)) for r, t in ((1.0, base), (2.0, base + 10.0))]
    ev = build_trace(reqs, [], [])["traceEvents"]
    run = next(e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == "run")
    slices = sorted((e["ts"], e["dur"], e["name"]) for e in ev if e["ph"] == "X" and e["pid"] == run)
    assert [n for _, _, n in slices] == ["u @ 1 req/s (repeat 1)", "u @ 2 req/s (repeat 1)",
                                         "u @ 1 req/s (repeat 2)", "u @ 2 req/s (repeat 2)"]
    assert all(d == 500000.0 for _, d, _ in slices)
    assert all(a + d <= b for (a, d, _), (b, _, _) in zip(slices, slices[1:]))  # nested in time, not overlapping
