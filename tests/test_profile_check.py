"""A profile held against what workers do (issue 25): steps carry what they computed (fresh and resumed
chunks), `pdlab profile --check` reads a run's steps per kind against a profile's prediction, host time is
read from a run's records and added by the simulator, and a profile whose kernels or CPU are not the
workers' says so. A real timed run ends with the check line."""

import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from engine_helpers import prompts
from proc_helpers import descendants, running
from pdlab.constants import PROFILE_CHECK_MAPE_PCT, PROFILE_PACE_MOVED
from pdlab.engine import Engine, EngineConfig, SamplingParams
from pdlab.engine.model import load_stand_in
from pdlab.engine.timed import StepCounts, count_step
from pdlab.recipe import RecipeError, TimingProfile, load_profile, parse_recipe
from pdlab.recipe.timing import HostTiming, StepTiming
from pdlab.sim.simulator import Simulator
from pdlab.timing.build import fit_warnings, pace_warnings
from pdlab.timing.check import CheckError, check_run, check_steps, lines, profile_for, run_facts, samples
from pdlab.timing.host import MIN_SAMPLES, admit_fit, host_raw, host_times
from pdlab.timing.pace import OLD_READ_MIB, READ_MIB
from pdlab.timing.provenance import differences, machine_warnings, worker_warning
from pdlab.timing.write import profile_raw, write_profile
from pdlab.workload import WorkloadRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = StepTiming(fixed_ms=2, prefill_token_ms=0.5, decode_seq_ms=1, chunk_ms=3, fresh_pair_ms=0.05,
                  resumed_pair_ms=0.1, resumed_context_ms=0.01)


class Seq:
    def __init__(self, computed):
        self.num_computed = computed


# ---- what a step computed ----

def test_fresh_and_resumed_chunks_are_counted_apart():
    # a fresh 30-token prompt, a 20-token chunk resuming a prompt after 100 tokens, two decodes
    c = count_step([(Seq(0), 30, False), (Seq(100), 20, False), (Seq(11), 1, True), (Seq(21), 1, True)])
    assert (c.prefill_tokens, c.decode_seqs, c.context_tokens, c.chunks) == (50, 2, 12 + 22, 2)
    assert c.prefill_pairs == 30 * 31 // 2 + 20 * 100 + 20 * 21 // 2  # causal pairs of every chunk
    assert c.fresh_pairs == 30 * 31 // 2  # the fresh chunk's causal pairs
    assert (c.resumed_pairs, c.resumed_context) == (20 * 120, 120)  # the resumed chunk's masked rectangle
    assert c.kind == "mixed" and count_step([(Seq(5), 1, True)]).kind == "decode"


def test_step_records_carry_the_counts_and_the_timed_step_takes_the_model():
    t = TimingProfile(step=STEP)
    eng = Engine(load_stand_in("tiny-llama"), EngineConfig(block_size=16, kv_blocks=64, token_budget=64,
                                                           chunked_prefill=True), step_timing=t)
    eng.add("a", prompts([100], seed=1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    recs = [eng.step().record for _ in range(3)]
    got = [StepCounts(**{k: getattr(r, k) for k in StepCounts.__dataclass_fields__}) for r in recs]
    assert got == [StepCounts(64, 0, 0, 64 * 65 // 2, 1, 64 * 65 // 2, 0, 0),
                   StepCounts(36, 0, 0, 36 * 64 + 36 * 37 // 2, 1, 0, 36 * 100, 100),
                   StepCounts(0, 1, 101, 0, 0, 0, 0, 0)]
    want = [2 + 32 + 3 + 0.05 * 2.08, 2 + 18 + 3 + 0.1 * 3.6 + 1.0, 2 + 1]
    assert all(r.end - r.start >= w / 1000 - 1e-9 for r, w in zip(recs, want))


def test_a_profile_with_the_new_terms_host_and_kernels_round_trips(tmp_path):
    raw = profile_raw(name="p", source="measured", device="AMD EPYC (2 cores), 1 thread", date="2026-12-01",
                      model="tiny-llama", step=STEP.to_raw(), kv_bytes_per_token=512, kv_memory_gb=1.0,
                      transfer={"shm": {"gbps": 10.0}}, device_kind="cpu",
                      host={"gap_ms": 0.5, "hop_ms": 1.25, "handoff_ms": 2.0},
                      kernels={"rms_norm": {"use": False, "why": "slower here"}}, pace_ms=21.5,
                      memory_pace_ms=11.25, pace_read_mib=READ_MIB)
    t = load_profile(write_profile(str(tmp_path / "p.yaml"), raw))
    assert t.pace_ms == 21.5 and t.memory_pace_ms == 11.25 and t.pace_read_mib == READ_MIB
    assert t.step == STEP and t.host == HostTiming(0.5, 1.25, 2.0) and t.device_kind == "cpu"
    assert t.kernels == {"rms_norm": {"use": False, "why": "slower here"}}
    assert TimingProfile.from_raw(t.to_raw(), "again") == t
    old = load_profile("cpu-demo-2core")  # written before them: no host time, no kernels
    assert old.host == HostTiming() and old.kernels is None and old.step.chunk_ms == 0
    assert old.pace_read_mib is None  # nor the pace's read (pdlab.timing.pace.OLD_READ_MIB, where it has a pace)
    with pytest.raises(RecipeError, match="pace_read_mib"):
        TimingProfile.from_raw({**t.to_raw(), "pace_read_mib": 0}, "p")


# ---- the check ----

def step_dict(c: StepCounts, ms: float, **tag) -> dict:
    return {"variant": "v", "rate": 1.0, "repeat": 0, "worker": "unified0", "start": 10.0, "end": 10.0 + ms / 1000,
            "preempted": 0, "running": 1, "waiting": 0, **c.to_dict(), **tag}


def steps_of(scale: dict) -> list[dict]:
    """Steps of each kind taking `scale[kind]` times STEP's prediction."""
    t = TimingProfile(step=STEP)
    counts = {"prefill": [StepCounts(100, 0, 0, 5050, 1, 5050),
                          StepCounts(64, 0, 0, 64 * 200 + 2080, 1, 0, 64 * 264, 264)],
              "decode": [StepCounts(0, 4, 400), StepCounts(0, 8, 1000)],
              "mixed": [StepCounts(50, 3, 300, 1275, 1, 1275)]}
    return [step_dict(c, scale[k] * 1000 * t.step_s(**c.to_dict())) for k, cs in counts.items() for c in cs]


def test_check_reads_each_kind_of_step_against_the_prediction():
    t = TimingProfile(name="box", step=STEP)
    exact = check_steps(t, steps_of({"prefill": 1.0, "decode": 1.0, "mixed": 1.0}))
    assert exact["steps"] == 5 and all(exact["kinds"][k]["mape_pct"] == pytest.approx(0, abs=1e-6)
                                       for k in ("prefill", "decode", "mixed"))
    slow = check_steps(t, steps_of({"prefill": 1.3, "decode": 1.0, "mixed": 0.9}))
    # percentages of the measured time, as the profile's own held-out errors
    assert slow["kinds"]["prefill"]["mape_pct"] == pytest.approx(100 * 0.3 / 1.3)
    assert slow["kinds"]["prefill"]["ratio"] == pytest.approx(1.3)
    assert slow["kinds"]["decode"]["ratio"] == pytest.approx(1)
    assert slow["kinds"]["mixed"]["mape_pct"] == pytest.approx(100 * 0.1 / 0.9)
    # steps that computed nothing, or preempted, are not steps of the model
    assert len(samples(steps_of({"prefill": 1, "decode": 1, "mixed": 1}) + [
        step_dict(StepCounts(), 1.0), step_dict(StepCounts(10, 0, 0, 55, 1), 5.0, preempted=1)])) == 5
    old = step_dict(StepCounts(10, 0, 0, 55, 1), 5.0)
    del old["context_tokens"]
    with pytest.raises(CheckError, match="no step counts"):
        samples([old])


def recipe_variants(extra: dict) -> dict:
    raw = {"model": {"preset": "tiny-llama"}, "rates": [1], "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "workload": {"requests": 2, "input_len": {"kind": "fixed", "value": 10},
                        "output_len": {"kind": "fixed", "value": 2}},
           "deployment": {"unified": {"devices": ["cpu:0"]}}, "variants": extra}
    r = parse_recipe(raw)
    return {n: r.resolved(n) for n in r.variant_names}


def test_which_profile_checks_a_variant():
    vs = recipe_variants({"real": {}, "timed": {"model": {"timing": "cpu-demo-2core"}},
                          "inline": {"model": {"timing": {"fixed_ms": 1}}},
                          "own": {"model": {"check_timing": "h200-0.6b-analytic"}}})
    assert profile_for("timed", vs)[1] == "its model.timing"
    assert profile_for("own", vs)[0].name == "h200-0.6b-analytic"
    assert profile_for("real", vs) == (vs["timed"].model.timing, "variant timed's model.timing")  # its double's
    assert profile_for("inline", vs) is None  # an inline model names no profile


def test_check_run_lines_and_warnings_beyond_the_threshold():
    vs = recipe_variants({"v": {"model": {"check_timing": "cpu-demo-2core"}}})
    prof = vs["v"].model.check_timing
    t = TimingProfile(name="box", step=STEP)
    res = check_run(vs, steps_of({"prefill": 1.5, "decode": 1.0, "mixed": 1.0}), [], profile=t,
                    kernels={"v": {"unified0": {"prefill_attention": {"use": True, "why": "faster here"}}}})
    assert set(res) == {"v"} and res["v"]["by"] == "given" and not res["v"]["modelled"]
    out, warn = lines(res)
    assert len(out) == 1 and out[0].startswith("v: steps against profile box (given): MAPE prefill 33% (x1.50, 2)")
    assert len(warn) == 1 and f"beyond {PROFILE_CHECK_MAPE_PCT:.0f}%" in warn[0] and "prefill steps" in warn[0]
    assert check_run(vs, steps_of({"prefill": 1, "decode": 1, "mixed": 1}), [])["v"]["profile"] == prof.name


def test_the_check_says_how_much_of_their_cores_the_workers_steps_had():
    """Each step's own CPU time (cpu_s) over its wall time, per worker: 0.9 means other processes on its core
    (the router and harness, on a box with no spare core) took a tenth of the time it stepped. Steps without
    cpu_s (timed workers, GPUs, older runs) say nothing."""
    vs = recipe_variants({"v": {}})
    t = TimingProfile(name="box", step=STEP)
    steps = steps_of({"prefill": 1.0, "decode": 1.0, "mixed": 1.0})
    mine = [dict(s, cpu_s=0.9 * (s["end"] - s["start"])) for s in steps[:3]]
    other = [dict(s, worker="unified1", cpu_s=1.001 * (s["end"] - s["start"])) for s in steps[3:]]
    res = check_run(vs, mine + other, [], profile=t)
    assert res["v"]["cpu_share"] == {"unified0": pytest.approx(0.9), "unified1": 1.0}  # clock grain: at most 1
    assert "own CPU unified0 0.90, unified1 1.00 of their steps' time" in lines(res)[0][0]
    bare = check_run(vs, steps, [], profile=t)
    assert bare["v"]["cpu_share"] == {} and "own CPU" not in lines(bare)[0][0]


def test_a_runs_main_process_time_is_read_only_where_it_had_no_core_of_its_own(monkeypatch):
    """The run's steps lost time to other processes (cpu_s below their wall time): where a run of the variant
    here leaves the main process no spare core, the check reads its time per worker step from them
    (contention.main_step_ms, which --write-host writes); with a spare core it says nothing of it."""
    from pdlab.serve import topology

    vs = recipe_variants({"v": {}})  # one unified worker on cpu:0
    t = TimingProfile(name="box", step=STEP)
    steps = [dict(step_dict(StepCounts(0, 4, 400), 5.0), start=10 + i * 0.005, end=10.005 + i * 0.005,
                  cpu_s=0.0045) for i in range(100)]
    monkeypatch.setattr(topology, "cpu_cores", lambda: [0])
    shared = check_run(vs, steps, [], profile=t)["v"]["contention"]
    # 0.5 ms of each 5 ms step at 200 steps a second: a tenth of the core, 0.5 ms a step
    assert shared["main_step_ms"] == pytest.approx(0.5, rel=0.01)
    assert "main_step_ms 0.5 (0)" in lines(check_run(vs, steps, [], profile=t))[0][0]
    monkeypatch.setattr(topology, "cpu_cores", lambda: [0, 1])
    assert "main_step_ms" not in check_run(vs, steps, [], profile=t)["v"]["contention"]


def test_where_the_main_process_shares_the_cores_the_co_running_factors_leave_its_share_out(monkeypatch):
    """Two workers step together, computing what the model says, and their steps took a tenth longer: the time
    the main process took. With no spare core that is main_step_ms's, so the factors beside stepping workers are
    read from the steps' own CPU time (the simulator would count it twice otherwise): x1. With a spare core,
    from their wall time: x1.1."""
    from pdlab.serve import topology

    vs = recipe_variants({"v": {"deployment": {"unified": {"replicas": 2, "devices": ["cpu:0", "cpu:1"]}}}})
    t = TimingProfile(name="box", step=STEP)
    ms = 1000 * t.step_s(0, 4, 400)
    steps = []
    for w, wall in (("unified0", 1.1 * ms), ("unified1", 1.1 * ms)):
        for i in range(60):
            steps.append(dict(step_dict(StepCounts(0, 4, 400), ms, worker=w), start=10 + i * wall / 1e3,
                              end=10 + (i + 1) * wall / 1e3, cpu_s=ms / 1e3))
    alone = [dict(step_dict(StepCounts(0, 4, 400), ms), start=15 + i * ms / 1e3, end=15 + (i + 1) * ms / 1e3,
                  cpu_s=ms / 1e3) for i in range(30)]  # the same steps with the other idle: the factors' base
    monkeypatch.setattr(topology, "cpu_cores", lambda: [0, 1])
    shared = check_run(vs, steps + alone, [], profile=t)["v"]["contention"]
    assert shared["decode_x"] == pytest.approx(1.0, abs=0.01) and shared["main_step_ms"] > 0
    monkeypatch.setattr(topology, "cpu_cores", lambda: [0, 1, 2])
    spare = check_run(vs, steps + alone, [], profile=t)["v"]["contention"]
    assert spare["decode_x"] == pytest.approx(1.1, abs=0.01) and "main_step_ms" not in spare


def test_the_box_pace_stands_beside_the_steps_and_in_their_warnings():
    """The workers timed the fixed computation x1.45 the profile's: the check line and each warning say so
    (a fact beside the steps' miss: a snapshot at the workers' start, not a correction); within PACE_DRIFT of
    the profile's, the warnings leave it out."""
    vs = recipe_variants({"v": {}})
    t = TimingProfile(name="box", step=STEP, pace_ms=20.0)
    slow = steps_of({"prefill": 1.5, "decode": 1.5, "mixed": 1.5})
    res = check_run(vs, slow, [], profile=t, paces={"v": {"unified0": 29.0, "unified1": 31.0, "x": 20.0}})
    assert res["v"]["pace"] == pytest.approx(1.45)  # the median worker's
    out, warn = lines(res)
    assert "the box's pace x1.45 the profile's" in out[0]
    assert len(warn) == 3 and all("(the box's pace at their start was x1.45 the profile's)" in w for w in warn)
    steady = check_run(vs, slow, [], profile=t, paces={"v": {"unified0": 20.5}})
    assert steady["v"]["pace"] == pytest.approx(1.025)
    assert len(lines(steady)[1]) == 3 and not any("pace" in w for w in lines(steady)[1])
    # no pace on either side (an older profile, a run before workers timed it): nothing said of it
    assert check_run(vs, slow, [], profile=TimingProfile(name="old", step=STEP),
                     paces={"v": {"unified0": 29.0}})["v"]["pace"] is None
    assert "pace" not in lines(check_run(vs, slow, [], profile=t))[0][0]


def test_paces_of_reads_of_different_sizes_are_not_set_side_by_side():
    """A profile whose pace timed the old 32 MiB read (no pace_read_mib) against a run whose workers timed
    READ_MIB: no ratio (the two computations differ, an L3 read against a DRAM one), and the line says why. The
    same read on both sides (the profile's field and the run's env.json) gives the ratio; a run from before
    env.json kept the read beside a profile that keeps it is the mismatch the other way. Workers that timed
    different reads (one from another checkout) count only where theirs is the profile's."""
    assert READ_MIB != OLD_READ_MIB
    vs = recipe_variants({"v": {}})
    slow = steps_of({"prefill": 1.5, "decode": 1.5, "mixed": 1.5})
    old, new = (TimingProfile(name="box", step=STEP, pace_ms=20.0, memory_pace_ms=10.0, pace_read_mib=mib)
                for mib in (None, READ_MIB))
    kw = dict(paces={"v": {"unified0": 21.0}}, memory_paces={"v": {"unified0": 14.0}})
    for profile, run_mib in ((old, READ_MIB), (new, None)):
        reads = {"v": {"unified0": run_mib}} if run_mib else None
        res = check_run(vs, slow, [], profile=profile, pace_reads=reads, **kw)
        assert res["v"]["pace"] is None and res["v"]["memory_pace"] is None
        assert res["v"]["pace_other"] == (f"the profile's pace read {profile.pace_read_mib or OLD_READ_MIB} MiB, the "
                                          f"run's workers' {run_mib or OLD_READ_MIB} MiB: not set side by side "
                                          "(pdlab.timing.pace)")
        out, warn = lines(res)
        assert res["v"]["pace_other"] in out[0] and "the box's pace x" not in out[0]
        assert not any("pace at their start" in w for w in warn)
    same = check_run(vs, slow, [], profile=new, pace_reads={"v": {"unified0": READ_MIB}}, **kw)["v"]
    assert same["pace"] == pytest.approx(1.05) and same["memory_pace"] == pytest.approx(1.4)
    assert same["pace_other"] is None
    assert check_run(vs, slow, [], profile=new, pace_reads={"v": {"unified0": READ_MIB}})["v"]["pace_other"] is None
    # two workers, one of them started from a checkout that timed the old read: the other's pace alone
    mixed = check_run(vs, slow, [], profile=new, paces={"v": {"prefill0": 21.0, "decode0": 40.0}},
                      memory_paces={"v": {"prefill0": 14.0, "decode0": 30.0}},
                      pace_reads={"v": {"prefill0": READ_MIB, "decode0": OLD_READ_MIB}})["v"]
    assert mixed["pace"] == pytest.approx(1.05) and mixed["memory_pace"] == pytest.approx(1.4)
    assert mixed["pace_other"] == (f"the profile's pace read {READ_MIB} MiB, 1 of the run's 2 workers' {OLD_READ_MIB} "
                                   "MiB: those not set side by side (pdlab.timing.pace)")


def test_a_profile_written_with_a_pace_keeps_its_read_and_one_without_has_none():
    """profile_raw: a pace measured now keeps the read it timed (READ_MIB unless another is named); a profile
    with no pace (a GPU's) keeps no read either."""
    kw = dict(name="p", source="measured", device="a CPU", date="2026-12-07", model="tiny-llama", step=STEP.to_raw(),
              kv_bytes_per_token=512, kv_memory_gb=1.0, transfer={"shm": {"gbps": 10.0}})
    assert profile_raw(**kw, pace_ms=10.0)["pace_read_mib"] == READ_MIB
    assert profile_raw(**kw, pace_ms=10.0, pace_read_mib=OLD_READ_MIB)["pace_read_mib"] == OLD_READ_MIB
    assert "pace_read_mib" not in profile_raw(**kw) and "pace_read_mib" not in profile_raw(**kw, pace_read_mib=64)


def test_a_run_compares_its_paces_with_a_profile_of_the_same_read(tmp_path, capsys):
    """The check at a run's end (run_facts) takes the read each worker reported: workers that timed READ_MIB
    against a profile that keeps READ_MIB get the ratio, against one from before (none kept) the note.
    `pdlab profile --check RUN_DIR` reads the reads from env.json: none there (a run from before) against a
    READ_MIB profile is the note; the same read, the ratio, kept per worker or, as runs of 2026-12-07 kept it,
    one integer for all."""
    from pdlab.commands.profile import check

    slow = steps_of({"prefill": 1.5, "decode": 1.5, "mixed": 1.5})
    kw = dict(kernels=None, paces={"v": {"unified0": 21.0}}, memory_paces={"v": {"unified0": 14.0}},
              pace_reads={"v": {"unified0": READ_MIB}})
    new = dict(name="box", source="measured", device="a CPU", date="2026-12-07", model="tiny-llama",
               step=STEP.to_raw(), kv_bytes_per_token=512, kv_memory_gb=1.0, transfer={"shm": {"gbps": 10.0}},
               pace_ms=20.0, memory_pace_ms=10.0)
    for raw, ratio in ((new, 1.05), ({**new, "pace_read_mib": OLD_READ_MIB}, None)):
        path = write_profile(str(tmp_path / "p.yaml"), profile_raw(**raw))
        assert load_profile(path).pace_read_mib == raw.get("pace_read_mib", READ_MIB)
        got = run_facts(recipe_variants({"v": {"model": {"check_timing": path}}}), slow, [], **kw)[0]["variants"]["v"]
        assert (got["pace"] == pytest.approx(ratio)) if ratio else got["pace"] is None
        assert (got["pace_other"] is None) == (ratio is not None)
    run = tmp_path / "run"
    run.mkdir()
    path = write_profile(str(tmp_path / "new.yaml"), profile_raw(**new))
    (run / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny-llama"}, "rates": [1], "slo": {"ttft_ms": 1000, "itl_ms": 50},
        "workload": {"requests": 2, "input_len": {"kind": "fixed", "value": 10},
                     "output_len": {"kind": "fixed", "value": 2}},
        "deployment": {"unified": {"devices": ["cpu:0"]}}, "variants": {"v": {}}}))
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in slow))
    env = {"worker_pace_ms": {"v": {"unified0": 21.0}}, "worker_memory_pace_ms": {"v": {"unified0": 14.0}}}
    for read, said in ((None, "the profile's pace read %d MiB, the run's workers' %d MiB" % (READ_MIB, OLD_READ_MIB)),
                       (READ_MIB, "the box's pace x1.05 the profile's, its memory half x1.40"),
                       ({"v": {"unified0": READ_MIB}}, "the box's pace x1.05 the profile's, its memory half x1.40"),
                       ({"v": {"unified0": OLD_READ_MIB}},
                        "the profile's pace read %d MiB, the run's workers' %d MiB" % (READ_MIB, OLD_READ_MIB))):
        (run / "env.json").write_text(json.dumps({**env, **({"worker_pace_read_mib": read} if read else {})}))
        assert check(str(run), profile=path) == 0
        assert said in capsys.readouterr().out


def test_the_memory_half_of_the_pace_stands_apart_where_it_moved_apart():
    """The whole computation took x1.05 the profile's at the workers' start, its memory half (the read)
    x1.4: the line gives both, and the warnings name the memory half alone (the whole within PACE_DRIFT). Both
    moved: the warnings give the whole and the half. An older profile without the half, or a run whose env.json
    has none, says nothing of it."""
    vs = recipe_variants({"v": {}})
    t = TimingProfile(name="box", step=STEP, pace_ms=20.0, memory_pace_ms=10.0)
    slow = steps_of({"prefill": 1.5, "decode": 1.5, "mixed": 1.5})
    res = check_run(vs, slow, [], profile=t, paces={"v": {"unified0": 21.0}},
                    memory_paces={"v": {"unified0": 14.0}})
    assert res["v"]["pace"] == pytest.approx(1.05) and res["v"]["memory_pace"] == pytest.approx(1.4)
    out, warn = lines(res)
    assert "the box's pace x1.05 the profile's, its memory half x1.40 (a fixed computation" in out[0]
    assert len(warn) == 3 and all(
        "(the memory half of the box's pace at their start was x1.40 the profile's)" in w for w in warn)
    assert not any("(the box's pace at their start" in w for w in warn)
    both = lines(check_run(vs, slow, [], profile=t, paces={"v": {"unified0": 26.0}},
                           memory_paces={"v": {"unified0": 7.0}}))[1]
    assert all("(the box's pace at their start was x1.30 the profile's, its memory half x0.70)" in w for w in both)
    for old in (check_run(vs, slow, [], profile=TimingProfile(name="old", step=STEP, pace_ms=20.0),
                          paces={"v": {"unified0": 21.0}}, memory_paces={"v": {"unified0": 14.0}}),
                check_run(vs, slow, [], profile=t, paces={"v": {"unified0": 21.0}})):  # an older run's env.json
        out, warn = lines(old)
        assert old["v"]["memory_pace"] is None and "memory half" not in out[0]
        assert len(warn) == 3 and not any("memory half" in w or "pace" in w for w in warn)


def test_the_pace_is_two_positive_halves_and_its_ratio_the_median_worker_over_the_profile():
    from pdlab.timing.pace import measure, ratio

    pace = measure()
    assert 0 < pace.compute_ms < float("inf") and 0 < pace.memory_ms < float("inf")
    assert ratio([10.0, 30.0, 12.0], 10.0) == pytest.approx(1.2)
    assert ratio([], 10.0) is None and ratio([10.0], None) is None and ratio(None, 5.0) is None


def test_a_run_whose_workers_ran_other_kernels_than_the_profile_says_so():
    prof = TimingProfile(name="box", step=STEP, kernels={"prefill_attention": {"use": False, "why": "slower here"},
                                                         "rotary": {"use": True, "why": "faster here"}})
    ran = {"unified0": {"prefill_attention": {"use": True, "why": "faster here"}, "rotary": {"use": True}}}
    assert differences(prof.kernels, ran["unified0"]) == ["prefill_attention: kernel here, torch in the profile"]
    w = worker_warning("u", prof, ran)
    assert w.startswith("u: its workers ran other CPU kernels than profile box") and "prefill_attention" in w
    assert worker_warning("u", prof, {"unified0": {"rotary": {"use": True}}}) is None
    assert worker_warning("u", TimingProfile(name="old", step=STEP), ran) is None  # a profile without kernels


def test_a_simulation_from_a_profile_measured_on_another_cpu_says_so():
    from pdlab.measure.records import cpu_model

    vs = recipe_variants({"v": {}})
    other = TimingProfile(name="far", source="measured", device="Some Other CPU (2 cores), 1 thread",
                          device_kind="cpu", step=STEP)
    warns = machine_warnings("v", other, vs["v"].model)
    assert cpu_model() is None or (len(warns) == 1 and "was measured on Some Other CPU" in warns[0])
    analytic = TimingProfile(name="gpu", source="analytic", device="H200", step=STEP)
    assert machine_warnings("v", analytic, vs["v"].model) == []


def test_fit_warnings_say_what_to_do():
    good = {"steps": 30, "r2": 0.97, "p90_pct": 12.0}
    assert fit_warnings(good, {"prefill": good, "decode": good, "mixed": good}, 400) == []
    w = fit_warnings(good, {"prefill": good, "decode": {"steps": 9, "r2": 0.5, "p90_pct": 30.0}, "mixed": good},
                     400)
    assert len(w) == 1 and "decode steps: R^2 0.50 < 0.9, p90 error 30% > 25%" in w[0] and "--steps 800" in w[0]


def test_a_profile_warns_when_the_box_changed_speed_while_its_steps_were_measured():
    """Two profiles of 2026-12-07 whose held-out MAPE was 12-15% timed the box's pace at 3.21 then 4.12 ms, and
    3.16 then 2.61 ms: either way a warning, with the figures and what to do. Within PROFILE_PACE_MOVED, or one
    pace (CUDA takes none), nothing."""
    slower, faster = pace_warnings([3.21, 4.12]), pace_warnings([3.16, 2.61])
    assert len(slower) == 1 and "from 3.21 to 4.12 ms (x1.28)" in slower[0] and "--write-drift" in slower[0]
    assert len(faster) == 1 and "(x0.83)" in faster[0]
    assert pace_warnings([3.0, 3.0 * (1 + PROFILE_PACE_MOVED) * 0.99]) == []
    assert pace_warnings([3.0 * (1 + PROFILE_PACE_MOVED) * 0.99, 3.0]) == []
    assert pace_warnings([3.0]) == pace_warnings(None) == pace_warnings([]) == []


def test_a_profile_warns_when_the_memory_half_of_the_pace_moved_alone():
    """The whole pace held within PROFILE_PACE_MOVED while its memory half (the read a long context's KV steps
    follow) moved x1.30: a warning naming the half and the terms it carries; both held, nothing; the whole moved,
    one warning with both figures."""
    (w,) = pace_warnings([2.0, 2.1], [1.0, 1.3])
    assert f"memory half of the box's pace (a {READ_MIB} MiB read) moved from 1 to 1.3 ms (x1.30; the whole x1.05)" in w
    assert "context_token_ms" in w and "--write-drift" in w
    (faster,) = pace_warnings([2.0, 1.9], [1.2, 0.9])  # the half sped up: as much a change of speed
    assert "from 1.2 to 0.9 ms (x0.75; the whole x0.95)" in faster
    assert pace_warnings([2.0, 2.1], [1.0, 1.05]) == [] == pace_warnings([2.0, 2.1], None)
    (both,) = pace_warnings([2.0, 2.6], [1.0, 1.4])
    assert "the box's pace moved from 2 to 2.6 ms (x1.30; its memory half x1.40)" in both


# ---- host time ----

def test_host_time_from_records():
    def step(worker, start, end, running=1, **kw):
        return {"variant": "v", "rate": 1.0, "repeat": 0, "worker": worker, "start": start, "end": end,
                "running": running, "waiting": 0, **kw}

    # decode0 steps back to back 1 ms apart (its last step leaves nothing: no gap after it); prefill0 idle
    steps = [step("decode0", 1.000 + 0.011 * i, 1.010 + 0.011 * i, running=int(i < 5)) for i in range(7)]
    steps += [step("prefill0", a, b, running=0) for a, b in ((2.002, 2.1), (3.003, 3.1), (4.0035, 4.1), (4.105, 4.2))]
    steps += [step("decode0", 2.110 + k, 2.120 + k, running=0) for k in (0, 1, 2)]
    steps.append(step("decode0", 4.15, 4.25, running=0))  # stepping when the last prefill ends
    req = lambda a, first, end, xs: {"variant": "v", "rate": 1.0, "repeat": 0, "ok": True, "arrival": a,  # noqa
                                     "prefill_worker": "prefill0", "decode_worker": "decode0",
                                     "phases": {"prefill_start": first, "prefill_end": end, "transfer_start": xs}}
    reqs = [req(2.0, 2.002, 2.1, 2.104), req(3.0, 3.003, 3.1, 3.106), req(4.0, 4.0035, 4.1, 4.105),
            req(4.05, 4.105, 4.2, 4.3)]  # the last arrived while prefill0 was stepping: not a clean hop
    h = host_times(steps, reqs)
    assert h["samples"] == {"gaps": 5, "hops": 3, "handoffs": 3, "sends": 0, "admits": 0}  # none queued, none admitted
    assert h["gap_ms"] == pytest.approx(1.0) and h["hop_ms"] == pytest.approx(3.0)
    assert h["handoff_ms"] == pytest.approx(5.0)
    assert host_raw({"gap_ms": 1.0, "hop_ms": 3.0, "handoff_ms": None}) == {"gap_ms": 1.0, "hop_ms": 3.0,
                                                                              "handoff_ms": 3.0}
    assert host_times(steps[:2], [])["hop_ms"] is None  # too few samples to say


def test_send_time_is_read_from_requests_that_queued_behind_each_other():
    """Requests due together reach the router one after another: the time between their arrivals there is
    the send time; a request due after the one before it reached the router says nothing of it."""
    def req(arrival, queued, rate=float("inf")):
        return {"variant": "v", "rate": rate, "repeat": 0, "ok": True, "arrival": arrival,
                "phases": {"queued": queued}}

    burst = [req(5.0, 5.0 + 0.0007 * i + (0.002 if i == 3 else 0)) for i in range(6)]
    spread = [req(1.0 + i, 1.0 + i + 0.0001, rate=1.0) for i in range(5)]
    sends = host_times([], burst + spread)
    assert sends["samples"]["sends"] == 5 and sends["send_ms"] == pytest.approx(0.7)
    assert host_times([], spread)["send_ms"] is None
    assert host_raw({"send_ms": 0.7})["send_ms"] == 0.7


def sim_variant(deployment: dict, host: dict):
    raw = {"model": {"preset": "tiny-llama", "timing": {"step": {"fixed_ms": 2, "prefill_token_ms": 1,
                                                                 "decode_seq_ms": 3},
                                                        "transfer": {"shm": {"gbps": 1.0}}, "host": host}},
           "engine": {"block_size": 8, "kv_blocks": 64}, "rates": [1], "slo": {"ttft_ms": 1000, "itl_ms": 50},
           "workload": {"requests": 1, "input_len": {"kind": "fixed", "value": 20},
                        "output_len": {"kind": "fixed", "value": 4}},
           "deployment": deployment}
    r = parse_recipe(raw)
    return r.resolved("default"), r.slo


@pytest.mark.parametrize("mode", ["unified", "pull", "push"])
def test_the_simulator_adds_host_time_and_keeps_its_tokens(mode):
    dep = {"unified": {"devices": ["cpu:0"]}} if mode == "unified" else {
        "prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "transport": "shm", "mode": mode}
    host = {"gap_ms": 1.5, "hop_ms": 4.0, "handoff_ms": 6.0}
    req = WorkloadRequest("r0", prompts([20], seed=3)[0], 4, 0.0)
    (with_host,), steps, transfers = Simulator(*sim_variant(dep, host)).run([req], 1.0)
    (bare,), _, _ = Simulator(*sim_variant(dep, {})).run([req], 1.0)
    assert with_host["output_ids"] == bare["output_ids"]  # host time moves tokens in time, never changes them
    prefill_s = (2 + 20) / 1000
    # the hop, and disaggregated the hand-over's too (the first token comes from the decode side by default)
    assert with_host["ttft"] == pytest.approx(bare["ttft"] + 0.004 + (0.006 if mode != "unified" else 0))
    assert bare["ttft"] >= prefill_s - 1e-9 and (mode != "unified" or bare["ttft"] == pytest.approx(prefill_s))
    if mode != "unified":
        assert with_host["phases"]["prefill_start"] - with_host["arrival"] == pytest.approx(0.004)  # the hop
    work = [s for s in steps if s["decode_seqs"]]
    assert all(b["start"] - a["end"] == pytest.approx(0.0015) for a, b in zip(work, work[1:]))  # the gap
    assert all(s["end"] - s["start"] == pytest.approx((2 + 3 * s["decode_seqs"] + s["prefill_tokens"]) / 1000)
               for s in steps)  # a step still lasts its model
    if mode == "pull":
        assert transfers[0]["start"] - with_host["phases"]["prefill_end"] == pytest.approx(0.006)  # the hand-over
    if mode == "push":
        assert with_host["phases"]["admitted"] - transfers[0]["end"] == pytest.approx(0.006)


# ---- a real run ends with the check ----

@pytest.mark.slow
def test_a_timed_run_ends_with_the_profile_check_and_pdlab_profile_checks_it(tmp_path):
    prof = profile_raw(name="box", source="measured", device="a box", date="2026-12-01", model="tiny-llama",
                       step={"fixed_ms": 3.0, "prefill_token_ms": 0.2, "decode_seq_ms": 0.5}, kv_bytes_per_token=512,
                       kv_memory_gb=0.01, transfer={"shm": {"gbps": 5.0}})
    write_profile(str(tmp_path / "box.yaml"), prof)
    recipe = {"name": "checked", "model": {"preset": "tiny-llama", "timing": str(tmp_path / "box.yaml")},
              "engine": {"block_size": 8, "kv_blocks": 128}, "rates": [4], "warmup": 0,
              "workload": {"requests": 6, "input_len": {"kind": "fixed", "value": 40},
                           "output_len": {"kind": "fixed", "value": 6}},
              "slo": {"ttft_ms": 2000, "itl_ms": 200}, "deployment": {"unified": {"devices": ["cpu:0"]}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = str(tmp_path / "run")
    r = pdlab_here("run", str(tmp_path / "r.yaml"), "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("profile check: ")]
    assert len(last) == 1 and last[0].startswith("profile check: default: timed steps against profile box")
    s = json.load(open(os.path.join(out, "summary.json")))
    c = s["profile_check"]["variants"]["default"]
    assert c["steps"] > 0 and {k for k, e in c["kinds"].items() if e["steps"]} == {"prefill", "decode"}
    assert all(e["ratio"] >= 1.0 - 1e-6 for e in c["kinds"].values() if e["steps"])  # never shorter than the model
    assert c["host"]["samples"]["gaps"] > 0
    p = pdlab_here("profile", "--check", out)
    assert p.returncode == 0 and "default: timed steps against profile box (its model.timing): MAPE" in p.stdout
    p = pdlab_here("profile", "--check", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "nowhere" in p.stderr
    np.testing.assert_equal(len(s["profile_check"]["lines"]), 1)


def test_write_host_puts_a_runs_host_time_into_the_profile(tmp_path, capsys):
    from pdlab.commands.profile import _write_host

    path = write_profile(str(tmp_path / "box.yaml"), profile_raw(
        name="box", source="measured", device="a box", date="2026-12-01", model="tiny-llama", step=STEP.to_raw(),
        kv_bytes_per_token=512, kv_memory_gb=1.0, transfer={}), header="measured by hand")
    checks = {"timed": {"modelled": True, "host": {"gap_ms": 9.0, "hop_ms": 9.0}},
              "real": {"modelled": False, "host": {"gap_ms": 1.5, "hop_ms": 2.5, "handoff_ms": None}}}
    assert _write_host(checks, path) == 0
    t = load_profile(path)
    assert t.host == HostTiming(gap_ms=1.5, hop_ms=2.5, handoff_ms=2.5)  # the real variant's; no hand-over: the hop
    assert open(path).read().startswith("# measured by hand\n") and t.step == STEP
    assert _write_host({"timed": checks["timed"]}, path) == 2  # timed steps are the model's
    assert "no variant of this run ran its model" in capsys.readouterr().err
    # a unified variant measures no hand-over: a disaggregated one beside it gives it, and the profile keeps
    # what neither measured; contention fills in across variants too
    checks = {"unified": {"modelled": False, "host": {"gap_ms": 0.5, "hop_ms": 0.7, "handoff_ms": None},
                          "contention": {"prefill_x": 1.1}},
              "1P1D": {"modelled": False, "host": {"gap_ms": 0.9, "hop_ms": 0.4, "handoff_ms": 1.6},
                       "contention": {"prefill_x": 1.3, "cold_ms": 2.0}}}
    assert _write_host(checks, path) == 0
    t = load_profile(path)
    assert (t.host.gap_ms, t.host.hop_ms, t.host.handoff_ms) == (0.5, 0.7, 1.6)
    assert (t.contention.prefill_x, t.contention.cold_ms) == (1.1, 2.0)


@pytest.mark.slow
def test_ctrl_c_ends_pdlab_profile_and_its_measuring_process(tmp_path):
    import signal
    import time

    out = tmp_path / "never.yaml"
    p = subprocess.Popen([sys.executable, "-m", "pdlab.cli", "profile", "--model", "tiny-llama", "--steps", "400",
                          "--no-host", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "measuring in a process" not in (line := p.stdout.readline()):  # the measuring process is up
            assert line and time.monotonic() < deadline, p.stderr.read()
        kids = descendants(p.pid)  # the measuring process, the fork server it came from, the resource tracker
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted (Ctrl-C): nothing written"
    deadline = time.monotonic() + 10
    while any(running(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kids and not [k for k in kids if running(k)] and not out.exists()  # no orphan, no file


def test_a_pulls_admit_time_grows_with_its_prompt_read_through_the_gaps_the_os_stretched():
    """A pull's copy shares the decode worker's core: each gap with one pull admitted is the plain 0.2 ms, 0.5 ms
    and 0.8 ms per 1000 prompt tokens. Three gaps stretched by 5 ms more do not tilt the line. Pushes say nothing
    of a copy (None); pulls all of one length leave it in admit_ms (0)."""
    def records(lengths, pull=True, stretched=()):
        steps, reqs, t = [], [], 1.0
        for i in range(60):
            steps.append({"variant": "v", "rate": 1.0, "repeat": 0, "worker": "decode0", "role": "decode",
                          "start": t, "end": t + 0.004, "running": 2})
            n = i % 2  # a pull admitted in every other gap
            if n:
                tokens = lengths[i // 2 % len(lengths)]
                ph = ({"prefill_end": t - 0.01, "transfer_start": t - 0.005} if pull else
                      {"prefill_end": t - 0.01, "transfer_end": t - 0.005})
                reqs.append({"variant": "v", "rate": 1.0, "repeat": 0, "ok": True, "arrival": t - 0.1,
                             "prompt_len": tokens, "prefill_worker": "prefill0", "decode_worker": "decode0",
                             "phases": {**ph, "admitted": t + 0.0041}})
            t += 0.004 + 0.0002 + (0.0005 + 0.0008 * tokens / 1000 if n else 0) + (0.005 if i in stretched else 0)
        return steps, reqs

    h = host_times(*records([100, 400, 700, 1000, 1300, 1600], stretched=(5, 17, 41)))
    assert h["admit_ms"] == pytest.approx(0.5, abs=0.01) and h["admit_ktok_ms"] == pytest.approx(0.8, abs=0.01)
    push = host_times(*records([100, 400, 700, 1000, 1300, 1600], pull=False))
    assert push["admit_ktok_ms"] is None and push["admit_ms"] > 0.5
    alike = host_times(*records([700]))
    assert alike["admit_ktok_ms"] == 0.0 and alike["admit_ms"] == pytest.approx(0.5 + 0.8 * 0.7, abs=0.01)
    assert "admit_ktok_ms" in host_raw(h) and "admit_ktok_ms" not in host_raw(push)


def test_admit_time_is_a_decode_workers_gap_beyond_its_plain_one_per_hand_over_admitted():
    """A decode worker's gaps between back-to-back steps are 0.2 ms; one with a hand-over admitted in it is
    0.8 ms, one with two 1.4 ms: 0.6 ms a hand-over. A unified worker's admits nothing of the kind."""
    steps, reqs, t = [], [], 1.0
    for i in range(30):
        steps.append({"variant": "v", "rate": 1.0, "repeat": 0, "worker": "decode0", "role": "decode",
                      "start": t, "end": t + 0.004, "running": 2})
        n = 1 if i % 5 == 1 else 2 if i % 5 == 3 else 0
        for j in range(n):  # admitted in the gap after this step
            reqs.append({"variant": "v", "rate": 1.0, "repeat": 0, "ok": True, "arrival": t - 0.1,
                         "prefill_worker": "prefill0", "decode_worker": "decode0",
                         "phases": {"admitted": t + 0.004 + 0.0001 * (j + 1)}})
        t += 0.004 + 0.0002 + 0.0006 * n
    h = host_times(steps, reqs)
    assert h["admit_ms"] == pytest.approx(0.6) and h["samples"]["admits"] == 12  # gaps with hand-overs
    assert h["gap_ms"] == pytest.approx(0.2)
    unified = [dict(s, worker="unified0", role="unified") for s in steps]
    assert host_times(unified, [dict(r, prefill_worker="unified0", decode_worker="unified0") for r in reqs]
                      )["admit_ms"] is None


def test_a_profile_names_the_model_it_was_measured_on_and_a_check_compares_it(tmp_path, monkeypatch):
    from pdlab.recipe.model import ModelSpec
    from pdlab.timing.check import other_model

    def model(raw: dict) -> ModelSpec:
        return ModelSpec.from_raw({"dtype": "float32", **raw}, "model")

    prof = TimingProfile(name="box", step=STEP, model="cpu-demo", fit={"dtype": "float32"})
    assert other_model(prof, model({"preset": "cpu-demo"})) is None
    assert other_model(prof, model({"preset": "tiny-llama"})) == "ran tiny-llama float32; the profile, cpu-demo float32"
    assert "bfloat16" in other_model(prof, model({"preset": "cpu-demo", "dtype": "bfloat16"}))
    bf16 = prof.replace(fit={"dtype": "bf16"})  # spelled as --dtype took it: one dtype
    assert other_model(bf16, model({"preset": "cpu-demo", "dtype": "bfloat16"})) is None
    assert other_model(prof.replace(fit={"dtype": "auto"}), model({"preset": "cpu-demo", "dtype": "bfloat16"})) is None
    assert other_model(TimingProfile(name="old", step=STEP), model({"preset": "tiny-llama"})) is None  # says none
    (tmp_path / "m").mkdir()
    (tmp_path / "n").mkdir()
    at = TimingProfile(name="box", step=STEP, model=str(tmp_path / "m"))
    monkeypatch.chdir(tmp_path)
    assert other_model(at, model({"path": "./m"})) is None  # one directory, named two ways
    assert other_model(at, model({"path": "./n"})) is not None  # another directory
    assert other_model(at, model({"preset": "cpu-demo"})) is not None  # a preset, not that directory
    assert other_model(at, model({"path": "Qwen/Qwen3-0.6B"})) is None  # a hub id here: cannot be told, not claimed


def test_admit_time_is_never_below_zero_where_the_gaps_scatter_below_the_plain_one():
    """On a fast host the gaps with a tiny hand-over admitted can come out shorter than the plain gap (the CI
    failure of 2026-12-04: admit_ms -0.16, a profile that did not load). The line's foot stays at 0 and its
    slope goes through 0; pushes and pulls all alike give 0, not a negative median."""
    pulls = [(-0.0002 + 0.0006 * k / 1000, k / 1000, True) for k in (100, 300, 500, 700, 900) for _ in range(2)]
    admit_ms, ktok_ms = admit_fit(pulls)  # the line says -0.2 ms + 0.6 ms per 1000 tokens
    assert admit_ms == 0.0 and ktok_ms == pytest.approx(statistics.median(1000 * y / x for y, x, _ in pulls))
    assert ktok_ms == pytest.approx(0.2)  # through 0 and the pulls' median (500 tokens, 0.1 ms)
    assert admit_fit([(-0.0001, 0.5, False)] * 8) == (0.0, None)
    assert admit_fit([(-0.0001, 0.5, True)] * 8) == (0.0, 0.0)
    assert admit_fit([(-0.0001, 0.5, True)] * (MIN_SAMPLES - 1)) == (None, None)
