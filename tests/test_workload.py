import json
import math
import os

import numpy as np
import pytest

from pdlab.recipe import ArrivalSpec, WorkloadSpec
from pdlab.workload import WorkloadError, build_requests, build_warmup, load_dataset, rate_tag
from pdlab.workload import arrival_times as _arrival_times


def arrival_times(raw, rate, n, seed):
    return _arrival_times(ArrivalSpec.from_raw(raw, "arrival"), rate, n, seed)


def spec(raw):
    return WorkloadSpec.from_raw(raw, "workload")


W = {"requests": 200, "arrival": {"kind": "poisson"}, "input_len": {"kind": "uniform", "min": 20, "max": 40},
     "output_len": {"kind": "fixed", "value": 7}, "shared_prefix": None, "dataset": None,
     "token_low": 10, "token_high": None}


def test_same_seed_same_requests_and_arrivals():
    a = build_requests(spec(W), 2.0, seed=3, vocab_size=512)
    b = build_requests(spec(W), 2.0, seed=3, vocab_size=512)
    assert a == b
    c = build_requests(spec(W), 2.0, seed=4, vocab_size=512)
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_lengths_and_token_range():
    reqs = build_requests(spec(W), 1.0, seed=0, vocab_size=512)
    lens = [len(r.prompt_ids) for r in reqs]
    assert min(lens) >= 20 and max(lens) <= 40 and len(set(lens)) > 5
    assert all(r.output_len == 7 for r in reqs)
    ids = [t for r in reqs for t in r.prompt_ids]
    assert min(ids) >= 10 and max(ids) < 512  # special ids below token_low are avoided
    assert len({r.id for r in reqs}) == len(reqs)


def test_arrivals_scale_with_rate_and_start_at_zero():
    a1 = arrival_times({"kind": "poisson"}, 1.0, 1000, seed=0)
    a4 = arrival_times({"kind": "poisson"}, 4.0, 1000, seed=0)
    assert a1[0] == 0.0
    assert np.allclose(np.array(a1) / 4, a4)  # same pattern, compressed
    assert a1[-1] / 999 == pytest.approx(1.0, rel=0.1)  # mean gap 1/rate


@pytest.mark.parametrize("kind", [{"kind": "poisson"}, {"kind": "gamma", "burstiness": 0.5}])
def test_gaps_are_rescaled_so_the_realised_rate_is_the_nominal_one(kind):
    """Like vllm bench serve: 20 seeded poisson arrivals drift 10-20% off their rate; rescaled, (n - 1) gaps
    span exactly (n - 1) / rate. The pattern (relative gaps) is kept; rescale: false keeps the raw draw."""
    for seed in range(5):
        a = arrival_times(kind, 2.0, 20, seed)
        assert 19 / (a[-1] - a[0]) == pytest.approx(2.0, rel=1e-12)
        raw = arrival_times({**kind, "rescale": False}, 2.0, 20, seed)
        assert np.allclose(np.diff(a) / np.diff(a).sum(), np.diff(raw) / np.diff(raw).sum())
    drift = [abs(19 / arrival_times({**kind, "rescale": False}, 2.0, 20, s)[-1] / 2.0 - 1) for s in range(5)]
    assert max(drift) > 0.05  # without rescaling the realised rate is visibly off


def test_constant_burst_and_inf():
    assert arrival_times({"kind": "constant"}, 4.0, 4, 0) == [0.0, 0.25, 0.5, 0.75]
    # bursts of 2 every 2/rate seconds: the mean rate is kept
    assert arrival_times({"kind": "burst", "size": 2}, 2.0, 5, 0) == [0.0, 0.0, 1.0, 1.0, 2.0]
    assert arrival_times({"kind": "poisson"}, math.inf, 3, 0) == [0.0, 0.0, 0.0]


def test_gamma_burstiness_controls_spread():
    smooth = np.diff(arrival_times({"kind": "gamma", "burstiness": 10.0}, 1.0, 4000, 0))
    bursty = np.diff(arrival_times({"kind": "gamma", "burstiness": 0.25}, 1.0, 4000, 0))
    assert smooth.mean() == pytest.approx(1.0, rel=0.1) and bursty.mean() == pytest.approx(1.0, rel=0.15)
    assert np.std(smooth) < 0.5 < np.std(bursty)  # CV = 1/sqrt(burstiness)


def test_rate_changes_arrivals_and_prompts_but_not_the_distribution():
    a = build_requests(spec(W), 1.0, 0, 512)
    b = build_requests(spec(W), 2.0, 0, 512)
    # prompts differ per rate so a long-lived worker's prefix cache cannot hit the previous rate's prompts
    assert a[0].prompt_ids != b[0].prompt_ids
    assert a[1].arrival == pytest.approx(2 * b[1].arrival)


def test_shared_prefix_groups():
    w = spec(dict(W, shared_prefix={"groups": 3, "len": 16, "share": 0.5}))
    reqs = build_requests(w, 1.0, 0, 512)
    grouped = [r for r in reqs if r.prefix_group is not None]
    assert 0.35 < len(grouped) / len(reqs) < 0.65
    heads = {r.prefix_group: r.prompt_ids[:16] for r in grouped}
    assert len(heads) == 3
    for r in grouped:
        assert r.prompt_ids[:16] == heads[r.prefix_group]
        assert 20 <= len(r.prompt_ids) <= 40  # the prefix is part of the input length
    warm = build_warmup(w, 0, 512, n=4)
    assert [r.prefix_group for r in warm] == [0, 1, 2, 0]
    assert all(r.prompt_ids[:16] == heads[r.prefix_group] for r in warm)
    other_rate = build_requests(w, 4.0, 0, 512)
    for r in other_rate:
        if r.prefix_group is not None:
            assert r.prompt_ids[:16] == heads[r.prefix_group]  # same prefixes at every rate


def test_dataset_ids_and_text(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt_ids": [11, 12, 13], "output_len": 5}) + "\n\n"
                 + json.dumps({"prompt": "a b", "output_len": 2}) + "\n")
    rows = load_dataset(str(p), tokenizer=lambda s: [100 + len(w) for w in s.split()])
    assert rows == [{"prompt_ids": [11, 12, 13], "output_len": 5}, {"prompt_ids": [101, 101], "output_len": 2}]
    w = spec(dict(W, requests=4, dataset=str(p), input_len={"kind": "dataset"}, output_len={"kind": "dataset"}))
    reqs = build_requests(w, 1.0, 0, 512, tokenizer=lambda s: [100 + len(x) for x in s.split()])
    pairs = sorted((tuple(r.prompt_ids), r.output_len) for r in reqs)
    assert pairs == [((11, 12, 13), 5)] * 2 + [((101, 101), 2)] * 2  # each line once before any repeats


def test_dataset_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    with pytest.raises(WorkloadError, match="tokenizer"):
        load_dataset(str(p))
    p.write_text('{"prompt_ids": [1, 9999]}\n')
    with pytest.raises(WorkloadError, match="outside the vocabulary"):
        load_dataset(str(p), vocab_size=512)
    p.write_text('{"nope": 1}\n')
    with pytest.raises(WorkloadError, match=":1: expected prompt_ids or prompt"):
        load_dataset(str(p))


def test_token_range_must_fit_vocab():
    with pytest.raises(WorkloadError):
        build_requests(spec(dict(W, token_high=1000)), 1.0, 0, 512)


def test_warmup_is_separate_and_immediate():
    wu = build_warmup(spec(W), 0, 512, n=2)
    assert [r.arrival for r in wu] == [0.0, 0.0]
    assert wu[0].id.startswith("warmup-")
    assert wu[0].prompt_ids != build_requests(spec(W), math.inf, 0, 512)[0].prompt_ids


def test_rate_tag():
    assert [rate_tag(r) for r in (2.0, 0.5, math.inf, 12.0)] == ["2", "0.5", "inf", "12"]


def test_a_mixture_of_lengths_draws_each_part_by_its_weight():
    mix = {"kind": "mixture", "parts": [{"weight": 3, "kind": "uniform", "min": 16, "max": 32},
                                        {"weight": 1, "kind": "fixed", "value": 300}]}
    w = spec(dict(W, requests=400, input_len=mix))
    reqs = build_requests(w, 2.0, seed=0, vocab_size=512)
    lens = [len(r.prompt_ids) for r in reqs]
    long = sum(n == 300 for n in lens)
    assert all(16 <= n <= 32 or n == 300 for n in lens)
    assert 0.18 < long / len(lens) < 0.32  # a quarter, give or take the draw
    assert build_requests(w, 2.0, seed=0, vocab_size=512) == reqs  # seeded
    assert w.input_len.shortest == 16 and w.input_len.mean == pytest.approx((3 * 24 + 300) / 4)
    assert spec(w.to_raw()) == w  # round trip through recipe.yaml


# ---- a trace as the workload (pdlab.traces) ----

TRACE = {"trace": {"format": "mooncake", "path": os.path.join(os.path.dirname(__file__), "data", "trace-mooncake.jsonl"),
                   "length_scale": 0.125}}


def test_a_trace_replays_the_same_prompts_at_every_rate_with_its_gaps_scaled():
    w = spec(TRACE)
    a, b = build_requests(w, 2.0, 0, 4096), build_requests(w, 4.0, 0, 4096)
    assert len(a) == len(b) == 48 and len({r.id for r in a}) == 48
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]  # each rate starts from a cold cache
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert np.allclose([r.arrival for r in a], [2 * r.arrival for r in b])
    assert 47 / a[-1].arrival == pytest.approx(2.0)
    assert [r.prompt_ids for r in build_requests(w, 3.0, 0, 4096, stream="search")] == [r.prompt_ids for r in a]
    assert [r.prompt_ids for r in build_requests(w, 2.0, 1, 4096)] != [r.prompt_ids for r in a]  # seed + i


def test_trace_warmup_requests_have_trace_lengths_and_tokens_of_their_own():
    w = spec(TRACE)
    measured = build_requests(w, 2.0, 0, 4096)
    warm = build_warmup(w, 0, 4096, n=5)
    assert len(warm) == 5 and all(r.arrival == 0.0 for r in warm)
    lengths = {len(r.prompt_ids) for r in measured}
    assert all(len(r.prompt_ids) in lengths for r in warm)
    blocks = {tuple(r.prompt_ids[i:i + 16]) for r in measured for i in range(0, len(r.prompt_ids) - 15, 16)}
    assert not any(tuple(r.prompt_ids[:16]) in blocks for r in warm)  # never a cache hit for a measured prompt
