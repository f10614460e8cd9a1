"""Replaying a trace: hash-id blocks as tokens, the window, time and rate scaling, length_scale, clipping,
the recipe's `workload.trace` and `rates: [trace]`, and the summary's trace block."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from pdlab.recipe import RecipeError, dump_recipe, parse_recipe
from pdlab.traces import TraceError, read_trace
from pdlab.traces.replay import Replay
from pdlab.traces.report import NO_PREFIX, trace_summary
from pdlab.traces.tokens import TokenBlocks

DATA = os.path.join(os.path.dirname(__file__), "data")
MOONCAKE = os.path.join(DATA, "trace-mooncake.jsonl")
WIDE = 2 ** 31 - 1  # token range for the tests: random blocks never agree on a token by chance


def spec(**kw):
    """A workload.trace section's keys (Replay reads them by name)."""
    base = dict(start_s=0.0, duration_s=None, sample=1.0, limit=None, time_scale=1.0, length_scale=1.0)
    return SimpleNamespace(**{**base, **kw})


def mooncake(tmp_path, rows):
    """A Mooncake trace of (timestamp ms, input, output, hash ids) rows."""
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": ids}) + "\n"
                         for t, i, o, ids in rows))
    return read_trace(str(p), "mooncake")


# ---- hash ids -> token blocks ----

def test_equal_ids_give_identical_blocks_and_different_ids_different_ones():
    a, b = TokenBlocks(7, 64, 10, 4096), TokenBlocks(7, 64, 10, 4096)
    assert a.block(3) == b.block(3) and len(a.block(3)) == 64  # the same id, another instance: the same tokens
    assert a.block(3) != a.block(4)
    assert TokenBlocks(8, 64, 10, 4096).block(3) != a.block(3)  # the seed enters
    assert all(10 <= x < 4096 for x in a.block(3))
    p = a.prompt([3, 4], 100, key=(1,))
    assert p == a.block(3) + a.block(4)[:36]  # the last block partial
    tail = a.prompt([3], 100, key=(1,))
    assert tail[:64] == a.block(3) and tail[64:] == a.own((1,), 36) != a.own((2,), 36)


def test_prompts_share_exactly_the_blocks_their_ids_share(tmp_path):
    tr = mooncake(tmp_path, [(0, 1100, 5, [1, 2, 3]), (10, 1300, 5, [1, 2, 4]), (20, 700, 5, [5, 2])])
    r = Replay(tr, spec(), seed=0)
    p = r.prompts(0, 0, WIDE)
    assert [len(x) for x in p] == [1100, 1300, 700]
    assert p[0][:1024] == p[1][:1024] and p[0][1024] != p[1][1024]  # ids 1, 2 shared; 3 and 4 differ
    assert p[2][:512] != p[0][:512]
    assert p[2][512:700] == p[0][512:700]  # id 2 is the same block wherever it is


def _longest_earlier_prefix(prompts):
    """Brute force: each prompt's longest common prefix with any earlier one, over all prompt tokens."""
    prompts = [np.array(x) for x in prompts]
    hit = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = min(len(p), len(q))
            diff = np.flatnonzero(p[:n] != q[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        hit += best
    return hit / sum(len(p) for p in prompts)


def test_the_reuse_ratio_is_the_longest_earlier_prefix_of_the_prompts(tmp_path):
    r = Replay(read_trace(MOONCAKE, "mooncake"), spec(), seed=0)
    assert r.reuse_ratio() == pytest.approx(_longest_earlier_prefix(r.prompts(0, 0, WIDE)))
    assert 0.3 < r.reuse_ratio() < 0.9
    # partial last blocks: a later prompt reuses an earlier partial block only as far as it went
    tr = mooncake(tmp_path, [(0, 600, 1, [1, 2]), (1, 900, 1, [1, 2]), (2, 700, 1, [1, 2]), (3, 1030, 1, [1, 2, 3]),
                             (4, 300, 1, [1]), (5, 520, 1, [4, 2])])
    r = Replay(tr, spec(), seed=0)
    assert r.reuse_ratio() == pytest.approx(_longest_earlier_prefix(r.prompts(0, 0, WIDE)))
    assert r.reuse_ratio() == pytest.approx((0 + 600 + 700 + 900 + 300 + 0) / (600 + 900 + 700 + 1030 + 300 + 520))


# ---- window, sample, limit; time and rate scaling ----

def test_window_sample_and_limit():
    tr = read_trace(MOONCAKE, "mooncake")
    r = Replay(tr, spec(start_s=10.0, duration_s=20.0), seed=0)
    assert ((tr.t[r.index] >= 10) & (tr.t[r.index] < 30)).all()
    assert len(r) == int(((tr.t >= 10) & (tr.t < 30)).sum()) and r.offsets[0] == 0
    half = Replay(tr, spec(sample=0.5), seed=3)
    assert len(half) == 24 and list(half.index) == sorted(half.index)
    assert list(Replay(tr, spec(sample=0.5), seed=3).index) == list(half.index)  # the seed decides
    assert list(Replay(tr, spec(sample=0.5), seed=4).index) != list(half.index)
    assert list(Replay(tr, spec(limit=5), seed=0).index) == [0, 1, 2, 3, 4]
    with pytest.raises(TraceError, match="no request in the window"):
        Replay(tr, spec(start_s=1e6), seed=0)


def test_time_scale_stretches_the_trace_and_its_nominal_rate():
    tr = read_trace(MOONCAKE, "mooncake")
    one, half = Replay(tr, spec(), 0), Replay(tr, spec(time_scale=0.5), 0)
    assert np.allclose(half.offsets, one.offsets / 2)
    assert half.nominal_rate == pytest.approx(2 * one.nominal_rate)
    assert one.nominal_rate == pytest.approx(47 / tr.t[-1])
    assert half.arrivals(half.nominal_rate) == pytest.approx(list(half.offsets))  # its own pace: the trace


@pytest.mark.parametrize("rate", [0.5, 3.0, 12.0])
def test_a_rate_scales_the_gaps_keeping_their_pattern(rate):
    r = Replay(read_trace(MOONCAKE, "mooncake"), spec(), 0)
    a = np.array(r.arrivals(rate))
    assert a[0] == 0 and (len(a) - 1) / a[-1] == pytest.approx(rate)  # the realised mean rate is the rate asked
    assert np.allclose(np.diff(a) / a[-1], np.diff(r.offsets) / r.offsets[-1])  # the trace's bursts, compressed
    assert r.arrivals(math.inf) == [0.0] * len(r)


def test_a_trace_arriving_all_at_once_has_no_pace_to_scale(tmp_path):
    r = Replay(mooncake(tmp_path, [(5, 10, 2, [1]), (5, 10, 2, [2])]), spec(), 0)
    assert r.nominal_rate == math.inf
    with pytest.raises(TraceError, match="all arrive at the same time"):
        r.arrivals(2.0)


# ---- length_scale and clipping ----

def test_length_scale_shrinks_lengths_and_blocks_together(tmp_path):
    tr = mooncake(tmp_path, [(0, 1100, 100, [1, 2, 3]), (1, 512, 7, [1]), (2, 513, 1, [1, 2])])
    r = Replay(tr, spec(length_scale=0.125), 0)
    assert r.block_size == 64
    assert r.input_len.tolist() == [2 * 64 + 10, 64, 65]  # k ids still make k blocks, the last partial
    assert r.output_len.tolist() == [13, 1, 1]  # rounded up, never 0
    p = r.prompts(0, 0, WIDE)
    assert p[1] == p[0][:64] and p[2][:64] == p[0][:64]


@pytest.mark.parametrize("scale", [0.1, 0.125, 0.3, 1.0])
def test_a_scaled_prompt_keeps_one_block_per_id(scale):
    """Scaling each row's length alone could spill past its last id's block (0.1: 1023 tokens over 2 ids ->
    103 > 2 x 51); the blocks are scaled, and the last block's share of it."""
    tr = read_trace(MOONCAKE, "mooncake")
    r = Replay(tr, spec(length_scale=scale), 0)
    k = np.array([len(ids) for ids in tr.hash_ids])
    assert ((r.input_len > (k - 1) * r.block_size) & (r.input_len <= k * r.block_size)).all()
    assert r.input_len == pytest.approx(tr.input_len * scale, abs=r.block_size)


def test_lengths_over_the_context_are_clipped_and_counted():
    tr = read_trace(MOONCAKE, "mooncake")
    r = Replay(tr, spec(), 0, context=4096)
    over_in = int((tr.input_len > 4095).sum())
    assert over_in > 0 and r.clipped_input == over_in
    assert r.input_len.max() == 4095 and (r.input_len + r.output_len <= 4096).all()
    assert r.clipped_output == int((np.minimum(tr.input_len, 4095) + tr.output_len > 4096).sum())
    assert Replay(tr, spec(), 0).clipped_input == 0  # no context: nothing clipped
    assert r.facts()["clipped"] == {"context": 4096, "input": r.clipped_input, "output": r.clipped_output}


# ---- the recipe ----

RECIPE = {"model": {"preset": "tiny-llama"}, "rates": [1, 2],
          "workload": {"trace": {"format": "mooncake", "path": MOONCAKE, "length_scale": 0.125}},
          "variants": {"u": {"deployment": {"unified": {"devices": ["cpu:0"]}}}}}


def test_rates_trace_is_the_traces_own_pace():
    r = parse_recipe({**RECIPE, "rates": ["trace", 4],
                      "workload": {"trace": {**RECIPE["workload"]["trace"], "time_scale": 0.5}}})
    tr = read_trace(MOONCAKE, "mooncake")
    assert r.rates[0] == pytest.approx(2 * 47 / tr.t[-1]) and r.rates[1] == 4.0
    again = parse_recipe(yaml.safe_load(dump_recipe(r)))
    assert again.resolved("u").workload == r.resolved("u").workload  # the resolved recipe loads back


@pytest.mark.parametrize("change,msg", [
    ({"workload": {"trace": RECIPE["workload"]["trace"], "requests": 10}}, "workload.requests: not used with"),
    ({"workload": {"trace": {**RECIPE["workload"]["trace"], "format": "sharegpt"}}}, "workload.trace.format"),
    ({"workload": {"trace": {**RECIPE["workload"]["trace"], "path": "nope.jsonl"}}}, "workload.trace.path: file "
                                                                                     "not found"),
    ({"workload": {"trace": {**RECIPE["workload"]["trace"], "length_scale": 2}}}, "workload.trace.length_scale"),
    ({"workload": {"requests": 4}, "rates": ["trace"]}, "rates[0]: trace replays workload.trace"),
])
def test_recipe_errors_name_the_key(change, msg):
    with pytest.raises(RecipeError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        parse_recipe({**RECIPE, **change})


def test_a_malformed_trace_behind_rates_trace_is_a_recipe_error_naming_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 0, "input_length": 10, "output_length": 2}\n')
    with pytest.raises(RecipeError, match=f"{p}:2: missing key 'hash_ids'"):
        parse_recipe({**RECIPE, "rates": ["trace"], "workload": {"trace": {"format": "mooncake", "path": str(p)}}})


# ---- the summary's trace block ----

def _rec(variant, rate, prompt, cached, warmup=False):
    return {"variant": variant, "rate": rate, "prompt_len": prompt, "cached_tokens": cached, "ok": True,
            **({"warmup": True} if warmup else {})}


def test_the_summary_puts_the_traces_reuse_beside_the_measured_hit_rate():
    r = Replay(read_trace(MOONCAKE, "mooncake"), spec(), 0, context=4096)
    recs = [_rec("u", 2.0, 100, 50), _rec("u", 2.0, 100, 10), _rec("u", "inf", 200, 0), _rec("u", 2.0, 100, 100,
                                                                                                   warmup=True)]
    s = trace_summary({"u": r.facts()}, recs)
    assert s["reuse_ratio"] == pytest.approx(r.reuse_ratio()) and s["nominal_rate"] == pytest.approx(r.nominal_rate)
    u = s["variants"]["u"]
    assert u["prefix_hit_rate"] == pytest.approx(60 / 400)  # the warm-up request is not counted
    assert u["rates"][0] == {"rate": 2.0, "of_nominal": pytest.approx(2.0 / r.nominal_rate), "requests": 2,
                             "prefix_hit_rate": pytest.approx(0.3)}
    assert u["rates"][1]["rate"] == "inf" and u["clipped"]["input"] == r.clipped_input
    assert trace_summary({}, recs) is None


def test_formats_without_prefix_information_say_so():
    r = Replay(read_trace(os.path.join(DATA, "trace-burstgpt.csv"), "burstgpt"), spec(), 0)
    f = r.facts()
    assert f["prefix_info"] is False and f["reuse_ratio"] is None and f["dropped"] == {"failed (0 response tokens)": 4}
    assert trace_summary({"u": f}, [])["note"] == NO_PREFIX
    p = r.prompts(0, 0, WIDE)
    assert len({tuple(x[:16]) for x in p}) == len(p)  # every prompt its own tokens
