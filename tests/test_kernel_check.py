"""A runner uses each CPU kernel only where it applies and timed faster than the torch path it replaces on this
machine; the verdict is cached beside the build; what was chosen, and why, reaches the worker's Ready message,
env.json, the summary and one warning line when kernels fell back."""

import json
import os
import shutil

import pytest
import torch

from engine_helpers import engine, hf_greedy, prompts, reference, run
from pdlab.constants import CPU_KERNEL_ENV, CPU_KERNELS, PACKED_LINEAR
from pdlab.engine import cpu_kernel, kernel_check
from pdlab.engine.kernel_check import Choice, Shape, cache_key, choose
from pdlab.measure.kernels import KernelLog, describe, fell_back
from pdlab.timing.pace import READ_MIB, Pace

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here")
SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, hidden=48, intermediate=80)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Check verdicts go to an empty directory; kernels as the process built them; nothing turned off."""
    monkeypatch.setattr(kernel_check, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_off", {})
    monkeypatch.setenv(CPU_KERNEL_ENV, "auto")
    if cpu_kernel.load() is None:
        pytest.skip(f"CPU kernels: {cpu_kernel.status()}")
    return tmp_path


def fake_races(monkeypatch, times: dict[str, tuple[float, float]]) -> list[str]:
    timed: list[str] = []

    def race(name):
        return lambda k, s, g: (timed.append(name), times[name])[1]

    monkeypatch.setattr(kernel_check, "RACES", {n: race(n) for n in CPU_KERNELS})
    return timed


@needs_cc
def test_a_kernel_slower_here_is_not_used_and_the_verdict_is_cached(fresh, monkeypatch):
    times = {n: (1.0, 2.0) for n in CPU_KERNELS} | {"prefill_attention": (3.0, 1.0)}
    timed = fake_races(monkeypatch, times)
    got = choose(SHAPE, torch.float32)
    assert sorted(timed) == sorted(CPU_KERNELS)
    assert got["prefill_attention"] == Choice(False, "slower here", 3.0, 1.0)
    assert all(got[n].use and got[n].why == "faster here" for n in CPU_KERNELS if n != "prefill_attention")
    assert not cpu_kernel.active("prefill_attention") and cpu_kernel.active("decode_attention")
    cached = json.load(open(next(fresh.glob("check-*.json"))))
    assert cached[cache_key(SHAPE, torch.get_num_threads())]["prefill_attention"] == [3.0, 1.0]
    timed.clear()
    assert choose(SHAPE, torch.float32) == got and not timed, "timed again instead of reading the cache"
    other = Shape(8, 2, 16, 48, 80)
    choose(other, torch.float32)
    assert sorted(timed) == sorted(CPU_KERNELS), "another shape is timed on its own"
    timed.clear()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        choose(SHAPE, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert sorted(timed) == sorted(CPU_KERNELS), "another torch thread count is timed on its own"


@needs_cc
def test_a_later_runner_of_another_shape_can_turn_a_kernel_back_on(fresh, monkeypatch):
    fake_races(monkeypatch, {n: (3.0, 1.0) for n in CPU_KERNELS})
    choose(SHAPE, torch.float32)
    assert not any(cpu_kernel.active(n) for n in CPU_KERNELS)
    fake_races(monkeypatch, {n: (1.0, 3.0) for n in CPU_KERNELS})
    choose(Shape(8, 2, 16, 48, 80), torch.float32)
    assert all(cpu_kernel.active(n) for n in CPU_KERNELS)


@needs_cc
def test_real_timings_decide_by_the_numbers(fresh):
    got = choose(SHAPE, torch.float32)
    for n, c in got.items():
        assert c.kernel_ms > 0 and c.torch_ms > 0, (n, c)
        assert c.use == (c.kernel_ms <= c.torch_ms) and c.why == ("faster here" if c.use else "slower here")


def test_modes_shapes_and_devices(fresh, monkeypatch):
    timed = fake_races(monkeypatch, {n: (1.0, 2.0) for n in CPU_KERNELS})
    monkeypatch.setenv(CPU_KERNEL_ENV, "off")
    assert all(c == Choice(False, f"off ({CPU_KERNEL_ENV}=off)") for c in choose(SHAPE, torch.float32).values())
    monkeypatch.setenv(CPU_KERNEL_ENV, "on")
    assert all(c.use and "untimed" in c.why for c in choose(SHAPE, torch.float32).values())
    assert not timed
    monkeypatch.setenv(CPU_KERNEL_ENV, "auto")
    bf16 = choose(SHAPE, torch.bfloat16)
    assert all(not c.use and c.why.startswith("does not apply: bfloat16") for c in bf16.values())
    wide = choose(Shape(16, 1, 16, 48, 80), torch.float32)  # 16 query heads per K/V head: beyond prefill's rows
    assert wide["prefill_attention"].why.startswith("does not apply") and wide["decode_attention"].use
    assert all(c.why == "does not apply: cuda" for c in choose(SHAPE, torch.bfloat16, "cuda").values())


@needs_cc
@pytest.mark.parametrize("preset", ["tiny-llama"])
def test_an_engine_runs_torch_where_the_kernel_lost(fresh, monkeypatch, preset):
    """The runner follows the verdict: the prefill kernel lost here, so SDPA prefills; tokens are transformers'."""
    fake_races(monkeypatch, {n: (1.0, 2.0) for n in CPU_KERNELS} | {"prefill_attention": (2.0, 1.0)})
    calls = {"decode": 0, "prefill": 0}
    real_d, real_p = cpu_kernel.decode_attention, cpu_kernel.prefill_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a: (calls.__setitem__("decode", calls["decode"] + 1),
                                                                    real_d(*a)))
    monkeypatch.setattr(cpu_kernel, "prefill_attention", lambda *a: (calls.__setitem__("prefill", 1), real_p(*a)))
    reqs = prompts([5, 17, 40])
    eng = engine(preset, block_size=16, kv_blocks=64)
    assert eng.runner.kernels["prefill_attention"].why == "slower here"
    outs, _ = run(eng, reqs, max_tokens=8)
    ref = reference(preset)
    assert outs == {str(i): hf_greedy(ref, p, 8) for i, p in enumerate(reqs)}
    assert calls["decode"] > 0 and calls["prefill"] == 0


def choices(**why: str) -> dict:
    return {n: Choice(why.get(n, "faster here") == "faster here", why.get(n, "faster here"), 1.0, 2.0).to_dict()
            for n in CPU_KERNELS}


def test_the_run_says_what_ran_and_warns_when_kernels_fell_back(tmp_path):
    class Rd:
        env: dict = {}

        def update_env(self, **kw):
            self.env.update(kw)

    class View:
        notes: list = []

        def note(self, line):
            self.notes.append(line)

    class W:
        def __init__(self, name, kernels, pace=None):
            self.name, self.kernels, self.pace = name, kernels, pace

    rd, view = Rd(), View()
    log = KernelLog(rd, view)
    assert log.record("unified", [W("unified0", choices()), W("unified1", choices())]) is None
    assert describe(log.by_variant["unified"]) == "5 of 5 CPU kernels"
    slower = choices(prefill_attention="slower here")
    assert log.record("pd", [W("prefill0", slower), W("decode0", slower)]) is None  # a choice, not a fall-back
    assert "torch for prefill_attention (slower here: 1 vs 2 ms)" in describe(log.by_variant["pd"])
    broken = choices(decode_attention="not built: no C compiler (cc not found)")
    warning = log.record("broken", [W("unified0", broken)])
    assert warning and "decode_attention (not built: no C compiler" in warning and log.warnings == [warning]
    assert fell_back(log.by_variant["broken"]) == ["unified0: decode_attention (not built: no C compiler (cc not "
                                                   "found))"]
    assert set(rd.env["cpu_kernels"]) == {"unified", "pd", "broken"}
    assert log.facts()["pd"]["describe"] == describe(log.by_variant["pd"])
    assert describe({"unified0": {}}) == "no model runs (modelled timing)"
    assert log.record("vllm", [type("Server", (), {"name": "s0"})()]) is None and "vllm" not in log.by_variant
    # the box's pace each worker timed at its start, its memory half and the read it timed (a worker on a node
    # may run another checkout's), each under its own key of env.json
    assert "worker_pace_ms" not in rd.env  # none reported one so far (timed engines, external servers)
    log.record("paced", [W("prefill0", choices(), Pace(1.25, 1.25)), W("decode0", choices(), Pace(1.25, 1.0, 32)),
                         W("timed0", {})])
    assert rd.env["worker_pace_ms"] == {"paced": {"prefill0": 2.5, "decode0": 2.25}}
    assert rd.env["worker_memory_pace_ms"] == {"paced": {"prefill0": 1.25, "decode0": 1.0}}
    assert rd.env["worker_pace_read_mib"] == {"paced": {"prefill0": READ_MIB, "decode0": 32}}
    got = log.reported()  # what the harness hands the profile check at the run's end
    assert (got["paces"], got["memory_paces"], got["pace_reads"]) == tuple(
        rd.env[k] for k in ("worker_pace_ms", "worker_memory_pace_ms", "worker_pace_read_mib"))
    assert got["kernels"] is log.by_variant


@pytest.mark.slow
@needs_cc
def test_a_worker_reports_its_kernels_in_ready():
    from pdlab.engine.config import EngineConfig
    from pdlab.recipe import Deployment, ModelSpec
    from pdlab.serve.cluster import Cluster

    dep = Deployment.from_raw({"unified": {"devices": ["cpu:0"]}}, "deployment")
    with Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"), EngineConfig(block_size=16, kv_blocks=64),
                 dep) as c:
        c.start()
        kernels = c.workers[0].kernels
    assert set(kernels) == {*CPU_KERNELS, PACKED_LINEAR}
    for k in kernels.values():
        assert k["why"] in ("faster here", "slower here") or k["why"].startswith(("on (", "does not apply")), k


def test_compare_says_which_kernels_each_variant_ran(tmp_path):
    """summary.json's `kernels` (KernelLog.facts) becomes one header line per set of kernels."""
    import report_runs as rr
    from pdlab.measure.records import load_run
    from pdlab.report.compare import compare
    from pdlab.report.tables import header

    path = rr.make(tmp_path / "run", {"unified": rr.variant(rr.UNIFIED, {}), "pd": rr.variant(rr.DISAGG, {})})
    summary = json.load(open(os.path.join(path, "summary.json")))
    slower = choices(prefill_attention="slower here")
    summary["kernels"] = {"unified": {"workers": {"unified0": slower}, "describe": describe({"unified0": slower})},
                          "pd": {"workers": {"prefill0": slower, "decode0": slower},
                                 "describe": describe({"prefill0": slower, "decode0": slower})}}
    json.dump(summary, open(os.path.join(path, "summary.json"), "w"))
    lines = [x.text for x in header(compare([load_run(path)]))]
    want = "CPU kernels of unified, pd: 4 of 5 CPU kernels; torch for prefill_attention (slower here: 1 vs 2 ms)"
    assert want in lines, lines


def test_torch_capped_at_another_isa_races_anew(monkeypatch, tmp_path):
    """The verdicts' file is per torch side too: with torch's kernels capped at another ISA (ATEN_CPU_CAPABILITY)
    the race is run again instead of reading the uncapped verdict."""
    k = cpu_kernel.Kernels.__new__(cpu_kernel.Kernels)
    k.paths = {"decode_attention": "/x/decode_attention-abc.so"}
    first = kernel_check._check_file(k)
    real = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: f"{real}-capped")
    assert kernel_check._check_file(k) != first
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: real)
    assert kernel_check._check_file(k) == first  # the same torch side: the same file
