"""A forecast's band (pdlab.sim.band) from its profile's drift (pdlab.timing.drift, `pdlab profile --check RUN
--write-drift`): each worker's pace against the profile in each rate of a checked run, kept in the profile; a
simulation from it runs again with every worker at the slow and the fast end and at the drift's median (the band's
centre), and a later run's figures are held against that band (pdlab.timing.replay.covered)."""

import pytest
import yaml

from cli_helpers import pdlab
from pdlab.constants import DRIFT_KEEP, DRIFT_MIN_FACTORS
from pdlab.measure.slots import slots_warning
from pdlab.recipe import load_profile, parse_recipe
from pdlab.recipe.timing import Drift, TimingProfile
from pdlab.sim.band import forecast_band, lines
from pdlab.sim.experiment import simulate_recipe
from pdlab.timing.drift import merged, run_factors
from pdlab.timing.replay import TARGETS, covered, figures, within
from pdlab.timing.write import write_profile
from pdlab.workload import build_workload
from test_replay import PROFILE, fake_run, recipe


def forecast(profile: TimingProfile) -> tuple[object, dict]:
    """The recipe simulated from `profile`, and its band."""
    r = parse_recipe(recipe(profile))
    wl = {n: build_workload(v) for n, v in r.variants.items()}
    res = simulate_recipe(r, wl)
    return res, forecast_band(res.recipe, res.slo, wl)


def test_a_drift_keeps_its_latest_paces_and_gives_a_band_once_it_has_enough():
    d = Drift()
    assert d.band() is None and d.to_raw() == {} and d.describe().startswith("its drift has 0 of the 4 paces")
    d = merged(d, [1.0] * (DRIFT_MIN_FACTORS - 1))
    assert d.band() is None and d.median() is None and d.runs == 1
    d = merged(d, [0.8, 0.9, 1.1, 1.2] + [1.0] * 6)
    assert d.runs == 2 and d.band()[0] < 1.0 < d.band()[1] and 0.8 <= d.band()[0] and d.band()[1] <= 1.2
    assert d.median() == pytest.approx(1.0)
    d = merged(d, [2.0] * (DRIFT_KEEP + 5))
    assert len(d.factors) == DRIFT_KEEP and set(d.factors) == {2.0} and d.band() == (2.0, 2.0)
    assert TimingProfile.from_raw(PROFILE.replace(drift=d).to_raw(), "p").drift == d  # the file round-trips
    with pytest.raises(Exception, match="drift"):
        TimingProfile.from_raw({**PROFILE.to_raw(), "drift": {"factors": [1.0, -1.0]}}, "p")


def test_a_runs_paces_are_each_workers_steps_over_the_profile_rate_by_rate(tmp_path):
    run = fake_run(PROFILE.scaled(1.3), tmp_path)  # a box 1.3x slower than the profile, throughout
    f = run_factors(PROFILE, run.steps, ["unified", "pd"])
    assert len(f) == 3 * 2 and all(x == pytest.approx(1.3) for x in f)  # 3 workers x 2 rates
    assert len(run_factors(PROFILE, run.steps, ["pd"])) == 4 and run_factors(PROFILE, run.steps, []) == []
    warm = [dict(s, warmup=True, end=s["start"] + 9 * (s["end"] - s["start"])) for s in run.steps[:8]]
    assert run_factors(PROFILE, run.steps + warm, ["unified", "pd"]) == f  # warm-up steps are not the run's


def test_a_band_at_the_runs_own_pace_holds_the_run_and_the_point_forecast_does_not(tmp_path):
    run = fake_run(PROFILE.scaled(1.3), tmp_path)
    real = figures(run.requests, run.summary)
    drifted = PROFILE.replace(drift=merged(Drift(), run_factors(PROFILE, run.steps, ["unified", "pd"])))
    res, band = forecast(drifted)
    assert band["variants"]["pd"]["pace"] == [pytest.approx(1.3)] * 2 and band["variants"]["pd"]["runs"] == 1
    rows = covered(real, band)
    assert {(r["variant"], r["rate"]) for r in rows} == {(v, t) for v in ("unified", "pd") for t in ("20", "inf")}
    for r in rows:  # the same simulator at the run's own pace: the run's figures, to rounding
        for k in ("ttft_p50", "ttft_p90", "itl_p90", "attainment") + (("saturation",) if r["rate"] == "inf" else ()):
            assert r[k]["lo"] == pytest.approx(r[k]["real"], rel=1e-6, abs=1e-9), (r["variant"], r["rate"], k)
    assert all(a == b for a, b in within(rows).values())
    # the band's centre, at the drift's median (every pace x1.3 here), is the run's figures too
    for v in real:
        for tag, x in real[v].items():
            for k in ("ttft_p50", "ttft_p90", "itl_p90", "attainment", "output_tok_s"):
                assert band["mid"][v][tag][k] == pytest.approx(x[k], rel=1e-6, abs=1e-9), (v, tag, k)
    # the point forecast, at the profile's pace, is 1.3x too fast: its saturation misses beyond the target
    s = res.summary()
    sim = figures(res.requests, s)
    assert all(sim[v]["inf"]["output_tok_s"] > (1 + TARGETS["saturation"]) * real[v]["inf"]["output_tok_s"]
               for v in real)


def test_a_wider_drift_orders_the_band_and_a_run_beyond_it_is_named(tmp_path):
    _, band = forecast(PROFILE.replace(drift=Drift(factors=(0.9,) * 4 + (1.5,) * 4, runs=2)))
    assert band["variants"]["unified"]["pace"] == [pytest.approx(0.9), pytest.approx(1.5)]
    for v in ("unified", "pd"):  # slower steps: later tokens, less throughput; the centre (x1.2) between
        assert band["lo"][v]["inf"]["ttft_p50"] < band["mid"][v]["inf"]["ttft_p50"] < band["hi"][v]["inf"]["ttft_p50"]
        assert band["lo"][v]["inf"]["output_tok_s"] > band["mid"][v]["inf"]["output_tok_s"] > \
            band["hi"][v]["inf"]["output_tok_s"]
    run = fake_run(PROFILE.scaled(1.2), tmp_path)
    rows = covered(figures(run.requests, run.summary), band)
    sat = [r["saturation"] for r in rows if "saturation" in r]
    assert len(sat) == 2 and all(x["inside"] and x["ok"] and x["lo"] < x["real"] < x["hi"] for x in sat)
    far = fake_run(PROFILE.scaled(3.0), tmp_path)  # a box far slower than any run the profile was checked with
    rows = covered(figures(far.requests, far.summary), band)
    assert not any(r["saturation"]["ok"] for r in rows if "saturation" in r)
    assert within(rows, "inside")["saturation"] == (0, 2)
    text = lines(band, parse_recipe(recipe(PROFILE.replace(drift=Drift(factors=(0.9,) * 4 + (1.5,) * 4, runs=2)))))
    assert text[0].startswith("forecast band (simulated, not measured)") and "x0.90-1.50" in text[0]
    assert any(ln.strip().startswith("pd @ inf req/s: TTFT p50") and "tok/s" in ln for ln in text)
    mid = band["mid"]["pd"]["inf"]
    (pd_inf,) = [ln for ln in text if ln.strip().startswith("pd @ inf req/s")]
    assert f"({mid['ttft_p50']:.0f}) ms" in pd_inf and f"({mid['output_tok_s']:.0f}) tok/s" in pd_inf
    assert "in brackets at the drift's median" in text[0]
    assert band["variants"]["pd"]["median"] == pytest.approx(1.2)
    assert sum("note: the runs checked with profile box stepped x1.20" in ln for ln in text) == 1  # its median


def test_the_bands_centre_is_the_forecast_at_the_drifts_median_not_at_the_middle_of_its_ends():
    """A lopsided drift (median x1.0, ends x0.9 and x1.5): the centre is the recipe with every worker at x1.0,
    the low end of a drift of x1.0 alone, not at the ends' mean (x1.2). A band without a centre (a summary.json
    written before it) prints as before, without brackets."""
    lopsided = Drift(factors=(0.9, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5, 1.5), runs=2)
    assert lopsided.median() == pytest.approx(1.0)
    _, band = forecast(PROFILE.replace(drift=lopsided))
    _, flat = forecast(PROFILE.replace(drift=Drift(factors=(1.0,) * 8, runs=2)))
    assert band["mid"] == flat["lo"] == flat["mid"]
    assert band["mid"]["pd"]["inf"]["ttft_p50"] < band["hi"]["pd"]["inf"]["ttft_p50"]
    old = {k: v for k, v in band.items() if k != "mid"}
    text = lines(old, parse_recipe(recipe(PROFILE.replace(drift=lopsided))))
    (pd_inf,) = [ln for ln in text if ln.strip().startswith("pd @ inf req/s")]
    assert "(" not in pd_inf


def _band_of(medians: dict[str, float]) -> dict:
    """A forecast band with only what its heading and notes read: each variant's pace and drift median."""
    return {"levels": [0.05, 0.95], "lo": {}, "hi": {}, "goodput": {"lo": {}, "hi": {}},
            "variants": {v: {"pace": [m * 0.9, m * 1.1], "median": m, "paces": 8, "runs": 2}
                         for v, m in medians.items()}}


@pytest.mark.parametrize("median, note", [(1.2, "x1.20 its pace (the median of its drift): its point forecast is "
                                                "likely fast (latencies low, attainment and throughput high); the "
                                                "band's centre (in brackets) is the forecast at that pace"),
                                          (0.7, "x0.70 its pace (the median of its drift): its point forecast is "
                                                "likely slow (latencies high, attainment and throughput low); the "
                                                "band's centre (in brackets) is the forecast at that pace"),
                                          (1.1, "x1.10 its pace"), (0.9, "x0.90 its pace"),  # the boundary, both ways
                                          (1.0, None), (1.09, None), (0.91, None)])
def test_a_drift_whose_median_is_off_the_profile_says_which_way_its_forecast_is_off(median, note):
    r = parse_recipe(recipe(PROFILE.replace(drift=Drift(factors=(median,) * 8, runs=2))))
    notes = [ln for ln in lines(_band_of({"unified": median, "pd": median}), r) if "note: the runs checked" in ln]
    if note is None:
        assert notes == []
    else:  # one line for the profile both variants share
        (line,) = notes
        assert note in line and "profile box" in line


def test_two_profiles_off_their_pace_get_a_note_each():
    raw = recipe(PROFILE.replace(drift=Drift(factors=(1.3,) * 8, runs=2)))
    raw["variants"]["unified"]["model"] = {"timing": PROFILE.replace(name="other",
                                                                     drift=Drift(factors=(0.8,) * 8)).to_raw()}
    text = lines(_band_of({"unified": 0.8, "pd": 1.3}), parse_recipe(raw))
    notes = [ln for ln in text if "note: the runs checked" in ln]
    assert len(notes) == 2 and any("profile other stepped x0.80" in n for n in notes)
    assert any("profile box stepped x1.30" in n for n in notes)


def test_a_profile_without_drift_gives_no_band_and_says_how_to_get_one():
    res, band = forecast(PROFILE)
    assert band is None
    (line,) = lines(None, res.recipe)
    assert line.startswith("no forecast band for profile box: its drift has 0 of the") and "--write-drift" in line
    assert lines(None, parse_recipe(recipe(PROFILE.replace(source="analytic")))) == []  # nothing checked it
    # too few paces for a band, and one variant banded beside another that is not: each says so
    few = PROFILE.replace(name="few", drift=Drift(factors=(1.1,), runs=1))
    raw = recipe(PROFILE.replace(drift=Drift(factors=(0.9,) * 4 + (1.5,) * 4, runs=2)))
    raw["variants"]["unified"]["model"] = {"timing": few.to_raw()}
    r = parse_recipe(raw)
    wl = {n: build_workload(v) for n, v in r.variants.items()}
    res = simulate_recipe(r, wl)
    band = forecast_band(res.recipe, res.slo, wl)
    assert list(band["variants"]) == ["pd"] and set(band["lo"]) == {"pd"}
    text = lines(band, res.recipe)
    assert text[0].startswith("forecast band (simulated, not measured)") and "pd: x0.90-1.50" in text[0]
    assert "no forecast band for profile few: its drift has 1 of the 4 paces" in text[1]
    assert not any(ln.strip().startswith("unified @") for ln in text)


def test_write_drift_adds_a_runs_paces_to_the_profile_file(tmp_path, capsys):
    from pdlab.commands.profile import _write_drift

    path = write_profile(str(tmp_path / "box.yaml"), {**PROFILE.to_raw(), "pdlab_timing_profile": 1},
                         header="measured by hand")
    run = fake_run(PROFILE.scaled(1.25), tmp_path)
    checks = {"unified": {"modelled": False}, "pd": {"modelled": False}}
    run.env["time"] = "2026-12-03T10:00:00+0000"
    assert _write_drift(run, checks, path) == 0
    assert _write_drift(run, checks, path) == 2  # the same run twice: refused, the drift as it was
    assert "is in" in capsys.readouterr().err and load_profile(path).drift.runs == 1
    run.env["time"] = "2026-12-03T11:00:00+0000"  # another run (of the same box)
    assert _write_drift(run, checks, path) == 0
    d = load_profile(path).drift
    assert d.runs == 2 and len(d.factors) == 12 and d.band() == (pytest.approx(1.25, rel=1e-3),) * 2
    assert d.sources == ("2026-12-03T10:00:00+0000", "2026-12-03T11:00:00+0000")
    assert open(path).read().startswith("# measured by hand\n") and load_profile(path).step == PROFILE.step
    assert "drift now x1.25-1.25 (5-95% of 12 paces from 2 runs)" in capsys.readouterr().out
    run.env["time"] = "2026-12-03T12:00:00+0000"
    assert _write_drift(run, {"pd": {"modelled": True}}, path) == 2  # timed steps are the model's
    assert "no variant of this run ran its model" in capsys.readouterr().err
    assert yaml.safe_load(open(path))["drift"]["runs"] == 2  # nothing written by the failed one


def test_write_drift_needs_a_profile_file_and_never_writes_a_shipped_one(tmp_path):
    r = pdlab("profile", "--check", str(tmp_path), "--write-drift")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--write-drift needs --profile FILE" in r.stderr
    shipped = load_profile("cpu-demo-2core")
    r = pdlab("profile", "--check", str(tmp_path), "--profile", "cpu-demo-2core", "--write-drift")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a shipped profile is never written" in r.stderr
    assert load_profile("cpu-demo-2core") == shipped


def test_the_write_options_without_check_are_refused_before_anything_is_measured(tmp_path):
    r = pdlab("profile", "--profile", str(tmp_path / "box.yaml"), "--write-drift")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--profile, --write-drift go with --check RUN_DIR" in r.stderr and not (tmp_path / "box.yaml").exists()


def test_a_simulation_from_a_profile_with_a_drift_prints_and_stores_its_band(tmp_path):
    import json

    drifted = PROFILE.replace(drift=Drift(factors=(0.9,) * 4 + (1.5,) * 4, runs=2))
    path = write_profile(str(tmp_path / "box.yaml"), {**drifted.to_raw(), "pdlab_timing_profile": 1})
    raw = recipe(PROFILE)
    raw["model"] = {"preset": "tiny-llama", "timing": path}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    out = str(tmp_path / "sim")
    r = pdlab("run", str(tmp_path / "r.yaml"), "--simulate", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    band = json.load(open(f"{out}/summary.json"))["forecast_band"]
    assert band["variants"]["pd"]["pace"] == [pytest.approx(0.9), pytest.approx(1.5)]
    assert band["lo"]["pd"]["inf"]["output_tok_s"] > band["hi"]["pd"]["inf"]["output_tok_s"]
    assert "forecast band (simulated, not measured)" in r.stdout and "pd @ inf req/s: TTFT p50" in r.stdout
    write_profile(path, {**PROFILE.to_raw(), "pdlab_timing_profile": 1})  # no drift: no band, and a line saying so
    r = pdlab("run", str(tmp_path / "r.yaml"), "--simulate", "--out", str(tmp_path / "sim2"))
    assert r.returncode == 0 and json.load(open(tmp_path / "sim2" / "summary.json"))["forecast_band"] is None
    assert "no forecast band for profile box: its drift has 0 of the 4 paces" in r.stdout


def test_a_run_of_another_model_is_named_by_the_check_and_never_written_into_the_profile(tmp_path):
    """A run of another model than the profile's measures the mismatch, not the box: --check warns, and
    --write-drift and --write-host refuse it (one line, exit code 2), the profile file unchanged."""
    import json

    run = fake_run(PROFILE.scaled(1.25), tmp_path)  # the recipe runs tiny-llama
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump(run.recipe))
    (folder / "env.json").write_text(json.dumps({"time": "2026-12-03T10:00:00+0000"}))
    (folder / "summary.json").write_text(json.dumps(run.summary))
    for kind in ("requests", "steps"):
        (folder / f"{kind}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in getattr(run, kind)))
    other = write_profile(str(tmp_path / "other.yaml"), {**PROFILE.replace(model="cpu-demo").to_raw(),
                                                         "pdlab_timing_profile": 1})
    before = open(other).read()
    r = pdlab("profile", "--check", str(folder), "--profile", other)
    assert r.returncode == 0 and "measured on another model or dtype than this run (ran tiny-llama" in r.stdout
    for flag in ("--write-drift", "--write-host"):
        r = pdlab("profile", "--check", str(folder), "--profile", other, flag)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{flag}: this run ran another model or dtype than {other}" in r.stderr
        assert "the profile, cpu-demo" in r.stderr
        assert open(other).read() == before
    same = write_profile(str(tmp_path / "same.yaml"), {**PROFILE.to_raw(), "pdlab_timing_profile": 1})
    r = pdlab("profile", "--check", str(folder), "--profile", same, "--write-drift")
    assert r.returncode == 0 and "another model" not in r.stdout and load_profile(same).drift.runs == 1


def test_a_band_names_the_end_where_a_decode_worker_runs_out_of_slots():
    """At the slow end of the drift the same load keeps more requests decoding at once: where that fills a decode
    worker's slots (engine.max_running) the band says so at that end, and the point forecast, below it, does not."""
    raw = recipe(PROFILE.replace(drift=Drift(factors=(0.8,) * 4 + (2.5,) * 4, runs=2)), rates=[10])
    raw["engine"]["max_running"] = 6
    raw["workload"].update(requests=16, output_len={"kind": "fixed", "value": 40})
    del raw["variants"]["unified"]
    r = parse_recipe(raw)
    wl = {n: build_workload(v) for n, v in r.variants.items()}
    res = simulate_recipe(r, wl)
    band = forecast_band(res.recipe, res.slo, wl)
    assert not any("slots" in w for w in res.summary()["warnings"])
    lo, hi = (band["slots"][end]["pd"] for end in ("lo", "hi"))
    assert lo["max_running"] == hi["max_running"] == 6
    assert slots_warning("pd", lo["rates"], 6) is None
    line = slots_warning("pd", hi["rates"], 6, "simulated")
    assert line.startswith("pd: decode worker decode0 ran all 6") and "(simulated)" in line
    text = lines(band, res.recipe)
    assert [ln for ln in text if "slots" in ln] == [f"  at the slow end (x2.50): {line}"]
