"""`pdlab profile`: the NNLS fit recovers known step models, measured steps carry the timed engine's counts,
the written profile loads and round-trips, and the command runs end to end on a tiny model. Timing accuracy
is not asserted here (a unit test on a shared box cannot hold it): BENCHMARKS.md has the measured errors."""

import itertools
import os

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.constants import CPU_KERNELS, PACKED_LINEAR
from pdlab.engine.host_malloc import tune_malloc
from pdlab.engine.runner import ModelRunner
from pdlab.commands.profile import default_out, main
from pdlab.engine.timed import StepCounts
from pdlab.recipe import RecipeError, StepTiming, TimingProfile, load_profile
from pdlab.recipe.timing import shipped_profiles
from pdlab.timing.fit import (KINDS, TERMS, StepSample, by_kind, errors, fit_steps, fit_transfer, nnls,
                              split_by_case)
from pdlab.timing import after_prefill
from pdlab.timing.contention import AFTER_STEPS
from pdlab.timing.pace import READ_MIB
from pdlab.timing.host_probe import BURST, BURSTS, CHAINED, CO_REQUESTS, REQUESTS
from pdlab.timing.measure import DECODE_LEAD, PRIMER_BLOCKS, Case, Limits, PoolSlices, Primer, design, run_case
from pdlab.timing.process import MeasureError, job_for, measure
from pdlab.timing.write import profile_raw, write_profile

TRUE = {"fixed_ms": 2.0, "prefill_token_ms": 0.05, "prefill_attention_ms": 0.03, "decode_seq_ms": 0.15,
        "context_token_ms": 0.0004, "chunk_ms": 0.4, "fresh_pair_ms": 0.05, "resumed_pair_ms": 0.02,
        "resumed_context_ms": 0.002, "knee_token_ms": 0.3, "knee_tokens": 32}


def synthetic(n: int = 300, seed: int = 0, noise: float = 0.0, coef: dict = TRUE) -> list[StepSample]:
    """Steps of all three kinds over a range like the designed one (prefill chunks fresh or resuming a prompt,
    one to three a step), timed by `coef` (times multiplicative noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % 3]
        pre = pairs = chunks = fresh = rpairs = rctx = 0
        for _ in range(int(rng.integers(1, 4)) if kind != "decode" else 0):
            n_tok = int(rng.integers(1, 1024))
            start = int(rng.integers(0, 3000)) if rng.random() < 0.5 else 0
            pre, chunks = pre + n_tok, chunks + 1
            pairs += n_tok * start + n_tok * (n_tok + 1) // 2
            if start:
                rpairs, rctx = rpairs + n_tok * (start + n_tok), rctx + start + n_tok
            else:
                fresh += n_tok * (n_tok + 1) // 2
        dec = int(rng.integers(1, 64)) if kind != "prefill" else 0
        ctx = dec * int(rng.integers(16, 3000))
        c = StepCounts(pre, dec, ctx, pairs, chunks, fresh, rpairs, rctx)
        ms = TimingProfile(step=StepTiming(**coef)).step_s(**c.to_dict()) * 1000
        ms *= 1 + noise * rng.standard_normal()
        out.append(StepSample(c, ms, case=i // 4))
    return out


# ---- the fit ----

def test_nnls_matches_a_brute_force_search_over_active_sets():
    rng = np.random.default_rng(1)
    for _ in range(200):
        m, n = int(rng.integers(3, 25)), int(rng.integers(1, 6))
        a = rng.normal(size=(m, n)) * 10.0 ** rng.uniform(-3, 3, size=n)  # columns of very different scales
        b = rng.normal(size=m)
        x = nnls(a, b)
        assert (x >= 0).all()
        best = np.inf
        for r in range(n + 1):
            for s in itertools.combinations(range(n), r):
                z = np.zeros(n)
                if s:
                    z[list(s)] = np.linalg.lstsq(a[:, list(s)], b, rcond=None)[0]
                if (z >= 0).all():
                    best = min(best, float(np.linalg.norm(a @ z - b)))
        assert np.linalg.norm(a @ x - b) <= best * (1 + 1e-7) + 1e-12


def test_nnls_clips_where_least_squares_goes_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # slope -1: least squares says [4, -1]
    assert np.allclose(np.linalg.lstsq(a, b, rcond=None)[0], [4, -1])
    assert np.allclose(nnls(a, b), [2.0, 0.0])  # the best with slope >= 0: the mean
    assert np.allclose(nnls(np.zeros((3, 2)), b), 0.0)  # zero columns: coefficient 0


def test_fit_recovers_exact_coefficients():
    coef = fit_steps(synthetic())
    assert coef["knee_tokens"] == 32  # of the candidate knees, the one the steps were timed with
    for k in TERMS:
        assert coef[k] == pytest.approx(TRUE[k], rel=1e-6), k
    flat = fit_steps(synthetic(coef=dict(TRUE, knee_token_ms=0.0)))
    assert flat["knee_tokens"] == 0 and flat["knee_token_ms"] == 0  # no knee in the steps: none in the fit
    e = errors(coef, synthetic(seed=5))
    assert e["mape_pct"] < 1e-4 and e["max_pct"] < 1e-4 and e["r2"] == pytest.approx(1.0)


def test_fit_recovers_a_zero_term_as_zero():
    truth = dict(TRUE, context_token_ms=0.0)
    coef = fit_steps(synthetic(coef=truth))
    assert coef["context_token_ms"] == pytest.approx(0.0, abs=1e-9)
    assert coef["fixed_ms"] == pytest.approx(2.0, rel=1e-6)


def test_fit_on_noisy_steps_is_close():
    train, test = synthetic(600, seed=2, noise=0.05), synthetic(300, seed=3, noise=0.05)
    coef = fit_steps(train)
    # the large terms come back closely; the attention terms overlap (every pair is causal, fresh or resumed
    # ones are also counted apart), so noise moves cost between them: their predictions are what holds
    for k in ("fixed_ms", "prefill_token_ms", "decode_seq_ms", "context_token_ms"):
        assert coef[k] == pytest.approx(TRUE[k], rel=0.1), k
    e = errors(coef, test)
    assert 2 < e["mape_pct"] < 6 and e["r2"] > 0.98  # about the noise's own 4% mean absolute deviation
    kinds = by_kind(coef, test)
    assert set(kinds) == set(KINDS) and all(kinds[k]["steps"] == 100 for k in KINDS)


def test_split_is_by_case_with_every_kind_on_both_sides():
    s = synthetic(120)
    case_kinds = {c: KINDS[c % 3] for c in range(30)}
    s = [StepSample(x.counts, x.ms, case=i % 30) for i, x in enumerate(s)]
    train, test = split_by_case(s, case_kinds, 0.3, np.random.default_rng(0))
    assert len(train) + len(test) == len(s)
    assert not {x.case for x in train} & {x.case for x in test}
    for side in (train, test):
        assert {case_kinds[x.case] for x in side} == set(KINDS)
    assert 0.2 < len(test) / len(s) < 0.4


def test_transfer_fit():
    sizes = [1e6, 4e6, 16e6]
    gbps, lat = fit_transfer(sizes, [0.0002 + b / 10e9 for b in sizes])
    assert gbps == pytest.approx(10.0, rel=1e-6) and lat == pytest.approx(0.2, rel=1e-6)
    with pytest.raises(ValueError):
        fit_transfer([1e6], [0.001])


# ---- measuring ----

def test_design_covers_every_kind():
    lim = Limits.for_device("cpu", 2048)
    cases = design(40, lim, np.random.default_rng(0))
    assert sum(c.expected_steps for c in cases) >= 40
    for k in KINDS:
        assert sum(c.kind == k for c in cases) >= 2
    assert all(max(c.prompts + c.decoders) <= lim.max_context for c in cases)


@pytest.fixture(scope="module")
def tiny():
    from pdlab.engine import load_model

    return load_model("tiny-llama")


def test_measured_steps_carry_the_timed_engines_counts(tiny):
    rng = np.random.default_rng(0)
    pre = [s.counts for s in run_case(tiny, Case("prefill", 64, True, (150,), (), 16), rng, case_id=7)]
    assert [(c.prefill_tokens, c.decode_seqs, c.context_tokens) for c in pre] == [(64, 0, 0), (64, 0, 0), (22, 0, 0)]
    assert [c.prefill_pairs for c in pre] == [64 * 65 // 2, 64 * 64 + 64 * 65 // 2, 22 * 128 + 22 * 23 // 2]
    # the first chunk is fresh; the next two resume the prompt: the rectangle n x (start + n), and the context
    assert [(c.chunks, c.fresh_pairs, c.resumed_pairs, c.resumed_context) for c in pre] == \
        [(1, 64 * 65 // 2, 0, 0), (1, 0, 64 * 128, 128), (1, 0, 22 * 150, 150)]
    dec = [s.counts for s in run_case(tiny, Case("decode", 64, True, (), (100, 40), 3), rng)]
    # a decode of a request holding c tokens attends c + 1 (its new token's KV is written first); the first
    # DECODE_LEAD steps of a new batch are not recorded (they run slower than its later ones, as few of a
    # run's do), so the first recorded one is the batch's DECODE_LEAD + 1st
    first = 142 + 2 * DECODE_LEAD
    assert [(c.prefill_tokens, c.decode_seqs, c.context_tokens, c.prefill_pairs, c.chunks) for c in dec] == \
        [(0, 2, first, 0, 0), (0, 2, first + 2, 0, 0), (0, 2, first + 4, 0, 0)]
    mixed = [s.counts for s in run_case(tiny, Case("mixed", 128, True, (200,), (50, 60, 70), 10), rng)]
    assert [(c.prefill_tokens, c.decode_seqs) for c in mixed] == [(125, 3), (75, 3)]  # stops once prefilled
    assert mixed[0].context_tokens == 51 + 61 + 71 and mixed[1].prefill_pairs == 75 * 125 + 75 * 76 // 2
    assert all(s.case == 7 and s.kind == "prefill" and s.ms > 0 and s.cpu_ms > 0
               for s in run_case(tiny, Case("prefill", 64, True, (80,), (), 16), rng, case_id=7))


def test_what_a_prefill_leaves_is_measured_within_the_models_context(tiny):
    """The after-prefill cases clip their contexts and prompts to the model's (a local model of a short context
    must not be asked for 1,000-token ones); each case gives its settled steps and AFTER_STEPS after a prefill."""
    lim = Limits(100, 8, 4096, (64,))
    clipped = after_prefill.cases(lim)
    assert len(clipped) == len(after_prefill.CASES)
    assert all(max(c.decoders) <= 100 and p <= 100 for c, p in clipped)
    got = after_prefill.measure_after_prefill(tiny, lim, np.random.default_rng(0), repeats=1)
    assert [len(x) for x in got["by_k"]] == [len(after_prefill.CASES)] * AFTER_STEPS
    assert len(got["settled"]) == after_prefill.SETTLED * len(after_prefill.CASES)


def test_case_pools_are_slices_of_one_worker_sized_pool(tiny):
    """Cases run in the first blocks of one pool allocated once, the primer in its last ones."""
    pool = torch.zeros(2, 2, 400, 16, 2, 16)
    slices = PoolSlices(pool)
    primer = Primer(tiny, np.random.default_rng(0), pool=slices)
    assert primer.eng.kv.data_ptr() == pool[:, :, 400 - primer.eng.blocks.num_blocks].data_ptr()
    steps = run_case(tiny, Case("prefill", 64, True, (150,), (), 16), np.random.default_rng(1), primer=primer,
                     pool=slices)
    assert len(steps) == 3 and pool[:, :, :10].abs().sum() > 0  # the case wrote its KV into the pool's head
    assert primer.eng.blocks.num_blocks == PRIMER_BLOCKS  # its reserve, which cases never reach
    slices.head((2, 2, 400 - PRIMER_BLOCKS, 16, 2, 16), pool.dtype)
    with pytest.raises(ValueError, match=f"at most {400 - PRIMER_BLOCKS} are this side's"):
        slices.head((2, 2, 401 - PRIMER_BLOCKS, 16, 2, 16), pool.dtype)
    with pytest.raises(ValueError, match="not a slice"):
        slices.head((2, 2, 10, 8, 2, 16), pool.dtype)


# ---- the profile file ----

def raw_profile(**over) -> dict:
    raw = profile_raw(name="t", source="measured", device="a CPU, 1 thread", date="2026-11-30", model="tiny-llama",
                      step={k: v if k == "knee_tokens" else v * 1.0000123 for k, v in TRUE.items()},
                      kv_bytes_per_token=512, kv_memory_gb=2.147,
                      transfer={"shm": {"gbps": 12.345678, "latency_ms": 0.0123456}},
                      fit={"train_steps": 10, "test_steps": 5, "held_out": {"mape_pct": 4.56789, "r2": None}})
    raw.update(over)
    return raw


def test_written_profile_loads_and_round_trips(tmp_path):
    path = write_profile(str(tmp_path / "sub" / "p.yaml"), raw_profile(), header="a comment\nover two lines")
    text = open(path).read()
    assert text.startswith("# a comment\n# over two lines\n")
    plain = yaml.safe_load(text)  # readable without pdlab
    assert plain["step"]["fixed_ms"] == 2.0 and plain["transfer"]["shm"]["gbps"] == 12.35  # 4 significant digits
    t = load_profile(path)
    assert (t.name, t.source, t.model, t.kv_bytes_per_token, t.kv_memory_gb) == ("t", "measured", "tiny-llama", 512,
                                                                                    2.147)
    assert t.step.prefill_token_ms == 0.05 and t.transfer_of("shm").latency_ms == 0.01235
    assert t.fit["held_out"] == {"mape_pct": 4.568, "r2": None}
    assert TimingProfile.from_raw(t.to_raw(), "again") == t
    assert t.describe() == "modelled timing: profile t (measured, a CPU, 1 thread, 2026-11-30)"


def test_a_profile_with_a_missing_key_is_one_line_error(tmp_path):
    raw = raw_profile(transfer={"shm": {"latency_ms": 0.1}})
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as e:
        load_profile(str(p))
    assert str(e.value) == f"model.timing ({p}).transfer.shm.gbps: missing; expected a number > 0 (GB/s, 1e9 bytes)"
    with pytest.raises(RecipeError):  # the writer checks before it writes
        write_profile(str(tmp_path / "never.yaml"), raw)
    assert not (tmp_path / "never.yaml").exists()


def test_shipped_profiles():
    names = shipped_profiles()
    assert {"cpu-demo-2core", "h200-0.6b-analytic"} <= set(names)
    cpu = load_profile("cpu-demo-2core")
    assert cpu.source == "measured" and cpu.model == "cpu-demo" and cpu.transfer_of("shm") is not None
    assert cpu.fit["test_steps"] > 0 and {"mape_pct", "p90_pct", "max_pct", "r2"} <= set(cpu.fit["held_out"])
    gpu = load_profile("h200-0.6b-analytic")
    assert gpu.source == "analytic" and gpu.model == "gpu-0.6b" and gpu.kv_bytes_per_token == 57344
    assert {k for k, _ in gpu.transfer} == {"cuda-ipc", "host", "nixl", "shm"}  # shm: timed workers on a CPU box
    assert gpu.transfer_of("shm") == gpu.transfer_of("cuda-ipc")


# ---- the command ----

@pytest.mark.slow
def test_steps_are_measured_in_a_process_set_up_as_a_worker(tiny):
    """Pinned to the core asked for, one torch thread, the kernels a runner of the model chooses here, malloc
    tuned: a worker's set-up (issue 25: a profile timed in the command's own process measured other code)."""
    core = sorted(os.sched_getaffinity(0))[-1]
    res = measure(job_for("tiny-llama", "float32", "cpu", [core], 20, 0))
    assert res["pid"] != os.getpid() and res["cores"] == [core] and res["threads"] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a verdict is per torch thread count; the worker's is one thread's
    try:
        here = ModelRunner(tiny, torch.zeros(2, 2, 8, 16, 2, 16), 16).kernels  # the same machine's choice
    finally:
        torch.set_num_threads(threads)
    # the C kernels' verdicts are the machine's cached ones; the packed GEMM's each process times for itself
    assert set(res["kernels"]) == set(here) == {*CPU_KERNELS, PACKED_LINEAR}
    assert {k: c for k, c in res["kernels"].items() if k != PACKED_LINEAR} == {
        k: c.to_dict() for k, c in here.items() if k != PACKED_LINEAR}
    assert res["malloc_tuned"] == tune_malloc()
    # the box's pace before and after the steps (pdlab.timing.pace), and its memory half apart
    assert len(res["pace_ms"]) == len(res["memory_pace_ms"]) == 2
    assert all(0 < m < t for t, m in zip(res["pace_ms"], res["memory_pace_ms"]))
    assert res["pace_read_mib"] == READ_MIB  # what the memory half read, kept so that paces compare like with like
    assert len(res["steps"]) >= 20 and {k for k in res["case_kinds"]} == set(KINDS)
    after = res["after_prefill"]  # pdlab.timing.after_prefill, in the same process
    cases = len(after_prefill.CASES) * after_prefill.REPEATS
    assert [len(x) for x in after["by_k"]] == [cases] * AFTER_STEPS
    assert len(after["settled"]) == after_prefill.SETTLED * cases and all(r > 0 for r in after["settled"])
    with pytest.raises(MeasureError, match="no-such-model"):  # the loader's one line, from the child
        measure(job_for("no-such-model", "float32", "cpu", [core], 20, 0))


@pytest.mark.slow
def test_profile_command_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "tiny.yaml"
    assert main(model="tiny-llama", steps=24, out=str(out), seed=3) == 0
    printed = capsys.readouterr().out
    assert "held-out error" in printed and f"wrote {out}" in printed and "host time:" in printed
    t = load_profile(str(out))
    assert t.source == "measured" and t.model == "tiny-llama" and t.name == "tiny" and t.device_kind == "cpu"
    assert t.kv_bytes_per_token == 512  # 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes
    assert t.kv_memory_gb > 0 and t.transfer_of("shm").gbps > 0
    assert 0 < t.memory_pace_ms < t.pace_ms  # the box's pace, and its memory half, while the steps ran
    assert t.pace_read_mib == READ_MIB
    assert any(getattr(t.step, k) > 0 for k in TERMS)
    assert set(t.kernels) == {*CPU_KERNELS, PACKED_LINEAR}
    assert all("use" in c and "why" in c for c in t.kernels.values())
    assert t.host.gap_ms > 0 and t.host.hop_ms > 0 and t.host.handoff_ms > 0  # from a real 1P1D deployment
    assert t.contention.after_prefill_x > 0 and 0 <= t.contention.after_prefill_decay <= 1  # measured beside
    assert t.contention.main_step_ms > 0  # the probe's main process's time per worker step
    # the probe's factors beside stepping workers are kept as measured, at 1 or more (its decode steps together:
    # hundreds)
    probed = t.fit["contention"]["probed"]
    assert probed["decode_x"] > 0 and t.contention.decode_x == max(probed["decode_x"], 1.0)
    assert t.contention.prefill_x == max(probed.get("prefill_x", 1.0), 1.0)
    # its pull hand-overs' join steps (one per request handed over) are read, and kept as read
    assert "join_ktok_ms" in probed and t.contention.join_ktok_ms == probed["join_ktok_ms"]
    assert t.host.send_ms > 0 and t.fit["host"]["samples"]["sends"] >= BURST  # bursts: the quickest one's
    # one at a time, prefills chained (warm prefill steps alone), bursts, staggered: every request served
    assert t.fit["host"]["requests"] == REQUESTS + CHAINED + BURSTS * BURST + CO_REQUESTS
    f = t.fit
    assert f["train_steps"] > 0 and f["test_steps"] > 0
    assert f["train_steps"] + f["test_steps"] == sum(f["steps_by_kind"].values()) >= 24
    assert {"mape_pct", "p90_pct", "max_pct", "r2"} <= set(f["held_out"])
    assert set(f["held_out_by_kind"]) == set(KINDS)
    assert f["dtype"] == "float32" and f["threads"] == 1 and f["cores"] == [sorted(os.sched_getaffinity(0))[-1]]
    assert 0 < f["cpu_share"] <= 1.05 and f["host"]["samples"]["hops"] >= 3
    assert f["after_prefill"]["steps"] > 0
    # the probe's real workers against the model just fitted (a figure, not a bound: the box moves)
    assert f["host"]["worker_steps"]["decode"] > 0 and "the host probe's workers, warm steps alone" in printed


def test_profile_command_line(tmp_path):
    r = CliRunner().invoke(app, ["profile", "--help"])
    assert r.exit_code == 0 and "--steps" in r.output and "--out" in r.output
    r = CliRunner().invoke(app, ["profile", "--model", "tiny-llama", "--steps", "3", "--out", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "--steps must be at least" in r.output
    r = CliRunner().invoke(app, ["profile", "--model", "no-such-model", "--steps", "20"])
    assert r.exit_code == 2 and "error:" in r.output and r.output.count("\n") == 1
    r = CliRunner().invoke(app, ["profile", "--model", "tiny-llama", "--dtype", "float64",
                                 "--out", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "--dtype must be one of float32" in r.output and r.output.count("\n") == 1
    assert not (tmp_path / "x.yaml").exists()
    assert default_out("cpu-demo", "cpu") == "profiles/cpu-demo-cpu.yaml"
    assert default_out("/models/Qwen3-0.6B/", "cuda:0") == "profiles/Qwen3-0.6B-cuda0.yaml"
