"""Plots (pdlab.report.plots, plots_compare): what each figure draws, read from the matplotlib objects (lines,
bars, markers, titles, legends, tags) before it is saved, on run directories built from request records."""

import math
import os

import pytest

from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir, load_run
from pdlab.measure.search import RateSearch
from pdlab.measure.summary import summarize_run
from pdlab.report.compare import compare
from pdlab.report.load import load
from report_runs import DISAGG, UNIFIED, make, variant
from test_compare import DEPS, SLO, make_run

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def figures(run_dir):
    from pdlab.report.plot_style import pyplot
    from pdlab.report.plots import run_figures

    return dict(run_figures(pyplot(), load(run_dir)))


def _boxes(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return r, fig.bbox


def assert_readable(fig):
    """Every title inside the figure; every legend outside every axes' data area."""
    r, box = _boxes(fig)
    titles = [ax.title for ax in fig.axes if ax.title.get_text()] + ([fig._suptitle] if fig._suptitle else [])
    for t in titles:
        e = t.get_window_extent(r)
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and e.y1 <= box.y1 + 1, t.get_text()
    if fig._suptitle:  # a figure's title clear of every axes
        assert not any(fig._suptitle.get_window_extent(r).overlaps(ax.get_window_extent(r)) for ax in fig.axes)
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    for lg in legends:
        e = lg.get_window_extent(r)
        for ax in fig.axes:
            assert not e.overlaps(ax.get_window_extent(r)), [t.get_text() for t in lg.get_texts()]
    for tag in [t for t in fig.texts if t.get_text().startswith(("MODELLED", "PARTIAL"))]:  # inside, clear of the rest
        e = tag.get_window_extent(r)
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0, tag.get_text()
        for other in [*titles, *legends, *fig.axes]:
            assert not e.overlaps(other.get_window_extent(r)), (tag.get_text(), other)


def tag_texts(fig):
    return [t.get_text() for t in fig.texts]


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


def test_grid_run_plots_one_marker_per_variant_side_by_side_with_the_legend_off_the_data(tmp_path):
    from pdlab.report.plots import focus_rates, timeline_steps, write_plots

    run_dir = _add_warmup(make_run(tmp_path / "r"))
    paths = write_plots(run_dir)
    assert [os.path.basename(p) for p in paths] == ["goodput.png", "latency_cdf.png", "itl_timeline.png"]
    figs = figures(run_dir)
    ax = figs["goodput.png"].axes[0]
    drawn = {c.get_label(): c.lines[0] for c in ax.containers}  # errorbar: the data line, whiskers (1 repeat: 0)
    # saturation: 10 requests 0.1 s apart, the last one's last token at 1.17 s (unified) and 1.24 s (disagg)
    assert set(drawn) == {"unified: goodput 1.33 req/s; saturation 8.55 req/s",
                          "disagg: goodput ≥ 2.00 req/s; saturation 8.06 req/s"}
    u, d = drawn.values()
    assert u.get_marker() != d.get_marker()
    assert list(u.get_ydata()) == [100.0, 70.0] and list(d.get_ydata()) == [100.0, 100.0]
    assert all(a < b for a, b in zip(u.get_xdata(), d.get_xdata()))  # the same rates, set apart
    assert {"all at once (saturation)", "target 90%", *drawn} == {t.get_text() for t in
                                                                    figs["goodput.png"].legends[0].get_texts()}
    assert ax.title.get_text() == "SLO attainment vs rate"
    for fig in figs.values():
        assert_readable(fig)
        assert not any(t.startswith(("MODELLED", "PARTIAL")) for t in tag_texts(fig))
    lr = load(run_dir)
    assert focus_rates(lr) == {"unified": 2.0, "disagg": 2.0}
    steps = timeline_steps(lr.run, "unified", 2.0, {"unified-0"})
    assert len(steps) == 3 and not any(s.get("warmup") for s in steps)  # the 3 interrupting prefills only
    t0 = min(r["arrival"] for r in lr.run.requests if r["variant"] == "unified" and r["rate"] == 2.0
             and not r.get("warmup"))
    assert min(s["start"] for s in steps) >= t0  # nothing at negative time
    top = figs["itl_timeline.png"].axes[0]
    assert len(top.patches) == 3  # the shaded prefill steps
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert "prefill interruptions at 2 req/s, the one repeat: 3\n(compare's count, all repeats and finite rates: 3)" in labels


def test_per_repeat_counts_say_which_repeat_and_what_compare_counts(tmp_path):
    run_dir = make_run(tmp_path / "r", repeats=3)
    figs = figures(run_dir)
    labels = [t.get_text() for t in figs["itl_timeline.png"].axes[0].get_legend().get_texts()]
    assert labels[1] == ("prefill interruptions at 2 req/s, repeat 1 of 3: 3\n(compare's count, all repeats and "
                         "finite rates: 9)")
    assert "repeat 1 of 3" in figs["latency_cdf.png"]._suptitle.get_text()


def test_a_single_rate_is_drawn_as_bars_with_their_intervals(tmp_path):
    run = make(tmp_path / "r", {"budget-2048": variant(UNIFIED, lambda j, r: {"itl": 3 + j}),
                                "budget-512": variant(UNIFIED, {"itl": 1}, engine={"token_budget": 512}),
                                "budget-128": variant(UNIFIED, {}, engine={"token_budget": 128})},
               rates=(1.0,), repeats=3)
    fig = figures(run)["goodput.png"]
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.__class__.__name__ == "BarContainer"]
    assert [c.get_label().split(":")[0] for c in bars] == ["budget-2048", "budget-512", "budget-128"]
    assert [round(b.patches[0].get_height()) for b in bars] == [60, 90, 100]
    assert len({b.patches[0].get_x() for b in bars}) == 3  # side by side
    whiskers = [c for c in ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
    assert len(whiskers) == 3 and whiskers[0].lines[2][0].get_segments()[0][0][1] < 60  # the interval is drawn
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 req/s"]
    assert_readable(fig)


def test_modelled_and_partial_runs_are_tagged_on_every_plot(tmp_path):
    timing = {"timing": {"fixed_ms": 5, "prefill_token_ms": 0.5}}
    long = "unified-2xTP4-with-a-long-name"
    run = make(tmp_path / "r", {long: variant(UNIFIED, {"itl": 2}, model=timing),
                                "disagg-read": variant(DISAGG, {}, model=timing)},
               env={"simulated": True}, partial="interrupted (Ctrl-C)")
    figs = figures(run)
    assert set(figs) == {"goodput.png", "latency_cdf.png", "itl_timeline.png"}
    for name, fig in figs.items():
        texts = tag_texts(fig)
        assert "MODELLED timing: not this machine's" in texts, name
        assert "PARTIAL: r: interrupted (Ctrl-C)" in texts, name
        assert_readable(fig)


def test_marks_of_weak_intervals_reach_the_plot(tmp_path):
    run = make(tmp_path / "r", {"a": variant(UNIFIED, lambda j, r: {"itl": 9 * j if r == 2.0 else 0}),
                                "b": variant(UNIFIED, {})}, repeats=2)
    lg = figures(run)["goodput.png"].legends[0]
    assert "† interval from fewer than 3 repeats: it means little" in lg.get_title().get_text()
    assert any("†" in t.get_text() for t in lg.get_texts())


def test_plots_of_a_search_run(tmp_path):
    from pdlab.report.plots import focus_rates, timeline_steps, write_plots

    run_dir = make_search_run(tmp_path / "s")
    lr = load(run_dir)
    variants = lr.summary["variants"]
    assert {vs["mode"] for vs in variants.values()} == {"search"}
    # unified: repeat 0 passes 2, fails 3 (0.8): 2 + 0.1/0.2 = 2.5; repeat 1 passes 3 (0.9), fails 4 (0.7): 3
    assert variants["unified"]["goodput"]["values"] == pytest.approx([2.5, 3.0])
    ax = figures(run_dir)["goodput.png"].axes[0]
    blue = [line for line in ax.get_lines() if line.get_color() == "C0" and line.get_linestyle() == "None"
            and len(line.get_xdata())]
    # each repeat's trials, one marker shape per repeat (x set a little apart from the other variant's)
    assert [sorted(round(y) for y in line.get_ydata()) for line in blue[:2]] == [[60, 80, 100], [70, 90, 100]]
    assert blue[0].get_marker() != blue[1].get_marker()
    assert len([p for p in ax.patches if p.get_alpha() == 0.12]) == 2  # goodput intervals shaded (n = 2)
    assert [os.path.basename(p) for p in write_plots(run_dir)] == ["goodput.png", "latency_cdf.png",
                                                                     "itl_timeline.png"]
    # searches try different rates: each variant's latencies at its own last passing rate (first repeat)
    assert focus_rates(lr) == {"unified": 2.0, "disagg": 6.0}
    assert timeline_steps(lr.run, "unified", 2.0, {"unified-0"}) == []  # the warm-up prefill is left out
    assert len(timeline_steps(lr.run, "unified", 3.0, {"unified-0"})) == 2


def test_compare_and_slo_scale_plots(tmp_path):
    from pdlab.report.plot_style import pyplot
    from pdlab.report.plots_compare import slo_scale_figure, write_compare_plots, write_slo_scale_plot
    from pdlab.report.rescore import rescore_runs

    runs = [load(make_search_run(tmp_path / "s"))]
    res = compare(runs)
    res["slo_scale"] = rescore_runs(runs, [0.5, 1, 2, 4])
    paths = write_compare_plots(res, runs, str(tmp_path / "cmp"))
    assert [os.path.basename(p) for p in paths] == ["compare_goodput.png", "goodput_vs_slo_scale.png"]
    fig = slo_scale_figure(pyplot(), res["slo_scale"], res)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
    assert [c.get_label() for c in bars] == ["unified", "disagg"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5×", "1×", "2×", "4×"]
    assert "lower bound (no rate tried failed)" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert_readable(fig)
    one = write_slo_scale_plot(res["slo_scale"], str(tmp_path / "one"))
    assert os.path.basename(one[0]) == "goodput_vs_slo_scale.png"


def test_log_axis_labels_are_plain_and_few():
    from pdlab.report.plot_style import plain_log_axis

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
