"""compare / plots on synthetic run directories: unified has ITL misses from prefill interruptions,
disaggregated trades them for TTFT misses."""

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
from pdlab.report.compare import compare, describe_deployment, render

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


def test_describe_deployment():
    assert describe_deployment(DEPS["unified"]) == "unified 1x[cpu:0]"
    assert describe_deployment(DEPS["disagg"]) == "1P[cpu:0] + 1D[cpu:1] shm push"
    timing = {"name": "mi300x-tp4", "devices": 4}  # modelled: what each worker stands for, not its stand-in
    assert describe_deployment(DEPS["disagg"], timing) == "1P[4 dev: mi300x-tp4] + 1D[4 dev: mi300x-tp4] shm push (modelled)"
    assert describe_deployment(DEPS["unified"], timing) == "unified 1x[4 dev: mi300x-tp4] (modelled)"


def test_compare_rows_and_verdict(tmp_path):
    res = compare([load_run(make_run(tmp_path / "r"))])
    assert res["baseline"] == "unified" and res["rates"] == ["1", "2", "inf"] and res["focus_rate"] == "2"
    u, d = res["rows"]
    assert u["met"] == {"1": [10, 10], "2": [7, 10], "inf": [0, 10]}
    assert (u["itl_misses"], u["ttft_misses"], u["prefill_interruptions"]) == (3, 0, 3)  # inf is not counted
    assert (d["itl_misses"], d["ttft_misses"]) == (0, 0)
    # unified: 1 -> 1.0, 2 -> 0.7: 1 + 0.1/0.3 = 1.333; disagg passes every finite rate: >= 2
    assert u["goodput"]["mean"] == pytest.approx(4 / 3) and u["goodput"]["closed"]
    assert d["goodput"]["mean"] == 2.0 and d["goodput"]["open_above"]
    assert d["relative_goodput"] == pytest.approx(1.5)
    assert u["latencies"]["itl_p50_ms"]["mean"] == pytest.approx(20.0)
    # worst gaps at 2 req/s: 7 requests at 20 ms, 3 stalled 200 ms; p90 over requests is rank 8.1: a stall
    assert u["latencies"]["worst_gap_p90_ms"]["mean"] == pytest.approx(200.0)
    # one repeat has no interval, so no difference is claimed
    assert res["verdict"] == ["disagg vs unified: goodput ≥ 2.00 vs 1.33 req/s (1.50×), ITL misses 3 → 0, TTFT "
                              "misses 0 → 0, saturation throughput −6%: not distinguishable on this machine; a lower "
                              "bound: the rates tried never failed for disagg (one repeat has no interval: set "
                              "repeats: 3 or more to tell a difference from noise)"]


def test_repeats_give_intervals_and_a_verdict_when_they_separate(tmp_path):
    res = compare([load_run(make_run(tmp_path / "r", repeats=3))])
    u, d = res["rows"]
    # unified per repeat: 1.333 (3 misses at 2 req/s), 1.25 (4), 1.5 (2); disagg >= 2 every time
    assert u["goodput"]["values"] == pytest.approx([4 / 3, 1.25, 1.5])
    assert u["goodput"]["lo"] < 1.2 and u["goodput"]["hi"] < 2.0 and d["goodput"]["lo"] == 2.0
    assert res["verdict"] == ["disagg vs unified: goodput ≥ 2.00 ± 0.00 vs 1.36 ± 0.32 req/s (1.47×), ITL misses 9 → 0, "
                              "TTFT misses 0 → 0, saturation throughput −6%: disaggregation bought predictability, "
                              "not capacity; a lower bound: the rates tried never failed for disagg"]


def test_runs_of_different_recipes_are_not_compared(tmp_path):
    a = load_run(make_run(tmp_path / "a"))
    b = load_run(make_run(tmp_path / "b", workload={"requests": 99}))
    with pytest.raises(ValueError, match="cannot compare a with b: different workload"):
        compare([a, b])


def test_verdict_when_unified_has_no_itl_problem(tmp_path):
    res = compare([load_run(make_run(tmp_path / "r", itl_bad=(0, 0, 0), ttft_bad=(0, 5, 10)))])
    assert "no ITL problem at these rates: the unified engine is enough" in res["verdict"][0]


def test_two_runs_and_explicit_baseline(tmp_path):
    runs = [load_run(make_run(tmp_path / "a")), load_run(make_run(tmp_path / "b", itl_bad=(0, 0, 0)))]
    res = compare(runs, baseline="b/unified")
    assert [r["label"] for r in res["rows"]] == ["a/unified", "a/disagg", "b/unified", "b/disagg"]
    assert res["baseline"] == "b/unified"
    with pytest.raises(ValueError, match="baseline 'nope' not found"):
        compare(runs, baseline="nope")


def test_render_prints_a_table(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    render(compare([load_run(make_run(tmp_path / "r"))]), Console(file=buf, width=100))
    text = buf.getvalue()
    assert "7/10" in text and "1.50×" in text and "≥ 2.00" in text and "unified 1x[cpu:0]" in text
    assert "1P[cpu:0] + 1D[cpu:1] shm push" in text and "not distinguishable" in text
    assert max(len(line) for line in text.splitlines()) <= 100  # reads at 100 columns


def test_command_json_and_errors(tmp_path, capsys):
    run = make_run(tmp_path / "r")
    assert main([run], None, True, None) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][1]["variant"] == "disagg"
    assert main([str(tmp_path / "missing")], None, False, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdlab compare: error:") and err.count("\n") == 1
    assert main([run], "nope", False, None) == 2


def test_compare_recomputes_a_missing_summary(tmp_path):
    run = make_run(tmp_path / "r")
    os.remove(os.path.join(run, "summary.json"))
    res = compare([load_run(run)])
    assert res["rows"][0]["partial"] and res["rows"][0]["met"]["2"] == [7, 10]


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from pdlab.report.plots import write_compare_plots, write_plots

    run = make_run(tmp_path / "r")
    paths = write_plots(run)
    assert [os.path.basename(p) for p in paths] == ["goodput.png", "latency_cdf.png", "itl_timeline.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)
    loaded = [load_run(run)]
    assert os.path.exists(write_compare_plots(compare(loaded), loaded, str(tmp_path / "cmp"))[0])


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
    render(compare([load_run(path)]), Console(file=buf, width=100))
    out = buf.getvalue()
    assert "where prompts were prefilled" in out and "disagg: local 10, remote 10" in out  # rates 1 and 2
    assert "unified: unified" not in out
