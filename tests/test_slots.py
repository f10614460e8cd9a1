"""A decode worker's slots (pdlab.measure.slots): how close its running batch came to engine.max_running, rate
by rate; a run or forecast at or near that limit says so, since an admitted request then waits for a slot and
that wait is its first ITL gap."""

from pdlab.constants import SLOTS_NEAR
from pdlab.measure.slots import decode_slots, slots_warning
from pdlab.recipe import parse_recipe
from pdlab.sim.experiment import simulate_recipe
from pdlab.workload import build_workload
from test_replay import PROFILE


def step(worker: str, role: str, running: int, waiting: int = 0, rate="inf", **tag) -> dict:
    """A step that decoded `running` sequences and left `running` in the batch (none finished)."""
    return {"variant": "pd", "rate": rate, "repeat": 0, "worker": worker, "role": role, "running": running,
            "decode_seqs": running, "waiting": waiting, **tag}


def test_a_decode_workers_peak_and_its_full_steps_are_read_rate_by_rate():
    steps = ([step("decode0", "decode", n) for n in (3, 8, 8)] + [step("decode0", "decode", 8, waiting=2)]
             + [step("decode0", "decode", 2, rate=5.0)]
             + [step("decode0", "decode", 6, rate=float("inf"))]  # the same rate as a number: one rate
             + [{**step("decode0", "decode", 7), "decode_seqs": 8}]  # decoded 8, one finished
             + [step("decode0", "decode", 8, waiting=9, warmup=True)]  # warm-up: not read
             + [step("prefill0", "prefill", 8, waiting=5)])  # a prefill worker's queue is TTFT, not a slot's wait
    got = decode_slots(steps, max_running=8)
    assert got == {"inf": {"decode0": {"peak": 8, "full": 1 / 6, "steps": 6}},
                   "5": {"decode0": {"peak": 2, "full": 0.0, "steps": 1}}}


def test_the_warning_names_the_worker_and_rate_full_or_near_and_nothing_below():
    below = {"5": {"decode0": {"peak": 10, "full": 0.0, "steps": 9}}}
    assert slots_warning("pd", below, 32) is None
    near = {"5": {"decode0": {"peak": 10, "full": 0.0, "steps": 9}},
            "inf": {"decode0": {"peak": int(SLOTS_NEAR * 32) + 1, "full": 0.0, "steps": 9}}}
    line = slots_warning("pd", near, 32, modelled="simulated in virtual time")
    assert line.startswith(f"pd: decode worker decode0 decoded up to {int(SLOTS_NEAR * 32) + 1} of its 32 slots")
    assert "at inf req/s (simulated)" in line and "engine.max_running" in line
    timed = slots_warning("pd", near, 32, modelled="timing model profile box (measured)")
    assert "at inf req/s (under its timing model)" in timed  # a timed run ran: it is not a simulation
    full = {**near, "20": {"decode0": {"peak": 32, "full": 0.07, "steps": 90}}}
    line = slots_warning("pd", full, 32)
    assert "ran all 32 of its slots" in line and "waiting in 7% of its steps at 20 req/s" in line
    assert "(simulated)" not in line


def test_a_forecast_whose_decode_worker_fills_its_slots_says_so_in_its_summary():
    raw = {"name": "slots", "seed": 3, "warmup": 0, "repeats": 1,
           "model": {"preset": "tiny-llama", "timing": PROFILE.to_raw()},
           "engine": {"block_size": 16, "kv_blocks": 512, "max_running": 4},
           "workload": {"requests": 12, "input_len": {"kind": "fixed", "value": 40},
                        "output_len": {"kind": "fixed", "value": 48}},
           "rates": [".inf"], "slo": {"ttft_ms": 1000, "itl_ms": 100},
           "variants": {"pd": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                              "transport": "shm", "mode": "pull"}},
                        "unified": {"deployment": {"unified": {"devices": ["cpu:0"]}}}}}
    r = parse_recipe(raw)
    s = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()}).summary()
    slots = s["variants"]["pd"]["decode_slots"]
    assert slots["max_running"] == 4 and slots["rates"]["inf"]["decode0"]["peak"] == 4
    assert slots["rates"]["inf"]["decode0"]["full"] > 0
    assert any(w.startswith("pd: decode worker decode0 ran all 4 of its slots") and "(simulated)" in w
               for w in s["warnings"])
    assert s["variants"]["unified"]["decode_slots"] is None  # no decode worker
