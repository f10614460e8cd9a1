"""Plots (pdlab.report.plots) of a grid run and of a rate-search run: written, non-trivial, and drawing what
they say (checked through the helpers that choose what to draw, not by inspecting images)."""

import math
import os

import pytest

from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir, load_run
from pdlab.measure.search import RateSearch
from pdlab.measure.summary import summarize_run
from pdlab.report.compare import compare
from test_compare import DEPS, SLO, make_run

# variant -> per repeat, the rates a search measured in order, each with its number of bad requests (of 10):
# unified's have a 200 ms gap over a prefill step, disagg's a 300 ms TTFT
SEARCH = {
    "unified": [[(2.0, 0), (4.0, 4), (3.0, 2)], [(2.0, 0), (4.0, 3), (3.0, 1)]],
    "disagg": [[(2.0, 0), (4.0, 0), (8.0, 5), (6.0, 1)], [(2.0, 0), (4.0, 0), (8.0, 4), (6.0, 0)]],
}


def make_search_run(path, plan=SEARCH, warmup=True):
    """A run of `rates: auto`: per (variant, repeat) saturation (10 requests at once) then the trials of
    `plan`, with warm-up requests and steps before each rate (marked warmup: true, as the harness does)."""
    reqs, steps, floors = [], [], {}
    for vi, (v, reps) in enumerate(plan.items()):
        worker = "unified-0" if v == "unified" else "decode-0"
        workers = {"unified": worker} if v == "unified" else {"prefill": "prefill-0", "decode": worker}
        for j, trials in enumerate(reps):
            for ti, (rate, bad) in enumerate([(math.inf, 10), *trials]):
                base = 10000.0 * vi + 1000.0 * j + 100.0 * ti
                tag = {"variant": v, "rate": rate, "repeat": j}
                if warmup:  # before the first measured arrival: the timeline must leave these out
                    steps.append({**tag, "worker": worker, "role": "unified", "start": base - 5, "end": base - 4,
                                  "prefill_tokens": 1000, "decode_seqs": 0, "warmup": True})
                    reqs.append(build_request_record(variant=v, rate=rate, id="w0", prompt_ids=[3] * 20,
                                                     output_ids=[4] * 3, arrival=base - 5,
                                                     token_times=[base - 4, base - 3.9, base - 3.8], slo=SLO,
                                                     workers=workers, repeat=j, warmup=True))
                ok, last = 0, base
                for k in range(10):
                    a = base if math.isinf(rate) else base + k / rate
                    first = a + (0.3 if v == "disagg" and k < bad else 0.05)
                    if math.isinf(rate):
                        first = a + 0.05 + 0.1 * k
                    times = [first, first + 0.02, first + 0.04]
                    if v == "unified" and k < bad:
                        times[2] = times[1] + 0.2
                        steps.append({**tag, "worker": worker, "role": "unified", "start": times[1] + 0.01,
                                      "end": times[2] - 0.01, "prefill_tokens": 1500, "decode_seqs": 1})
                    reqs.append(build_request_record(variant=v, rate=rate, id=str(k), prompt_ids=[3] * 20,
                                                     output_ids=[4] * 3, arrival=a, token_times=times, slo=SLO,
                                                     workers=workers, repeat=j))
                    ok, last = ok + 1, max(last, times[-1])
                if math.isinf(rate):  # the harness's search floor: from the saturation request rate
                    floors[(v, j)] = RateSearch(SLO.attainment, ok / (last - base)).floor
    with RunDir(str(path)) as rd:
        rd.write_recipe({"name": "synthetic", "slo": SLO.to_raw(), "rates": "auto", "repeats": 2,
                         "workload": {"requests": 10}, "variants": {v: {"deployment": d} for v, d in DEPS.items()}})
        rd.append("requests", reqs)
        rd.append("steps", steps)
        rd.write_summary(summarize_run(reqs, steps, [], SLO, grid={v: "auto" for v in plan}, floors=floors))
    return str(path)


def _add_warmup(run_dir):
    """Warm-up requests and steps (before each measured rate) added to a test_compare.make_run directory."""
    run = load_run(run_dir)
    extra_r, extra_s = [], []
    for (v, rate, rep), t0 in {(r["variant"], r["rate"], r.get("repeat", 0)): r["arrival"] for r in
                               sorted(run.requests, key=lambda r: -r["arrival"])}.items():
        worker = "unified-0" if v == "unified" else "decode-0"
        extra_s.append({"variant": v, "rate": rate, "repeat": rep, "worker": worker, "role": "unified",
                        "start": t0 - 3, "end": t0 - 2.5, "prefill_tokens": 800, "decode_seqs": 0, "warmup": True})
        extra_r.append(build_request_record(variant=v, rate=rate, id="w", prompt_ids=[3] * 20, output_ids=[4] * 2,
                                            arrival=t0 - 3, token_times=[t0 - 2.5, t0 - 2.4], slo=SLO,
                                            workers={"unified": worker}, repeat=rep, warmup=True))
    with RunDir(run_dir) as rd:
        rd.append("requests", extra_r)
        rd.append("steps", extra_s)
    return run_dir


def test_plots_of_a_grid_run(tmp_path):
    pytest.importorskip("matplotlib")
    from pdlab.report.plots import focus_rates, timeline_steps, write_compare_plots, write_plots

    run_dir = _add_warmup(make_run(tmp_path / "r"))
    paths = write_plots(run_dir)
    assert [os.path.basename(p) for p in paths] == ["goodput.png", "latency_cdf.png", "itl_timeline.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    run = load_run(run_dir)
    assert focus_rates(run) == {"unified": 2.0, "disagg": 2.0}
    drawn = timeline_steps(run, "unified", 2.0, {"unified-0"})
    assert len(drawn) == 3 and not any(s.get("warmup") for s in drawn)  # the 3 interrupting prefills only
    assert any(s.get("warmup") and s["variant"] == "unified" and s["rate"] == 2.0 for s in run.steps)
    t0 = min(r["arrival"] for r in run.requests if r["variant"] == "unified" and r["rate"] == 2.0
             and not r.get("warmup"))
    assert min(s["start"] for s in drawn) >= t0  # nothing at negative time
    cmp = write_compare_plots(compare([run]), [run], str(tmp_path / "cmp"))
    assert [os.path.basename(p) for p in cmp] == ["compare_goodput.png"] and os.path.getsize(cmp[0]) > 10_000


def test_plots_of_a_search_run(tmp_path):
    pytest.importorskip("matplotlib")
    from pdlab.report.plots import focus_rates, goodput_series, timeline_steps, write_compare_plots, write_plots

    run_dir = make_search_run(tmp_path / "s")
    run = load_run(run_dir)
    variants = run.summary["variants"]
    assert {vs["mode"] for vs in variants.values()} == {"search"}
    # unified: repeat 0 passes 2, fails 3 (0.8): 2 + 0.1/0.2 = 2.5; repeat 1 passes 3 (0.9), fails 4 (0.7): 3
    assert variants["unified"]["goodput"]["values"] == pytest.approx([2.5, 3.0])
    s = goodput_series("unified", variants["unified"])
    assert s["trials"] == [[(2.0, 1.0), (3.0, 0.8), (4.0, 0.6)], [(2.0, 1.0), (3.0, 0.9), (4.0, 0.7)]]
    assert s["saturation_attainment"] == 0.0 and s["saturation_rps"] > 0
    assert s["goodput"]["n"] == 2 and s["goodput"]["lo"] is not None  # shaded band
    paths = write_plots(run_dir)
    assert [os.path.basename(p) for p in paths] == ["goodput.png", "latency_cdf.png", "itl_timeline.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    # searches try different rates: each variant's latencies at its own last passing rate (first repeat)
    assert focus_rates(run) == {"unified": 2.0, "disagg": 6.0}
    drawn = timeline_steps(run, "unified", 2.0, {"unified-0"})
    assert drawn == []  # no interruption at 2 req/s, and the warm-up prefill is left out
    assert len(timeline_steps(run, "unified", 3.0, {"unified-0"})) == 2
    res = compare([run])
    assert res["mode"] == "search"
    cmp = write_compare_plots(res, [run], str(tmp_path / "cmp"))
    assert os.path.getsize(cmp[0]) > 10_000


def test_slo_scale_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pdlab.report.plots import write_compare_plots, write_slo_scale_plot
    from pdlab.report.rescore import rescore_runs

    runs = [load_run(make_search_run(tmp_path / "s"))]
    res = compare(runs)
    res["slo_scale"] = rescore_runs(runs, [0.5, 1, 2, 4])
    paths = write_compare_plots(res, runs, str(tmp_path / "cmp"))
    assert [os.path.basename(p) for p in paths] == ["compare_goodput.png", "goodput_vs_slo_scale.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    one = write_slo_scale_plot(res["slo_scale"], str(tmp_path / "one"))
    assert os.path.basename(one[0]) == "goodput_vs_slo_scale.png" and os.path.getsize(one[0]) > 10_000


def test_log_axis_labels_are_plain_and_few():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pdlab.report.plots import plain_log_axis

    for lo, hi, expect in ((3, 4000, {"10", "100", "1000"}), (12, 90, {"20", "50"}), (18, 23, None)):
        fig, ax = plt.subplots()
        ax.plot([lo, hi], [0, 1])
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis)
        fig.canvas.draw()
        lo_v, hi_v = ax.get_xlim()
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and lo_v <= t.get_position()[0] <= hi_v]
        plt.close(fig)
        assert 1 <= len(labels) <= 7, labels
        assert all("^" not in x and "e" not in x for x in labels), labels  # no 10^3, no 1e+03
        if expect:
            assert expect <= set(labels), labels
