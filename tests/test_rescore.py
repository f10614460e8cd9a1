"""SLO-scale re-scoring (pdlab.report.rescore, `pdlab compare --slo-scale`): goodput recomputed from the
request records with the TTFT and ITL targets times a scale, on synthetic run directories."""

import io
import json
import math

import pytest

from pdlab.commands.compare import main
from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir, load_run
from pdlab.measure.search import RateSearch
from pdlab.measure.summary import summarize_run
from pdlab.recipe import SLO as Slo
from pdlab.report.rescore import (by_scale, cell, parse_scales, render, rescore, rescore_run, rescore_runs,
                                  search_floors)
from test_compare import DEPS, SLO, make_run

# ---- a grid run whose numbers are easy to follow by hand ----
#
# SLO: TTFT <= 100 ms, per-request max gap <= 50 ms, attainment 0.9; 10 requests per rate, 3 tokens each.
# Each request is (TTFT ms, its larger gap ms; the other gap is 10 ms):
#
#   unified  @1: 10 x (30, 10)   @2: 8 x (30, 10) + 2 x (30, 40)   @4: 6 x (30, 10) + 4 x (30, 80)
#   disagg   @1: 10 x (40, 10)   @2: 10 x (40, 10)                 @4: 8 x (40, 10) + 2 x (150, 10)
#   both     @inf: 10 sent at once, served 10 ms apart (saturation, about 9 req/s: never a goodput point,
#                  and above every rate tried, so it caps nothing here)
#
# scale 0.25 (TTFT 25, gap 12.5): every TTFT misses: attainment 0 at rate 1 -> goodput 0, open below.
# scale 0.5  (TTFT 50, gap 25):   unified 1.0 / 0.8 / 0.6 -> 1 + (1.0 - 0.9) / (1.0 - 0.8) * (2 - 1) = 1.5
#                                 disagg  1.0 / 1.0 / 0.8 -> 2 + (1.0 - 0.9) / (1.0 - 0.8) * (4 - 2) = 3.0
# scale 1    (TTFT 100, gap 50):  unified 1.0 / 1.0 / 0.6 -> 2 + 0.1 / 0.4 * 2 = 2.5;  disagg 3.0 as above
# scale 2    (TTFT 200, gap 100): everything passes at 1, 2, 4 -> goodput >= 4 (open above) for both

PLAN = {
    "unified": {1.0: [(30, 10)] * 10, 2.0: [(30, 10)] * 8 + [(30, 40)] * 2, 4.0: [(30, 10)] * 6 + [(30, 80)] * 4},
    "disagg": {1.0: [(40, 10)] * 10, 2.0: [(40, 10)] * 10, 4.0: [(40, 10)] * 8 + [(150, 10)] * 2},
}


def make_plan_run(path, plan=PLAN, warmup=True):
    reqs = []
    for vi, (v, rates) in enumerate(plan.items()):
        for ri, rate in enumerate([*rates, math.inf]):
            cells = rates.get(rate) or [(500 + 10 * k, 10) for k in range(10)]
            for k, (ttft_ms, gap_ms) in enumerate(cells):
                a = 1000.0 * vi + 100.0 * ri + (0 if math.isinf(rate) else k / rate)
                first = a + ttft_ms / 1000
                times = [first, first + 0.01, first + 0.01 + gap_ms / 1000]
                reqs.append(build_request_record(variant=v, rate=rate, id=f"{k}", prompt_ids=[3] * 20,
                                                 output_ids=[4] * 3, arrival=a, token_times=times, slo=SLO))
            if warmup:  # a warm-up request that misses everything: re-scoring must leave it out
                reqs.append(build_request_record(variant=v, rate=rate, id="w0", prompt_ids=[3] * 20,
                                                 output_ids=[4] * 3, arrival=a - 50, token_times=[a - 40, a - 39],
                                                 slo=SLO, warmup=True))
    with RunDir(str(path)) as rd:
        rd.write_recipe({"name": "synthetic", "slo": SLO.to_raw(), "rates": [1.0, 2.0, 4.0, math.inf],
                         "workload": {"requests": 10}, "variants": {v: {"deployment": d} for v, d in DEPS.items()}})
        rd.append("requests", reqs)
        rd.write_summary(summarize_run(reqs, [], [], SLO))
    return str(path)


def test_tighter_slo_lowers_goodput_and_looser_raises_it(tmp_path):
    res = rescore_run(load_run(make_plan_run(tmp_path / "r")), [0.25, 0.5, 1, 2])
    assert res["scales"] == [0.25, 0.5, 1.0, 2.0]
    assert [(t["ttft_ms"], t["itl_ms"]) for t in res["targets"]] == [(25, 12.5), (50, 25), (100, 50), (200, 100)]
    g = by_scale(res)
    assert [g["unified"][s]["mean"] for s in (0.25, 0.5, 1.0, 2.0)] == pytest.approx([0.0, 1.5, 2.5, 4.0])
    assert [g["disagg"][s]["mean"] for s in (0.25, 0.5, 1.0, 2.0)] == pytest.approx([0.0, 3.0, 3.0, 4.0])
    u = g["unified"]
    assert u[0.25]["open_below"] and not u[0.25]["closed"]  # grid: no floor, so 0 is about the rates tried
    assert u[0.5]["closed"] and u[0.5]["brackets"] == [[1.0, 2.0]]
    assert u[1.0]["closed"] and u[1.0]["brackets"] == [[2.0, 4.0]]
    assert u[2.0]["open_above"] and not u[2.0]["closed"]
    assert (u[1.0]["n"], u[1.0]["lo"], u[1.0]["hi"]) == (1, None, None)  # one repeat: no interval
    cells = res["variants"]["unified"]
    assert [c["repeats"][0]["trials"] for c in cells][1] == [{"rate": 1.0, "attainment": 1.0},
                                                            {"rate": 2.0, "attainment": 0.8},
                                                            {"rate": 4.0, "attainment": 0.6}]
    assert cell(u[2.0]) == "≥ 4.00" and cell(u[0.5]) == "1.50" and cell(u[0.25]) == "0.00*"


def test_scale_one_is_the_summarys_goodput(tmp_path):
    for run in (load_run(make_plan_run(tmp_path / "a")), load_run(make_run(tmp_path / "b", repeats=3))):
        res = rescore_run(run, [1])
        for v, vs in run.summary["variants"].items():
            mine, theirs = res["variants"][v][0]["goodput"], vs["goodput"]
            for k in ("mean", "lo", "hi", "n", "open_above", "open_below", "closed", "monotonic", "capped",
                      "brackets"):
                assert mine[k] == pytest.approx(theirs[k]) if isinstance(theirs[k], float) else mine[k] == theirs[k], k
            assert mine["values"] == pytest.approx(theirs["values"])
            assert [r["trials"] for r in res["variants"][v][0]["repeats"]] == [r["goodput"]["trials"]
                                                                               for r in vs["repeats"]]


def test_repeats_give_an_interval_at_each_scale(tmp_path):
    # test_compare.make_run: unified TTFT 50 ms, gaps 20 ms, 3/4/2 requests per repeat with a 200 ms gap at 2 req/s
    res = rescore_run(load_run(make_run(tmp_path / "r", repeats=3)), [1, 5])
    g = by_scale(res)
    assert g["unified"][1.0]["values"] == pytest.approx([4 / 3, 1.25, 1.5])
    assert g["unified"][1.0]["lo"] < 1.36 < g["unified"][1.0]["hi"]
    # x5: TTFT 500 ms, gap 250 ms: the 200 ms gaps pass, so every finite rate passes in every repeat
    assert g["unified"][5.0]["values"] == [2.0, 2.0, 2.0] and g["unified"][5.0]["open_above"]
    assert (g["unified"][5.0]["lo"], g["unified"][5.0]["hi"]) == (2.0, 2.0)


def test_saturation_caps_goodput_at_every_scale():
    # TTFT 80 ms at 1 req/s, 150 ms at 2 req/s; all at once, 10 requests complete in 5 s: 2 req/s.
    # x1: 1.0 / 0.0 -> 1 + 0.1 / 1.0 * (2 - 1) = 1.1. x2 (TTFT 200 ms): both pass, and 2 req/s is the
    # saturation throughput: goodput 2, held there (capped), not a lower bound
    slo = Slo(ttft_ms=100.0, itl_ms=50.0, itl_stat="max", attainment=0.9)
    recs = []
    for rate, ttft in ((1.0, 0.08), (2.0, 0.15), (math.inf, None)):
        for k in range(10):
            a = 0.0 if math.isinf(rate) else k / rate
            first = a + (0.5 * k + 0.46 if ttft is None else ttft)
            recs.append(build_request_record(variant="v", rate=rate, id=str(k), prompt_ids=[1], output_ids=[2, 2],
                                             arrival=a, token_times=[first, first + 0.04], slo=slo))
    g = by_scale(rescore(recs, slo, [1, 2]))["v"]
    assert g[1.0]["mean"] == pytest.approx(1.1) and g[1.0]["brackets"] == [[1.0, 2.0]] and not g[1.0]["capped"]
    assert g[2.0]["mean"] == pytest.approx(2.0) and g[2.0]["capped"] and not g[2.0]["open_above"]
    assert cell(g[2.0]) == "2.00 sat"


def test_search_floor_makes_an_all_failing_search_closed():
    slo = Slo(ttft_ms=100.0, itl_ms=50.0, itl_stat="max", attainment=0.9)
    recs = []
    for rate in (0.1, 0.2):  # every request: TTFT 80 ms
        for k in range(10):
            recs.append(build_request_record(variant="v", rate=rate, id=str(k), prompt_ids=[1], output_ids=[2, 2],
                                             arrival=float(k), token_times=[k + 0.08, k + 0.09], slo=slo))
    # x0.5: TTFT 50 ms: 0.1 fails. At or below the search's floor it is a finding (closed), else open below
    assert by_scale(rescore(recs, slo, [0.5], floors={("v", 0): 0.1}))["v"][0.5]["closed"]
    assert by_scale(rescore(recs, slo, [0.5]))["v"][0.5]["open_below"]
    # summary.json's shape: each repeat of a search with its saturation; a grid has no floor
    summary = {"variants": {"v": {"mode": "search", "repeats": [
        {"repeat": 0, "saturation": {"request_throughput": 3.2}}, {"repeat": 1, "saturation": {"request_throughput": 1.6}},
        {"repeat": 2, "saturation": None}]},
        "g": {"mode": "grid", "repeats": [{"repeat": 0, "saturation": {"request_throughput": 3.2}}]}}}
    assert search_floors(summary, 0.9) == {("v", 0): RateSearch(0.9, 3.2).floor, ("v", 1): RateSearch(0.9, 1.6).floor}
    assert RateSearch(0.9, 3.2).floor == 0.1


def test_parse_scales():
    assert parse_scales("2, 0.5,1,1") == [0.5, 1.0, 2.0]
    for bad, why in (("abc", "not a number"), ("0", "> 0"), ("-1", "> 0"), ("", "got nothing"), ("1,,2", "not a"),
                     ("inf", "finite"), ("nan", "> 0")):
        with pytest.raises(ValueError, match=why):
            parse_scales(bad)


def test_relative_slo_without_resolved_targets_is_refused(tmp_path):
    with pytest.raises(ValueError, match="absolute targets"):
        rescore([], Slo(ttft=5.0, itl=5.0), [1])


def test_render_and_two_runs(tmp_path):
    from rich.console import Console

    runs = [load_run(make_plan_run(tmp_path / "a")), load_run(make_plan_run(tmp_path / "b"))]
    res = rescore_runs(runs, [0.25, 0.5, 1, 2])
    assert list(res["variants"]) == ["a/unified", "a/disagg", "b/unified", "b/disagg"]
    buf = io.StringIO()
    render(res, Console(file=buf, width=100))
    text = buf.getvalue()
    assert "×0.5" in text and "50/25 ms" in text and "≥ 4.00" in text and "2.50" in text and "0.00*" in text
    assert "the lowest rate tried already failed" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_command_table_json_and_bad_values(tmp_path, capsys):
    run = make_plan_run(tmp_path / "r")
    assert main([run], None, False, None, slo_scale="0.5,1,2") == 0
    out = capsys.readouterr().out
    assert "goodput by SLO scale" in out and "1.50" in out and "≥ 4.00" in out
    assert out.index("SLO met / sent by rate") < out.index("goodput by SLO scale")  # after the normal output
    assert main([run], None, True, None, slo_scale="0.5,1,2") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slo_scale"]["scales"] == [0.5, 1.0, 2.0]
    assert [c["goodput"]["mean"] for c in data["slo_scale"]["variants"]["unified"]] == pytest.approx([1.5, 2.5, 4.0])
    assert main([run], None, True, None) == 0
    assert "slo_scale" not in json.loads(capsys.readouterr().out)
    for bad in ("abc", "0", "-1", "", "1,x"):
        assert main([run], None, False, None, slo_scale=bad) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("pdlab compare: error: --slo-scale ") and captured.err.count("\n") == 1
        assert captured.out == ""


def test_command_rate(tmp_path, capsys):
    run = make_plan_run(tmp_path / "r")
    assert main([run], None, True, None, rate=1.0) == 0
    assert json.loads(capsys.readouterr().out)["focus_rate"] == "1"
    for bad in (3.0, 0.0, -1.0):
        assert main([run], None, False, None, rate=bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("pdlab compare: error: --rate ") and err.count("\n") == 1


def test_cli_slo_scale_error_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from pdlab.cli import app

    run = make_plan_run(tmp_path / "r")
    r = CliRunner().invoke(app, ["compare", run, "--slo-scale", "abc"])
    assert r.exit_code == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("pdlab compare: error: --slo-scale 'abc'")
    r = CliRunner().invoke(app, ["compare", run, "--slo-scale", "0.5,2", "--rate", "2"])
    assert r.exit_code == 0 and "by SLO scale" in r.stdout


@pytest.mark.parametrize("cmd", ["run", "compare", "doctor"])
def test_help_has_no_type_tags(cmd):
    from typer.testing import CliRunner

    from pdlab.cli import app

    r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0
    for tag in ("<bool>", "<str>", "<float>", "<list[str]>", "TEXT", "FLOAT"):
        assert tag not in r.stdout, (cmd, tag)
    if cmd == "compare":
        assert "--slo-scale" in r.stdout and "--rate" in r.stdout
    if cmd == "doctor":
        assert "megabytes" in r.stdout and "Bytes per probe" not in r.stdout
