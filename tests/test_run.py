"""End to end through the CLI: a tiny recipe, unified and disaggregated, two rates."""

import json
import os
import shutil

import pytest

from cli_helpers import pdlab
from pdlab.measure.records import load_run
from pdlab.timing.pace import READ_MIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args) -> tuple[int, str, str]:
    """`pdlab ARGS` in this process: exit code, stdout, stderr."""
    r = pdlab(*args)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny recipe, its disaggregated variant's control plane over loopback TCP (the default, a private
    ipc:// socket, is what every Cluster test uses)."""
    out = str(tmp_path_factory.mktemp("runs") / "tiny")
    r = pdlab("run", TINY, "--out", out, "--set", f"variants.disagg.deployment.control=tcp://127.0.0.1:{free_port()}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == out
    return out


@pytest.mark.slow
def test_run_directory_has_every_file(tiny_run):
    for name in ("recipe.yaml", "env.json", "requests.jsonl", "steps.jsonl", "transfers.jsonl", "summary.json",
                 "trace.json", "goodput.png", "latency_cdf.png", "itl_timeline.png"):
        assert os.path.getsize(os.path.join(tiny_run, name)) > 0, name


@pytest.mark.slow
def test_every_request_served_and_disaggregated_equals_unified(tiny_run):
    run = load_run(tiny_run)
    measured = [r for r in run.requests if not r.get("warmup")]
    assert len(measured) == 2 * 2 * 6  # variants x rates x requests
    assert all(r["ok"] and len(r["output_ids"]) == 6 and len(r["token_times"]) == 6 for r in measured)
    by_variant = {}
    for r in measured:
        by_variant.setdefault(r["variant"], {})[(r["rate"], r["id"])] = (r["prompt_ids"], r["output_ids"])
    assert by_variant["unified"] == by_variant["disagg"]  # same seeded prompts, token-identical outputs
    assert {t["transport"] for t in run.transfers} == {"shm"}
    assert {t["request"] for t in run.transfers} >= {r["id"] for r in measured if r["variant"] == "disagg"}
    roles = {s["role"] for s in run.steps}
    assert roles == {"unified", "prefill", "decode"}


@pytest.mark.slow
def test_a_runs_decode_slots_are_its_decode_workers_steps_against_max_running(tiny_run):
    from pdlab.measure.slots import decode_slots

    run = load_run(tiny_run)
    got = run.summary["variants"]["disagg"]["decode_slots"]
    assert got["max_running"] == 8
    assert got["rates"] == decode_slots([s for s in run.steps if s["variant"] == "disagg"], 8)
    peak = max(s["decode_seqs"] for s in run.steps if s["variant"] == "disagg" and s["role"] == "decode"
               and not s.get("warmup") and s["rate"] in ("inf", float("inf")))
    assert got["rates"]["inf"]["decode0"]["peak"] == peak <= 6  # six requests: far from 8 slots, no warning
    assert run.summary["variants"]["unified"]["decode_slots"] is None
    assert not any("slots" in w for w in run.summary["warnings"])


@pytest.mark.slow
def test_the_run_records_which_kernels_each_worker_ran(tiny_run):
    """env.json and the summary say, per variant and worker, which CPU kernels ran and why the others did not."""
    run = load_run(tiny_run)
    workers = {v: set(w) for v, w in run.env["cpu_kernels"].items()}
    assert workers == {"unified": {"unified0"}, "disagg": {"prefill0", "decode0"}}
    for v, ws in run.env["cpu_kernels"].items():
        for w, kernels in ws.items():
            assert set(kernels) == {"decode_attention", "prefill_attention", "rotary", "swiglu", "rms_norm",
                                    "packed_linear"}
            for k, c in kernels.items():
                built = shutil.which(os.environ.get("CC") or "cc") is not None
                assert not (built and c["why"].startswith("not built")), (v, w, k, c)
                if c["why"].startswith("faster here") or c["why"] == "slower here":  # timed: the choice follows the numbers
                    assert c["use"] == (c["kernel_ms"] <= c["torch_ms"])
        assert run.summary["kernels"][v]["workers"] == ws and run.summary["kernels"][v]["describe"]
    assert "attention" not in run.env or "cpu" not in run.env["attention"]  # the old constant "sdpa" is gone
    # and the box's pace each CPU worker timed at its start (pdlab.timing.pace), for pdlab profile --check
    assert {v: set(ws) for v, ws in run.env["worker_pace_ms"].items()} == workers
    assert all(ms > 0 for ws in run.env["worker_pace_ms"].values() for ms in ws.values())
    assert {v: set(ws) for v, ws in run.env["worker_memory_pace_ms"].items()} == workers
    # the read each timed (a pace of another is not compared)
    assert run.env["worker_pace_read_mib"] == {v: {w: READ_MIB for w in ws} for v, ws in workers.items()}
    assert all(0 < run.env["worker_memory_pace_ms"][v][w] < run.env["worker_pace_ms"][v][w]
               for v, ws in workers.items() for w in ws)


def _measured(run, variant: str, rate: float) -> list[dict]:
    return [r for r in run.requests if r["variant"] == variant and float(r["rate"]) == rate and not r.get("warmup")]


@pytest.mark.slow
def test_summary_numbers_recomputed_by_hand(tiny_run):
    """Independently of pdlab's metric code, from requests.jsonl with numpy: counts, TTFT and ITL percentiles,
    TPOT, attainment (per-request p99 ITL), the saturation throughput and goodput (the highest finite rate
    whose attainment reaches the target, held to the saturation throughput)."""
    import numpy as np

    run = load_run(tiny_run)
    slo = run.summary["slo"]
    assert run.summary["alone"]["requests"] == 3 and run.summary["alone"]["ttft_ms"] > 0
    assert set(run.summary["alone_by_variant"]) == set(run.summary["variants"]) == {"unified", "disagg"}
    for variant, v in run.summary["variants"].items():
        tags = {float(t): t for t in v["rates"]}
        assert set(tags) == {20.0, float("inf")}
        attained = {}
        for rate, tag in tags.items():
            got, reqs = v["rates"][tag], _measured(run, variant, rate)
            assert len(reqs) == got["sent"] == got["completed"] == 6
            ttft = 1000 * np.array([r["token_times"][0] - r["arrival"] for r in reqs])
            gaps = 1000 * np.concatenate([np.diff(r["token_times"]) for r in reqs])
            for q in (50, 99):
                assert got["ttft_ms"][f"p{q}"] == pytest.approx(np.percentile(ttft, q))
                assert got["itl_ms"][f"p{q}"] == pytest.approx(np.percentile(gaps, q))
            assert got["ttft_ms"]["mean"] == pytest.approx(ttft.mean())
            tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) for r in reqs]
            assert got["tpot_ms"]["mean"] == pytest.approx(1000 * np.mean(tpot))
            met = [t <= slo["ttft_ms"] and np.percentile(1000 * np.diff(r["token_times"]), 99) <= slo["itl_ms"]
                   for t, r in zip(ttft, reqs)]
            attained[rate] = np.mean(met)
            assert got["attainment"] == pytest.approx(attained[rate])
        every = _measured(run, variant, float("inf"))
        sat = len(every) / (max(r["token_times"][-1] for r in every) - min(r["arrival"] for r in every))
        assert v["saturation"]["request_throughput"]["mean"] == pytest.approx(sat)
        # one finite rate: it passes (goodput is that rate, or the saturation throughput if lower) or fails (0)
        want = min(20.0, sat) if attained[20.0] >= slo["attainment"] else 0.0
        assert v["goodput"]["mean"] == pytest.approx(want)


@pytest.mark.slow
def test_trace_is_chrome_trace_json(tiny_run):
    with open(os.path.join(tiny_run, "trace.json")) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert {"X", "M"} <= {e["ph"] for e in events}
    steps = [e for e in events if e["ph"] == "X" and "prefill_tokens" in e.get("args", {})]
    assert steps and all({"ts", "dur", "pid", "tid", "name"} <= set(e) for e in steps)


@pytest.mark.slow
def test_compare_two_runs(tiny_run, tmp_path):
    r = pdlab("compare", tiny_run, tiny_run, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert len(result["rows"]) == 4 and result["baseline"]


@pytest.mark.parametrize("args,msg", [
    (["--set", "engine.long_prefill_token_threshold=9999", "--set", "engine.chunked_prefill=true"], "long_prefill_token_threshold"),
    (["--set", "rates=[-1, 2]"], "rates"),
    (["--set", "engine.blok_size=8"], "blok_size"),
    (["--set", "variants.disagg.deployment.decode.devices=[cpu:0]"], "cpu:0"),
    (["--set", "variants.disagg.deployment.decode.devices=[cpu:7]"], "cpu:7"),
    (["--set", "model.preset=nope"], "nope"),
    (["--variants", "nosuch"], "nosuch"),
    (["--set", "workload.token_high=100000"], "vocabulary"),
    (["--set", "workload.input_len={kind: fixed, value: 5000}"], "context of 2048"),
])
def test_bad_recipes_fail_in_one_line_and_start_nothing(args, msg, tmp_path):
    out = str(tmp_path / "never")
    code, _, stderr = cli("run", TINY, "--out", out, *args)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdlab run: error: ") and msg in lines[0], stderr
    assert not os.path.exists(out)


def test_missing_recipe_file(tmp_path):
    """As the installed command, in a process of its own: one line, exit 2, no traceback."""
    r = pdlab("run", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("make,msg", [
    (lambda p: p.mkdir(), "is a directory; expected a recipe YAML file"),
    (lambda p: p.write_text(""), "recipe: empty; expected at least rates and a deployment"),
])
def test_a_directory_or_an_empty_file_is_not_a_recipe(tmp_path, make, msg):
    path = tmp_path / "r.yaml"
    make(path)
    code, _, stderr = cli("run", str(path))
    assert code == 2 and msg in stderr, stderr


def test_out_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, stderr = cli("run", TINY, "--out", str(f))
    assert code == 2 and "not a directory" in stderr, stderr


@pytest.mark.slow
def test_control_plane_over_loopback_tcp(tiny_run):
    """The disaggregated variant of the tiny run talked to its workers over tcp://127.0.0.1 and served
    everything (test_every_request_served_and_disaggregated_equals_unified: the same tokens as unified)."""
    run = load_run(tiny_run)
    assert run.recipe["variants"]["disagg"]["deployment"]["control"].startswith("tcp://127.0.0.1:")
    reqs = [q for q in run.requests if q["variant"] == "disagg" and not q.get("warmup")]
    assert len(reqs) == 12 and all(q["ok"] for q in reqs)


@pytest.mark.slow  # the doctor's probes and a model load
def test_doctor_and_generate_commands():
    r = pdlab("doctor", "--probe-mb", "1")
    assert r.returncode == 0 and "shm" in r.stdout and "Traceback" not in r.stderr, r.stderr
    # the kernels' build and a cpu-demo worker's choice per kernel; with a compiler here they must have built
    assert "CPU kernels (pdlab.engine.cpu_kernel): " in r.stdout
    if shutil.which(os.environ.get("CC") or "cc"):
        assert "CPU kernels (pdlab.engine.cpu_kernel): built;" in r.stdout, r.stdout
        assert r.stdout.count("decode_attention: kernel") + r.stdout.count("decode_attention: torch: slower") == 1
    r = pdlab("generate", "--model", "tiny-llama", "--prompts", "2", "--prompt-len", "16", "--max-tokens", "4")
    assert r.returncode == 0 and "8 new tokens" in r.stdout, r.stdout + r.stderr
    r = pdlab("generate", "--model", "/no/such/model")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_goodput_by_search_with_repeats_and_a_relative_slo(tmp_path):
    """rates: auto, two repeats, SLO relative to one request alone: the summary resolves the SLO from the
    calibration, each repeat searches from its own saturation point, and goodput has an interval."""
    out = str(tmp_path / "auto")
    r = pdlab("run", TINY, "--out", out, "--variants", "unified", "--set", "rates=auto", "--set", "repeats=2",
              "--set", "search={max_trials: 2}", "--set", "slo={ttft: 50x, itl: 50x, itl_stat: max}")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["relative"] == {"ttft": 50.0, "itl": 50.0}
    assert s["slo"]["ttft_ms"] == pytest.approx(50 * s["alone"]["ttft_ms"])
    assert s["slo"]["itl_ms"] == pytest.approx(50 * s["alone"]["itl_ms"])
    v = s["variants"]["unified"]
    assert v["mode"] == "search" and len(v["repeats"]) == 2 and v["goodput"]["n"] == 2
    for rep in v["repeats"]:
        sat = rep["saturation"]["request_throughput"]
        trials = [t["rate"] for t in rep["goodput"]["trials"]]
        assert 1 <= len(trials) <= 2 and trials[0] == pytest.approx(sat / 2, rel=0.01)  # starts at half
        assert rep["goodput"]["goodput"] <= sat * 1.0001  # never above saturation
    reqs = [json.loads(x) for x in open(os.path.join(out, "requests.jsonl"))]
    assert {x["repeat"] for x in reqs} == {0, 1}
    seeds = {x["repeat"]: x["prompt_ids"] for x in reqs if x["rate"] == "inf" and not x.get("warmup")}
    assert seeds[0] != seeds[1]  # distinct requests per repeat
    c = pdlab("compare", out)
    assert c.returncode == 0 and "rates tried by each search" in c.stdout, c.stderr
