"""A run replayed at its own pace (pdlab.timing.replay, `pdlab profile --check RUN --replay`): each worker's
measured / predicted step time (in all and rate by rate) and its gaps between steps, read from the run, and the
run's recipe simulated with them at the run's rates and SLO, set beside it. A run on a box slower than its
profile replays to its own figures; the forecast from the profile as measured does not."""

import copy

import pytest

from cli_helpers import pdlab
from pdlab.measure.records import Run
from pdlab.recipe import TimingProfile, load_profile, parse_recipe
from pdlab.recipe.timing import HostTiming, StepTiming
from pdlab.sim.experiment import simulate_recipe
from pdlab.timing.replay import ReplayError, compare, figures, replay, replay_raw, table, within, worker_paces
from pdlab.workload import build_workload

PROFILE = TimingProfile(name="box", source="measured", device_kind="cpu", model="tiny-llama",
                        step=StepTiming(fixed_ms=3, prefill_token_ms=0.08, decode_seq_ms=0.4, context_token_ms=0.001,
                                        chunk_ms=0.5, fresh_pair_ms=0.02, knee_token_ms=0.05, knee_tokens=16),
                        kv_bytes_per_token=1024, kv_memory_gb=1.0, host=HostTiming(0.3, 1.0, 2.0, 0.4),
                        transfer=(("shm", load_profile("cpu-demo-2core").transfer_of("shm")),))


def recipe(timing: TimingProfile, **over) -> dict:
    return {"name": "rp", "seed": 3, "warmup": 1, "repeats": 1,
            "model": {"preset": "tiny-llama", "timing": timing.to_raw()},
            "engine": {"block_size": 16, "kv_blocks": 512, "max_running": 16},
            "workload": {"requests": 12, "arrival": {"kind": "poisson"},
                         "input_len": {"kind": "uniform", "min": 40, "max": 300},
                         "output_len": {"kind": "uniform", "min": 8, "max": 24}},
            "rates": [20, ".inf"], "slo": {"ttft_ms": 150, "itl_ms": 30, "itl_stat": "p99"},
            "variants": {"unified": {"deployment": {"unified": {"devices": ["cpu:0"]}}},
                         "pd": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                               "transport": "shm", "mode": "pull"}}}, **over}


def fake_run(box: TimingProfile, tmp_path) -> Run:
    """A 'real' run of a box whose steps follow `box`, as records on disk would hold it: the simulator's records
    and summary, with the recipe naming PROFILE as the profile to check against (model.check_timing) and no
    model.timing (workers ran the model)."""
    r = parse_recipe(recipe(box))
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    s = res.summary()
    raw = recipe(PROFILE)
    raw["model"] = {"preset": "tiny-llama", "check_timing": PROFILE.to_raw()}
    return Run(path=str(tmp_path), recipe=raw, env={}, summary=s, requests=res.requests, steps=res.steps,
               transfers=res.transfers)


def test_scaled_multiplies_the_step_terms_only():
    s = PROFILE.scaled(1.5)
    assert s.step.fixed_ms == pytest.approx(4.5) and s.step.knee_token_ms == pytest.approx(0.075)
    assert s.step.knee_tokens == 16  # a count of tokens, not a time
    assert (s.host, s.transfer, s.kv_memory_gb) == (PROFILE.host, PROFILE.transfer, PROFILE.kv_memory_gb)
    assert s.step_s(100, 3, 500, 5050, 1, 5050) == pytest.approx(1.5 * PROFILE.step_s(100, 3, 500, 5050, 1, 5050))
    assert s.name == "box x1.5"


def test_a_run_on_a_box_uniformly_slower_than_its_profile_replays_to_its_own_figures(tmp_path):
    run = fake_run(PROFILE.scaled(1.4), tmp_path)
    res = replay(run)
    assert {v: sorted(ws) for v, ws in res["paces"].items()} == {"unified": ["unified0"],
                                                                 "pd": ["decode0", "prefill0"]}
    for ws in res["paces"].values():
        for p in ws.values():
            assert p.factor == pytest.approx(1.4) and [t for t, _, _ in p.by_run] == ["20", "inf"]
            assert all(f == pytest.approx(1.4) for _, _, f in p.by_run)
            assert not p.gaps_ms or min(p.gaps_ms) == pytest.approx(0.3)  # the host gap, where back to back
    # a decode worker's gaps that held pulls' copies are longer by them (a CPU pull copies between its steps);
    # the others' are the host gap alone
    dec = sorted((s for s in run.steps if s["worker"] == "decode0" and not s.get("warmup")),
                 key=lambda s: (s["rate"], s["start"]))
    held = [sum(x["end"] - x["start"] for x in run.transfers if a["end"] <= x["start"] < b["start"]) * 1e3
            for a, b in zip(dec, dec[1:]) if a["rate"] == b["rate"] and b["start"] - a["end"] < 0.01]
    assert max(held) > 0 and max(res["paces"]["pd"]["decode0"].gaps_ms) <= 0.3 + max(held) + 1e-6
    for v, w in (("unified", "unified0"), ("pd", "prefill0")):
        assert set(map(round, res["paces"][v][w].gaps_ms, [6] * len(res["paces"][v][w].gaps_ms))) <= {0.3}
    assert res["paces"]["pd"]["decode0"].gaps_ms and res["paces"]["unified"]["unified0"].gaps_ms
    rows = res["comparison"]["rows"]
    assert {(r["variant"], r["rate"]) for r in rows} == {(v, t) for v in ("unified", "pd") for t in ("20", "inf")}
    for r in rows:  # the same simulator, the same seeds and rates, the box's own step times: the same figures
        # (within a percent for pd: its decode worker's gaps that held a copy are drawn at random by the replay)
        tol = 1e-6 if r["variant"] == "unified" else 0.01
        for k in ("ttft_p50", "ttft_p90", "itl_p90"):
            assert r[k]["error"] == pytest.approx(0, abs=tol), (r["variant"], r["rate"], k)
        if "saturation" in r:
            assert r["saturation"]["error"] == pytest.approx(0, abs=tol)
        assert r["attainment"]["error"] == pytest.approx(0, abs=1e-9)
    assert all(a == b for a, b in within(rows).values()) and res["comparison"]["ranking"]["same"]
    # the forecast from the profile as measured misses by the box's drift
    forecast = parse_recipe(dict(recipe(PROFILE), rates=[20, ".inf"]))
    f = simulate_recipe(forecast, {n: build_workload(v) for n, v in forecast.variants.items()})
    miss = compare(figures(run.requests, run.summary), figures(f.requests, f.summary()))
    sat = [r["saturation"]["error"] for r in miss["rows"] if "saturation" in r]
    assert all(e > 0.2 for e in sat)  # 1.4x faster steps: over a fifth more throughput
    assert any("saturation output tok/s" in line for line in table(miss))


def test_each_worker_and_rate_keeps_its_own_pace(tmp_path):
    """A decode worker that stepped 1.5x slower than its prefill worker, and slower again at one rate, replays
    so: paces per worker and per rate, not one per variant."""
    run = fake_run(PROFILE, tmp_path)
    slow = {("decode0", 20.0): 2.0, ("decode0", float("inf")): 1.5}
    steps = [dict(s, end=s["start"] + (s["end"] - s["start"]) * slow.get((s["worker"], float(s["rate"])), 1.0))
             for s in run.steps if s["variant"] == "pd"]
    p = worker_paces(PROFILE, steps)
    assert p["prefill0"].factor == pytest.approx(1.0)
    assert dict((t, f) for t, _, f in p["decode0"].by_run) == {"20": pytest.approx(2.0), "inf": pytest.approx(1.5)}
    assert 1.5 < p["decode0"].factor < 2.0
    # warm-up steps are not the run's measured steps; a worker that took none steps at the others' pace
    warm = [dict(s, warmup=True, end=s["start"] + 10 * (s["end"] - s["start"])) for s in steps[:5]]
    assert worker_paces(PROFILE, steps + warm)["decode0"].by_run == p["decode0"].by_run
    idle = worker_paces(PROFILE, [s for s in steps if s["worker"] == "decode0"], ["prefill0", "decode0"])
    assert idle["prefill0"].factor == pytest.approx(idle["decode0"].factor) and not idle["prefill0"].by_run
    # the replay steps the decode worker at its own pace for each rate, and leaves the prefill worker's alone
    run.steps = [s for s in run.steps if s["variant"] != "pd"] + steps
    res = replay(run)
    assert res["paces"]["pd"]["decode0"].by_run == p["decode0"].by_run
    itl = {r["rate"]: r["itl_p90"] for r in res["comparison"]["rows"] if r["variant"] == "pd"}
    assert itl["20"]["sim"] > itl["20"]["real"] * 1.5  # the 'real' run's tokens came at the profile's pace


def test_the_replay_takes_the_runs_rates_and_slo_not_the_recipes(tmp_path):
    run = fake_run(PROFILE, tmp_path)
    raw = copy.deepcopy(run.recipe)
    raw["rates"], raw["slo"] = ["0.5x"], {"ttft": "5x", "itl": "10x"}  # as written; the run resolved them
    out = replay_raw(raw, run.summary, run.requests, "pd", PROFILE)
    assert out["rates"] == [20.0, ".inf"] and list(out["variants"]) == ["pd"]
    assert out["slo"]["ttft_ms"] == 150 and "ttft" not in out["slo"] and "check_timing" not in out["model"]
    assert parse_recipe(out).resolved("pd").model.timing.name == "box"


def test_what_cannot_be_replayed_is_one_clear_error(tmp_path):
    run = fake_run(PROFILE, tmp_path)
    with pytest.raises(ReplayError, match="searched its rates"):
        replay_raw(dict(run.recipe, rates="auto"), run.summary, run.requests, "pd", PROFILE)
    run.env["simulated"] = True
    with pytest.raises(ReplayError, match="a simulated run"):
        replay(run)


def test_replay_needs_check():
    r = pdlab("profile", "--replay")
    assert r.returncode == 2 and r.stderr.strip() == "error: --replay goes with --check RUN_DIR: the run to replay"


def scored(sat: dict, att: dict) -> dict:
    return {v: {"1": {"ttft_p50": 10.0, "ttft_p90": 20.0, "itl_p90": 5.0, "attainment": att[v], "output_tok_s": None},
                "inf": {"ttft_p50": 10.0, "ttft_p90": 20.0, "itl_p90": 5.0, "attainment": 0.0,
                        "output_tok_s": sat[v]}} for v in sat}


def test_two_deployments_within_the_target_of_each_other_are_a_tie_not_a_ranking():
    real = scored({"a": 1000.0, "b": 980.0}, {"a": 0.95, "b": 0.90})
    tie = compare(real, scored({"a": 980.0, "b": 1000.0}, {"a": 0.90, "b": 0.95}))["ranking"]
    assert not tie["same"] and tie["agree"]  # 2% and 0.05 apart: either order is the noise's
    apart = compare(real, scored({"a": 700.0, "b": 1000.0}, {"a": 0.95, "b": 0.90}))["ranking"]
    assert not apart["same"] and not apart["agree"]  # the simulation sets b 35% above a, the run the other way
    att = compare(real, scored({"a": 1000.0, "b": 980.0}, {"a": 0.60, "b": 0.90}))["ranking"]
    assert not att["same"] and not att["agree"]  # attainment 0.30 apart the other way
    same = compare(real, real)["ranking"]
    assert same["same"] and same["agree"]
    assert "but for a tie" in table(compare(real, scored({"a": 980.0, "b": 1000.0}, {"a": 0.95, "b": 0.90})))[-1]
    lost = compare(real, scored({"a": 1000.0}, {"a": 0.95}))["ranking"]
    assert not lost["same"] and not lost["agree"]  # a deployment the simulation lacks is no tie
    three = scored({"a": 1000.0, "b": 980.0, "c": 500.0}, {"a": 0.95, "b": 0.90, "c": 0.2})
    swapped = compare(three, scored({"a": 990.0, "b": 1000.0, "c": 520.0}, {"a": 0.94, "b": 0.95, "c": 0.25}))
    assert swapped["ranking"]["agree"] and not swapped["ranking"]["same"]
    last = compare(three, scored({"a": 990.0, "b": 1000.0, "c": 1200.0}, {"a": 0.94, "b": 0.95, "c": 0.25}))
    assert not last["ranking"]["agree"]  # c from last to first
