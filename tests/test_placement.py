"""Placement, one set of rules (pdlab.serve.placement) that the router and the simulator both follow: the decode
worker by the prefix it holds and then by room, selective routing by uncached prompt tokens, the failure
policy. A selective recipe goes the same way through timed worker processes (`pdlab run`) and through the
simulator (`pdlab run --simulate`): request by request, the same route and the same decode worker."""

import json
import os

import pytest
import yaml

from cli_helpers import pdlab as pdlab_here
from pdlab.recipe import parse_recipe
from pdlab.serve.placement import (WorkerView, after_failed_handover, choose_decode, least_loaded, mirrors_caches,
                                   place_arrival, prefill_locally)
from pdlab.sim.experiment import simulate_recipe
from pdlab.sim.plan import candidates, disagg_policy
from pdlab.workload import build_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def view(name, role="decode", load=0, room=100, cached=0):
    return WorkerView(name, role, load, room, 8, lambda p: cached)


PROMPT = list(range(100, 140))  # 40 tokens, 5 blocks of 8


# ---- the rules ----
def test_the_least_loaded_worker_takes_a_request_and_ties_go_to_the_first_name():
    assert least_loaded([view("u1", load=2), view("u0", load=3)]).name == "u1"
    assert least_loaded([view("u1", load=1), view("u0", load=1)]).name == "u0"
    assert least_loaded([]) is None


def test_the_decode_worker_holding_the_prefix_wins_when_it_has_room_for_the_rest():
    held, roomy = view("d0", room=3, cached=24), view("d1", room=90)
    c = choose_decode([held, roomy], PROMPT)
    assert (c.worker.name, c.cached) == ("d0", 24)  # 16 uncached tokens: 2 blocks, it has 3
    short = view("d0", room=1, cached=24)  # no room for the 2 blocks it lacks: its prefix does not count
    c = choose_decode([short, roomy], PROMPT)
    assert (c.worker.name, c.cached) == ("d1", 0)


def test_without_a_prefix_the_most_room_then_the_least_load_then_the_last_name_wins():
    assert choose_decode([view("d0", room=50), view("d1", room=40)], PROMPT).worker.name == "d0"
    assert choose_decode([view("d0", load=1), view("d1", load=2)], PROMPT).worker.name == "d0"
    assert choose_decode([view("d0"), view("d1")], PROMPT).worker.name == "d1"
    assert choose_decode([], PROMPT) is None


def test_selective_routing_counts_only_the_uncached_tokens():
    c = choose_decode([view("d0", cached=24)], PROMPT)  # 16 uncached
    assert prefill_locally(c, len(PROMPT), 20) and not prefill_locally(c, len(PROMPT), 16)
    assert not prefill_locally(c, len(PROMPT), 0)  # 0: every prompt goes to a prefill worker
    assert not prefill_locally(None, len(PROMPT), 20)


def test_where_a_request_goes_first_by_deployment_and_mode():
    ws = [view("p0", "prefill", load=1), view("p1", "prefill"), view("d0", cached=32), view("d1", room=200)]
    u = place_arrival([view("u0", "unified", load=1), view("u1", "unified")], PROMPT, "pull")
    assert (u.route, u.role, u.worker.name) == ("unified", "unified", "u1")
    pull = place_arrival(ws, PROMPT, "pull")
    assert (pull.route, pull.role, pull.worker.name) == ("remote", "prefill", "p1")
    push = place_arrival(ws, PROMPT, "push")  # its decode blocks first: d0 holds 32 of its tokens
    assert (push.route, push.role, push.worker.name) == ("remote", "decode", "d0")
    local = place_arrival(ws, PROMPT, "push", remote_min_tokens=16)  # 8 uncached < 16: d0 prefills it
    assert (local.route, local.role, local.worker.name) == ("local", "decode", "d0")
    none = place_arrival([view("d0")], PROMPT, "pull")
    assert (none.role, none.worker) == ("prefill", None)


def test_a_failed_hand_over_is_recomputed_only_when_asked_and_its_decode_worker_lives():
    assert after_failed_handover("recompute", True) == "recompute"
    assert after_failed_handover("recompute", False) == "fail"
    assert after_failed_handover("fail", True) == "fail"


def test_decode_caches_inform_placement_with_selective_routing_or_several_prefix_caching_decoders():
    assert mirrors_caches(True, 1, True, False)
    assert mirrors_caches(True, 2, False, True) and not mirrors_caches(True, 2, False, False)
    assert not mirrors_caches(True, 1, False, True) and not mirrors_caches(False, 0, False, True)


# ---- one selective recipe, through the simulator and through workers ----
THRESHOLD = 20  # uncached tokens from which a prompt is prefilled remotely
BLOCK = 8  # tokens per hash id once the trace's 512-token blocks are scaled by 1/64 (the engine's block size)
# pairs of requests arriving together; hash ids name 8-token blocks, equal ids equal blocks
PAIRS = [([1, 2, 3, 4, 5], [21]),  # 40 uncached: remote; 8: local
         ([1, 2, 3, 6], [11, 12, 13, 14]),  # 24 of 32 held where the first went: local; 32 new: remote
         ([11, 12, 13, 15], [1, 2, 3, 7, 8]),  # 24 held: local; 16 uncached: local
         ([31, 32, 33], [41, 42]),  # 24 new: remote; 16: local
         ([31, 32, 33, 34, 35, 36], [11, 12, 13, 14, 16, 17]),  # 24 uncached: remote, to the holder; 16: local
         ([51, 52, 53, 54], [61])]  # remote; local
# (route, decode worker) request by request, by the rules: 1P1D has one decode worker; in 1P2D a tie in room
# goes to the less loaded worker, then to the last name (decode1)
EXPECTED = {"1p1d-pull": [(r, "decode0") for r in ["remote", "local", "local", "remote", "local", "local",
                                                    "remote", "local", "remote", "local", "remote", "local"]],
            "1p2d-push": [("remote", "decode1"), ("local", "decode0"), ("local", "decode1"), ("remote", "decode0"),
                          ("local", "decode0"), ("local", "decode1"), ("remote", "decode1"), ("local", "decode0"),
                          ("remote", "decode1"), ("local", "decode0"), ("remote", "decode1"), ("local", "decode0")]}
PROFILE = {"name": "pretend-gpu", "source": "analytic", "device": "a pretend GPU", "date": "2026-11-30",
           "model": "tiny-llama", "step": {"fixed_ms": 3, "prefill_token_ms": 0.05, "decode_seq_ms": 0.2},
           "kv_bytes_per_token": 512, "kv_memory_gb": 0.01, "transfer": {"shm": {"gbps": 1.0, "latency_ms": 6.0}}}


def selective_recipe(d) -> str:
    """A trace of the pairs (1 s apart at its own pace, replayed at 2 req/s: 1.1 s apart), a timed model,
    prefix caching, selective routing; 1P1D pull and 1P2D push. Returns the recipe's path."""
    rows = [{"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 256, "hash_ids": ids}
            for i, pair in enumerate(PAIRS) for ids in pair]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "gpu.yaml").write_text(yaml.safe_dump(PROFILE))
    route = {"remote_prefill_min_tokens": THRESHOLD}
    recipe = {"name": "placement", "seed": 3, "warmup": 0,
              "model": {"preset": "tiny-llama", "timing": str(d / "gpu.yaml")},
              "engine": {"block_size": BLOCK, "kv_blocks": 128, "token_budget": 256, "max_running": 16,
                         "prefix_caching": True},
              "workload": {"trace": {"format": "mooncake", "path": str(d / "pairs.jsonl"),
                                     "length_scale": BLOCK / 512}},
              "rates": [2], "slo": {"ttft_ms": 1000, "itl_ms": 500},
              "variants": {
                  "1p1d-pull": {"deployment": {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                               "transport": "shm", "mode": "pull", "route": route}},
                  "1p2d-push": {"deployment": {"prefill": {"devices": ["cpu:0"]},
                                               "decode": {"replicas": 2, "devices": ["cpu:1"]},
                                               "share_devices": True, "transport": "shm", "mode": "push",
                                               "route": route}}}}
    path = d / "placement.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def placements(records) -> dict:
    """variant -> [(route, decode worker)] in request order, and the prefill worker of each local one."""
    out: dict = {}
    for r in sorted(records, key=lambda r: r["id"]):
        if r.get("warmup"):
            continue
        assert r["ok"], r["error"]
        if r["prefill_route"] == "local":
            assert r["prefill_worker"] == r["decode_worker"]  # prefilled where it decodes
        else:
            assert r["prefill_worker"] == "prefill0"
        out.setdefault(r["variant"], []).append((r["prefill_route"], r["decode_worker"]))
    return out


def test_the_simulator_routes_selectively_and_by_prefix_as_the_rules_say(tmp_path):
    from pdlab.recipe import load_recipe

    r = load_recipe(selective_recipe(tmp_path), [])
    res = simulate_recipe(r, {n: build_workload(v) for n, v in r.variants.items()})
    assert placements(res.requests) == EXPECTED
    local = [x for x in res.requests if x["prefill_route"] == "local"]
    assert all(x["phases"]["prefill_start"] <= x["phases"]["prefill_end"] for x in local)  # as a worker reports


def test_a_plan_keeps_the_recipes_selective_routing():
    raw = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "first_token": "prefill",
           "on_transfer_failure": "recompute", "route": {"remote_prefill_min_tokens": 256}}
    base = parse_recipe({"model": {"preset": "tiny-llama"},
                         "rates": [1], "slo": {"ttft_ms": 1000, "itl_ms": 100},
                         "variants": {"s": {"deployment": raw}}}).resolved("s")
    cands = candidates(3, ("pull",), policy=disagg_policy(base.deployment))
    disagg = [c for c in cands if "P" in c.name]
    assert disagg and all(c.deployment["route"] == {"remote_prefill_min_tokens": 256} and
                          c.deployment["first_token"] == "prefill" for c in disagg)
    assert all("route" not in c.deployment for c in cands if c.name.startswith("unified"))


@pytest.mark.slow
def test_workers_and_the_simulator_place_every_request_alike(tmp_path):
    """The same recipe through timed worker processes and through the simulator: request by request, the same
    route (prefill_route) and the same decode worker, as the rules say. Pairs arrive together and each pair
    ends long before the next: the router decides from settled reports, as the simulator from its engines."""
    path = selective_recipe(tmp_path)
    got = {}
    for how, flags in (("workers", []), ("simulated", ["--simulate"])):
        out = str(tmp_path / how)
        r = pdlab_here("run", path, "--out", out, *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(os.path.join(out, "requests.jsonl")) as f:
            got[how] = placements(json.loads(line) for line in f)
    assert got["workers"] == got["simulated"] == EXPECTED
