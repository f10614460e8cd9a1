"""compare / plots on synthetic run directories: unified has ITL misses from prefill interruptions,
disaggregated trades them for TTFT misses."""

import dataclasses
import io
import json
import math
import os

import pytest

from pdlab.commands.compare import main
from pdlab.measure.metrics import build_request_record
from pdlab.measure.summary import summarize_run
from pdlab.measure.records import RunDir, load_run
from pdlab.recipe import SLO as Slo
from pdlab.report.compare import compare, render
from pdlab.report.load import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLO = Slo(ttft_ms=100.0, itl_ms=50.0, itl_stat="max", attainment=0.9)
DEPS = {"unified": {"kind": "unified", "unified": {"replicas": 1, "devices": ["cpu:0"]}},
        "disagg": {"kind": "disagg", "prefill": {"replicas": 1, "devices": ["cpu:0"]},
                   "decode": {"replicas": 1, "devices": ["cpu:1"]}, "transport": "shm", "mode": "push"}}


def make_run(path, itl_bad=(0, 3, 10), ttft_bad=(0, 0, 10), out_tok_gap=0.02, repeats=1, workload=None):
    """10 requests per rate; at rate index i, unified has itl_bad[i] requests with a 200 ms gap (over a
    prefill step), disagg has ttft_bad[i] requests with a 300 ms TTFT. With repeats, repeat j has j more
    (then fewer) unified ITL misses at rate 2: 3, 4, 2, ..."""
    reqs, steps = [], []
    for j in range(repeats):
        r_itl = list(itl_bad)
        r_itl[1] = max(0, min(10, itl_bad[1] + (0, 1, -1)[j % 3])) if itl_bad[1] else 0
        _one_repeat(reqs, steps, j, r_itl, ttft_bad, out_tok_gap)
    with RunDir(str(path)) as rd:
        rd.write_recipe({"name": "synthetic", "slo": SLO.to_raw(), "rates": [1.0, 2.0, math.inf],
                         "workload": workload or {"requests": 10},
                         "variants": {v: {"deployment": d} for v, d in DEPS.items()}})
        rd.append("requests", reqs)
        rd.append("steps", steps)
        rd.write_summary(summarize_run(reqs, steps, [], SLO))
    return str(path)


def _one_repeat(reqs, steps, repeat, itl_bad, ttft_bad, out_tok_gap):
    for v in ("unified", "disagg"):
        for i, rate in enumerate([1.0, 2.0, math.inf]):
            base = 100.0 * (i + 1) + (0 if v == "unified" else 1000) + 10000 * repeat
            for k in range(10):
                a = base + (k * 0.1 if math.isinf(rate) else k)  # all at once: arrivals 100 ms apart
                first = a + (0.3 if v == "disagg" and k < ttft_bad[i] else 0.05)
                times = [first, first + out_tok_gap, first + 2 * out_tok_gap]
                worker = "unified-0" if v == "unified" else "decode-0"
                if v == "unified" and k < itl_bad[i]:
                    times[2] = times[1] + 0.2
                    steps.append({"variant": v, "rate": rate, "repeat": repeat, "worker": worker, "role": "unified",
                                  "start": times[1] + 0.01, "end": times[2] - 0.01, "prefill_tokens": 1500,
                                  "decode_seqs": 1})
                reqs.append(build_request_record(
                    variant=v, rate=rate, id=f"{k}", prompt_ids=[3] * 20, output_ids=[4] * 3, arrival=a,
                    token_times=times, slo=SLO, workers={"unified": worker} if v == "unified" else
                    {"prefill": "prefill-0", "decode": worker}, repeat=repeat))


def _render(result):
    from rich.console import Console

    buf = io.StringIO()
    render(result, Console(file=buf, width=100))
    return buf.getvalue()


def test_configuration_is_a_footnote_keyed_by_variant_and_names_modelled_devices():
    from pdlab.recipe import load_recipe
    from pdlab.report.rows import configuration, count_devices

    mori = load_recipe(os.path.join(ROOT, "recipes", "mori-table.yaml"))
    text = configuration(mori.variants["disagg-read"])
    assert text == ("1 prefill worker on cpu:0 + 1 decode worker on cpu:1 (each modelled: 4x MI300X 192GB, TP4 "
                    "(analytic)); KV over shm (stand-in; modelled at 160 GB/s + 0.1 ms), pull; step budget 8192, "
                    "chunked prefill, prefix cache off")
    read = mori.variants["disagg-read"]
    no_link = dataclasses.replace(read, model=read.model.replace(timing=read.model.timing.replace(transfer=())))
    assert "KV over shm (stand-in; the profile models no shm link: hand-over time 0)" in configuration(no_link)
    assert configuration(mori.variants["unified-1xTP8"]).startswith(
        "1 unified worker on cpu:0 (modelled: 8x MI300X 192GB, TP8 (analytic));")
    # goodput per device counts the modelled devices (2 x TP4, 1 x TP8, TP4 + TP4), not the stand-ins
    assert {n: count_devices(v.deployment, v.model.timing) for n, v in mori.variants.items()} == dict.fromkeys(
        mori.variants, 8)
    li = load_recipe(os.path.join(ROOT, "recipes", "long-input.yaml"))
    assert configuration(li.variants["disagg-push"]) == ("1 prefill worker on cpu:0 + 1 decode worker on cpu:1; KV "
                                                         "over shm, push; step budget 2048")
    assert count_devices(li.variants["unified"].deployment) == 2
    eq = load_recipe(os.path.join(ROOT, "recipes", "equal-devices.yaml"))
    assert configuration(eq.variants["unified-1xTP2"]).startswith("1 unified worker of TP2 on cpu:0-1;")


def test_compare_rows_and_verdict(tmp_path):
    res = compare([load(make_run(tmp_path / "r"))])
    assert res["baseline"] == "unified" and res["rates"] == ["1", "2", "inf"] and res["focus_rate"] == "2"
    u, d = res["rows"]
    assert u["met"] == {"1": [10, 10], "2": [7, 10], "inf": [0, 10]}
    assert (u["itl_misses"], u["ttft_misses"], u["prefill_interruptions"]) == (3, 0, 3)  # inf is not counted
    assert (d["itl_misses"], d["ttft_misses"]) == (0, 0)
    # unified: 1 -> 1.0, 2 -> 0.7: 1 + 0.1/0.3 = 1.333; disagg passes every finite rate: >= 2
    assert u["goodput"]["mean"] == pytest.approx(4 / 3) and u["goodput"]["bound"] == "exact"
    assert d["goodput"]["mean"] == 2.0 and d["goodput"]["bound"] == "lower"
    assert d["relative_goodput"] == pytest.approx(1.5) and d["relative_bound"] == "lower"
    assert u["latencies"]["ttft_p50_ms"]["mean"] == pytest.approx(50.0)
    # worst gaps at 2 req/s: 7 requests at 20 ms, 3 stalled 200 ms; p90 over requests is rank 8.1: a stall
    assert u["latencies"]["worst_gap_p90_ms"]["mean"] == pytest.approx(200.0)
    assert u["limit"] == "ITL misses" and d["limit"] == "nothing within the rates tried"
    # one repeat has no interval, so no difference is claimed
    assert res["verdict"] == ["disagg vs unified: goodput ≥ 2.00 vs 1.33 req/s (≥ 1.50×: a lower bound), ITL misses "
                              "3 → 0, TTFT misses 0 → 0, saturation throughput −6%: not distinguishable on this "
                              "machine; a lower bound: the rates tried never failed for disagg; unified was limited "
                              "by ITL misses, disagg by nothing within the rates tried (one repeat has no interval: "
                              "set repeats: 3 or more to tell a difference from noise)"]
    v = res["verdicts"][0]
    assert (v["kind"], v["outcome"], v["ratio_bound"]) == ("disaggregation", "not_distinguishable", "lower")


def test_repeats_give_intervals_and_a_verdict_when_they_separate(tmp_path):
    res = compare([load(make_run(tmp_path / "r", repeats=3))])
    u, d = res["rows"]
    # unified per repeat: 1.333 (3 misses at 2 req/s), 1.25 (4), 1.5 (2); disagg >= 2 every time
    assert u["goodput"]["values"] == pytest.approx([4 / 3, 1.25, 1.5])
    assert u["goodput"]["lo"] < 1.2 and u["goodput"]["hi"] < 2.0 and d["goodput"]["lo"] == 2.0
    assert res["verdicts"][0]["outcome"] == "better"
    assert res["verdict"][0].startswith("disagg vs unified: goodput ≥ 2.00 ± 0.00 vs 1.36 ± 0.32 req/s (≥ 1.47×: a "
                                        "lower bound), ITL misses 9 → 0, TTFT misses 0 → 0, saturation throughput "
                                        "−6%: disaggregation bought predictability, not capacity")


def test_runs_of_different_recipes_are_not_compared(tmp_path):
    a = load(make_run(tmp_path / "a"))
    b = load(make_run(tmp_path / "b", workload={"requests": 99}))
    with pytest.raises(ValueError, match="cannot compare a with b: different workload"):
        compare([a, b])


def test_verdict_when_unified_has_no_itl_problem(tmp_path):
    res = compare([load(make_run(tmp_path / "r", itl_bad=(0, 0, 0), ttft_bad=(0, 5, 10)))])
    assert "no ITL problem at these rates: the unified engine is enough" in res["verdict"][0]


def test_two_runs_and_explicit_baseline(tmp_path):
    runs = [load(make_run(tmp_path / "a")), load(make_run(tmp_path / "b", itl_bad=(0, 0, 0)))]
    res = compare(runs, baseline="b/unified")
    assert [r["label"] for r in res["rows"]] == ["a/unified", "a/disagg", "b/unified", "b/disagg"]
    assert res["baseline"] == "b/unified" and {r["baseline"] for r in res["rows"]} == {"b/unified"}
    with pytest.raises(ValueError, match="baseline 'nope' not found"):
        compare(runs, baseline="nope")


def test_render_reads_at_100_columns(tmp_path):
    text = _render(compare([load(make_run(tmp_path / "r"))]))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "7/10" in text and "≥ 1.50×" in text and "≥ 2.00" in text and "not distinguishable" in text
    # configuration in footnotes keyed by variant, one line each, not in the table cells
    assert "  unified: 1 unified worker on cpu:0; step budget 2048" in lines
    assert any(line.startswith("  disagg: 1 prefill worker on cpu:0 + 1 decode worker on cpu:1; KV over shm, push")
               for line in lines)
    # misses in their own columns, with a one-line legend under them
    head = next(line for line in lines if "TTFT only" in line)
    assert head.split() == ["variant", "sent", "TTFT", "only", "ITL", "only", "both", "failed", "prefill", "intr."]
    unified = next(line for line in lines[lines.index(head):] if line.strip().startswith("unified"))
    assert unified.split() == ["unified", "20", "0", "3", "0", "0", "3"]
    assert any(line.strip().startswith("TTFT only / ITL only: missed that target alone") for line in lines)
    # an M/D/1 line for every row, or why not
    md = lines[next(i for i, line in enumerate(lines) if line.startswith("M/D/1")) + 1:][:2]
    assert [line.split(":")[0].strip() for line in md] == ["unified", "disagg"]
    assert all("no check:" in line for line in md)  # make_run records no one-request-alone figure


def test_command_json_carries_the_structured_verdict_and_errors_are_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "r")
    assert main([run], None, True, None) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][1]["variant"] == "disagg"
    v = out["verdicts"][0]
    assert {"kind", "timing", "outcome", "ratio", "ratio_bound", "limits", "misses", "capacity_change",
            "sentence"} <= set(v)
    assert v["sentence"] == out["verdict"][0]
    assert main([str(tmp_path / "missing")], None, False, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdlab compare: error:") and err.count("\n") == 1
    assert main([run], "nope", False, None) == 2


def test_a_partial_run_is_loud_and_compare_exits_3(tmp_path, capsys):
    """A run stopped by a worker that failed to start: the reason heads the output, and the exit code says so."""
    from report_runs import DISAGG, UNIFIED, make, variant

    reason = "worker prefill0 failed to start: AttributeError: 'Phi3Attention' object has no attribute 'q_proj'"
    run = make(tmp_path / "r", {"unified": variant(UNIFIED, {}), "disagg": variant(DISAGG, {})}, partial=reason,
               not_run=("disagg",))
    assert main([run], None, False, None) == 3
    out, err = capsys.readouterr()
    assert out.startswith("PARTIAL r: worker prefill0 failed to start") and f"PARTIAL r: {reason}" in " ".join(
        out.split())  # the whole reason, wrapped at 100 columns
    assert "disagg (not run)" in out and "no verdict: disagg did not run" in out
    assert "partial" in err and reason in err
    assert main([run], None, True, None) == 3
    assert json.loads(capsys.readouterr().out)["partial"] == [{"run": "r", "reason": reason}]


def test_a_run_that_stopped_before_measuring_anything_says_why_and_exits_3(tmp_path, capsys):
    """A worker that failed to start during calibration: summary.json holds only the reason."""
    reason = "worker unified0 failed to start: AttributeError: 'Phi3Attention' object has no attribute 'q_proj'"
    run = make_run(tmp_path / "r")
    with RunDir(run) as rd:
        rd.write_summary({"partial": True, "reason": reason, "slo": None, "variants": {}})
    os.remove(os.path.join(run, "requests.jsonl"))
    assert main([run], None, False, None) == 3
    out = capsys.readouterr().out
    assert f"PARTIAL r: {reason}" in " ".join(out.split()) and "nothing was measured" in out


def test_compare_recomputes_a_missing_summary_and_calls_it_partial(tmp_path):
    run = make_run(tmp_path / "r")
    os.remove(os.path.join(run, "summary.json"))
    res = compare([load(run)])
    assert res["rows"][0]["partial"] and res["rows"][0]["met"]["2"] == [7, 10]
    assert "no summary was written" in res["partial"][0]["reason"]


def test_intervals_are_clamped_at_zero_and_marked(tmp_path):
    """Two repeats whose TTFTs differ wildly: no negative latency anywhere, and the interval is marked as from
    fewer than 3 repeats and wider than its value, in JSON and in the table with its legend."""
    from report_runs import UNIFIED, make, variant

    run = make(tmp_path / "r", {"unified": variant(UNIFIED, lambda j, r: {"ttft": 9 if j else 0}),
                                "other": variant(UNIFIED, {})}, rates=(1.0,), repeats=2)
    res = compare([load(run)])
    p99 = res["rows"][0]["latencies"]["ttft_p99_ms"]
    assert p99["lo"] == 0.0 and p99["clamped"] and set(p99["flags"]) == {"few_repeats", "wider_than_value"}
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["variants"]["unified"]["rates"]["1"]["over_repeats"]["ttft_p99_ms"]["lo"] == 0.0
    text = _render(res)
    assert f"{p99['mean']:.0f} (0–{p99['hi']:.0f})†‡" in text
    assert "† interval from fewer than 3 repeats: it means little" in text
    assert "‡ interval wider than the value: noise at this many repeats" in text


def test_the_box_is_flagged_in_the_summary_and_compare(tmp_path):
    """One request alone far slower than the recipe expects, and a fixed rate above what it allows."""
    from report_runs import UNIFIED, make, variant

    run = make(tmp_path / "r", {"budget-2048": variant(UNIFIED, {"ttft": 10})}, rates=(1.0,),
               alone={"ttft_ms": 1864.0, "itl_ms": 2.5, "requests": 3, "devices": "cpu:0"},
               expect={"alone_ttft_ms": 190})
    box = json.load(open(os.path.join(run, "summary.json")))["box"]
    assert box["alone"]["ratio"] == pytest.approx(1864 / 190)
    assert box["over_saturation"] == [{"variant": "budget-2048", "rate": 1.0,
                                       "capacity_rps": pytest.approx(1000 / 1864),
                                       "source": "1 prefill worker(s) at 1864 ms per request alone",
                                       "modelled": False}]
    assert len(box["lines"]) == 2
    lines = _render(compare([load(run)])).splitlines()
    assert lines[0].startswith("BOX: one request alone took 1864 ms TTFT, 9.8x slower than the recipe expects")
    assert any(line.startswith("BOX: fixed rates above what the deployment serves here: budget-2048 at 1 req/s")
               for line in lines)


def test_a_fixed_rate_above_the_measured_saturation_is_flagged(tmp_path):
    """All at once, 10 requests finish 0.1 s apart (about 9.6 req/s): 20 req/s is past it, 1 req/s is not."""
    from report_runs import UNIFIED, make, variant

    run = make(tmp_path / "r", {"u": variant(UNIFIED, {})}, rates=(1.0, 20.0, math.inf))
    over = json.load(open(os.path.join(run, "summary.json")))["box"]["over_saturation"]
    assert [(o["rate"], o["source"]) for o in over] == [(20.0, "measured saturation")]
    assert over[0]["capacity_rps"] == pytest.approx(10 / 1.04)
    assert any(line.startswith("BOX: fixed rates above what the deployment serves here: u at 20 req/s")
               for line in _render(compare([load(run)])).splitlines())


def test_what_ran_is_recorded_and_shown(tmp_path):
    from pdlab.measure.finish import finalize
    from pdlab.measure.summary import DEFINITIONS, SCHEMA_VERSION

    from report_runs import make

    rd = RunDir(str(tmp_path / "r"))
    rd.write_recipe({"name": "tiny"})
    rd.write_env({"time": "2026-12-01T10:00:00+0000", "cpu_model": "Some CPU"})
    rd.append("requests", [build_request_record(variant="u", rate=1.0, id="0", prompt_ids=[1], output_ids=[2, 3],
                                                arrival=0.0, token_times=[0.05, 0.07], slo=SLO)])
    rd.append("transfers", [{"variant": "u", "rate": 1.0, "repeat": 0, "transport": "nixl", "start": 0.0, "end": 0.1,
                             "path": "UCX intra-node rma(tcp/lo)"}])
    s = finalize(rd, SLO, plots=False)
    assert s["schema_version"] == SCHEMA_VERSION and s["definitions"] == DEFINITIONS
    assert s["run"]["recipe"] == "tiny" and s["run"]["started"] == "2026-12-01T10:00:00+0000"
    assert s["run"]["ended"] and s["run"]["cpu_model"] == "Some CPU"
    assert "transfers.copy_ms" in s["definitions"] and "copy_ms" in s["variants"]["u"]["rates"]["1"]["transfers"]
    assert any("NIXL moved KV over TCP" in w for w in s["warnings"])
    text = _render(compare([load(rd.path)]))
    assert "r: recipe tiny, 2026-12-01T10:00:00+0000 → " in text and "CPU Some CPU" in text
    assert "warning: u: NIXL moved KV over TCP" in text
    assert make  # the helper module loads beside these tests


def test_a_plan_validation_run_names_what_was_ranked(tmp_path):
    plan_dir = tmp_path / "plan"
    run = make_run(plan_dir / "run")
    with open(plan_dir / "plan.json", "w") as f:
        json.dump({"recipe": "ratio", "devices": 4, "ranking": [
            {"candidate": "2P2D-push", "goodput": {"mean": 9.8}}, {"candidate": "3P1D-push", "goodput": {"mean": 8.1}},
            {"candidate": "unified-4x", "goodput": {"mean": 7.8}}, {"candidate": "1P3D-push", "goodput": {"mean": 5.5}}
        ]}, f)
    res = compare([load(run)])
    assert [r["candidate"] for r in res["plan"]["ranking"]][:2] == ["2P2D-push", "3P1D-push"]
    assert "planned by pdlab plan: 4 deployments ranked for 4 devices" in _render(res)

def test_live_view_plain_lines_and_render():
    from rich.console import Console

    from pdlab.report.live import LiveView

    out = io.StringIO()
    view = LiveView(slo=SLO, live=False, out=out, line_interval_s=1e9)
    view.plan("unified", 2.0, total=2)
    view.update_worker("unified-0", role="unified", devices="cpu:0", running=1, waiting=2, kv_used=25,
                       kv_total=100, steps=10, now=0.0)
    view.update_worker("unified-0", steps=30, now=2.0)
    r = {"ttft": 0.05, "itl": [0.02, 0.03], "slo_ok": True, "ok": True}
    view.update_requests("unified", 2.0, sent=2, records=[r])
    view.update_requests("unified", 2.0, records=[dict(r, slo_ok=False, ttft=0.25)])  # completes the rate
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # first line at once, then the completion line (interval not reached)
    assert lines[-1].startswith("[unified @ 2 req/s] 2/2 done (2 sent)") and "SLO 50%" in lines[-1]
    assert view.workers["unified-0"].steps_per_s == 10.0
    buf = io.StringIO()
    Console(file=buf, width=150).print(view.render())
    text = buf.getvalue()
    assert "unified-0" in text and "25%" in text and "1/2 (50%)" in text


def test_compare_says_where_prompts_were_prefilled(tmp_path):
    """Selective routing (or recomputed hand-overs): the summary counts prefill_route per rate, and compare
    prints one line per row that prefilled anywhere but where its layout says."""
    from rich.console import Console

    path = make_run(tmp_path / "r")
    run = load_run(path)
    for i, r in enumerate(run.requests):
        r["prefill_route"] = "unified" if r["variant"] == "unified" else ("local" if i % 2 else "remote")
    summary = summarize_run(run.requests, run.steps, [], SLO)
    assert summary["variants"]["disagg"]["rates"]["1"]["prefill_routes"] == {"local": 5, "remote": 5}
    with RunDir(path) as rd:
        rd.write_summary(summary)
    buf = io.StringIO()
    render(compare([load(path)]), Console(file=buf, width=100))
    out = buf.getvalue()
    assert "where prompts were prefilled" in out and "disagg: local 10, remote 10" in out  # rates 1 and 2
    assert "unified: unified" not in out
