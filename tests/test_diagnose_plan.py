"""pdlab diagnose's plan and its gate: the plan is an upper bound of the traffic (hard caps, the server's limit,
what the token cap leaves), every send passes the gate, which refuses what the plan does not allow."""

import asyncio
import json
import re

import pytest

from pdlab.diagnose.budget import Budget, Exhausted
from pdlab.diagnose.connect import Target
from pdlab.diagnose.lengths import read_lengths
from pdlab.diagnose.phases import Runner
from pdlab.diagnose.plan import CHECK_REQUESTS, Caps, Options, PlanError, build_plan, render
from pdlab.diagnose.prompts import ID_RANGE, prompt


def opts(**kw):
    return Options("http://h/v1", "m", **kw)


def test_probe_lengths_over_the_servers_limit_are_dropped_and_said():
    plan = build_plan(opts(lengths=(500, 1000, 2000, 4000, 8000), repeats=3), server_max_len=4096)
    assert [p.prompt_len for p in plan.probes] == [500] * 3 + [1000] * 3 + [2000] * 3 + [4000] * 3
    assert plan.dropped == (8000,) and "dropped: 8000" in render(plan)
    assert build_plan(opts(max_model_len=2100)).dropped == (4000, 8000)  # --max-model-len where the server is silent
    unknown = build_plan(opts())  # a dry run: the server's limit is asked first
    assert unknown.max_prompt is None and len(unknown.probes) == 15
    with pytest.raises(PlanError, match="every probe length is over"):
        build_plan(opts(lengths=(5000,)), server_max_len=4096)


def test_the_plan_bounds_every_request_and_token():
    o = opts(lengths=(500, 1000), repeats=2, lengths_from=(300, 700, 9000), caps=Caps(tokens=20_000, duration_s=30))
    plan = build_plan(o, server_max_len=4096)
    assert plan.mixed == (300, 700)  # over the limit: not replayed
    per_stream = o.background_prompt + o.background_output
    assert plan.background_max == (20_000 - plan.probe_tokens - plan.mixed_tokens) // per_stream
    assert plan.metrics_polls == 31
    assert plan.max_requests == CHECK_REQUESTS + 31 + 4 + 2 + plan.background_max
    text = render(plan)
    assert f"at most {plan.max_requests} requests" in text and "20000 prompt+output tokens" in text


@pytest.mark.parametrize("kw, says", [
    ({"concurrency": 7}, "a probe and a /metrics read need 9 requests in flight; --max-concurrency is 8"),
    ({"concurrency": 8, "metrics": False}, "a probe need 9 requests in flight; --max-concurrency is 8"),
    ({"caps": Caps(tokens=5000)}, "--max-tokens-total 5000"),
    ({"itl_ms": 0}, "--itl-ms"),
    ({"caps": Caps(rate=float("nan"))}, "--max-rate"),
    ({"lengths": ()}, "--lengths"),
    ({"probe_gap_s": -1}, "--probe-gap-s"),
])
def test_a_plan_that_cannot_be_is_one_line_naming_the_option(kw, says):
    with pytest.raises(PlanError, match=re.escape(says)):
        build_plan(opts(**kw), server_max_len=4096)


def test_lengths_from_a_text_file_or_a_runs_records(tmp_path):
    text = tmp_path / "l.txt"
    text.write_text("# my mix\n100\n\n2000  # long\n300\n")
    assert sorted(read_lengths(str(text))) == [100, 300, 2000]
    assert read_lengths(str(text), seed=1) == read_lengths(str(text), seed=1)
    recs = tmp_path / "requests.jsonl"
    recs.write_text("\n".join(json.dumps({"id": i, "prompt_len": n}) for i, n in enumerate((5, 6))) + "\n")
    assert sorted(read_lengths(str(recs))) == [5, 6]
    for body, says in (("abc\n", "not a prompt length"), ("0\n", ">= 1"), ('{"x": 1}\n', "without `prompt_len`"),
                       ("", "no prompt lengths")):
        bad = tmp_path / "bad.txt"
        bad.write_text(body)
        with pytest.raises(PlanError, match=says):
            read_lengths(str(bad))
    with pytest.raises(PlanError, match="no such file"):
        read_lengths(str(tmp_path / "missing"))


def test_prompts_are_seeded_fresh_and_in_range():
    a, b, c = prompt(1000, (7, 1), False), prompt(1000, (7, 2), False), prompt(1000, (8, 1), False)
    assert len(a) == 1000 and a == prompt(1000, (7, 1), False) and a[:16] != b[:16] and a[:16] != c[:16]
    assert all(ID_RANGE[0] <= t < ID_RANGE[1] for t in a)
    assert len(prompt(50, (7, 1), True).split()) == 50


def test_no_two_diagnoses_send_the_same_probe_prompt():
    """A prefix cache that kept an earlier diagnosis' probes must not skip this one's prefills."""
    plan = build_plan(opts(lengths=(500, 1000), repeats=2), 4096)
    target = Target("http://h/v1", "m", "token_ids", "token_ids", 4096, None)
    first, second = Runner(plan, target, None), Runner(plan, target, None)
    prompts = [[s.body["prompt"][:32] for s in r._probes] for r in (first, second)]
    assert len({tuple(p) for p in prompts[0] + prompts[1]}) == 8


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_gate_spaces_sends_caps_concurrency_and_refuses_past_the_tokens():
    async def main():
        plan = build_plan(opts(lengths=(100,), repeats=1, background_output=100, background_prompt=10,
                               concurrency=1, metrics=False, caps=Caps(concurrency=2, rate=10.0, tokens=500,
                                                                        duration_s=60)), 4096)
        gate = Budget(plan)  # the token cap leaves (500 - 101) // 110 = 3 background requests
        t = [await gate.take("background", 110), await gate.take("background", 110)]
        assert t[1] - t[0] >= 0.1 and gate.in_flight == 2  # 10 sends/s at most
        third = asyncio.ensure_future(gate.take("background", 110))
        await asyncio.sleep(0.3)
        assert not third.done()  # the concurrency cap: it waits for a slot
        await gate.release()
        await third
        assert gate.max_in_flight == 2 and gate.tokens == 330
        await gate.release()
        await gate.release()
        with pytest.raises(Exhausted, match="3 background requests were sent"):
            await gate.take("background", 110)
        await gate.take("probe", 101)
        with pytest.raises(Exhausted, match="token cap"):
            await gate.take("probe", 100)
        gate.stop("interrupted")
        with pytest.raises(Exhausted, match="interrupted"):
            await gate.take("probe", 1)
        assert gate.requests == 4 and gate.tokens == 431 and gate.in_flight == 1

    asyncio.run(main())


def test_the_gate_refuses_everything_after_the_duration_cap():
    async def main():
        clock = Clock()
        plan = build_plan(opts(lengths=(100,), repeats=1, caps=Caps(duration_s=10.0)), 4096)
        gate = Budget(plan, clock)
        await gate.take("probe", 101)
        clock.t = 10.0
        with pytest.raises(Exhausted, match="duration cap"):
            await gate.take("probe", 101)
        assert gate.stopped and gate.requests == 1

    asyncio.run(main())
