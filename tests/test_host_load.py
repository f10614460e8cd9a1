"""The main process on the workers' cores (pdlab.sim.host_load): what it takes from a simulated worker's steps on
a box where it has no core of its own. Its load is its time per step over the steps ended in the last
WINDOW_S; it takes from the workers by how often each waited for work lately (the core the scheduler finds
idle), and only while the others step too (else it runs on an idle core)."""

import math

import pytest

from pdlab.sim.host_load import MAX_SHARE, WINDOW_S, HostLoad


def test_its_load_is_its_time_per_step_over_the_steps_ended_in_the_window():
    h = HostLoad(0.5, ["a", "b"])
    h.begin()
    for i in range(40):  # 40 steps ended in 0.2 s: 200 a second, 0.5 ms each: a tenth of a core
        h.stepped(10.0 + (i + 1) * 0.005)
    assert h.demand(10.2) == pytest.approx(0.1)
    assert h.demand(10.2 + WINDOW_S + 0.01) == 0.0  # all of them older than the window
    busy = HostLoad(50.0, ["a"])
    busy.begin()
    for i in range(10):
        busy.stepped((i + 1) * 0.01)
    assert busy.demand(0.1) == MAX_SHARE  # never the whole core


def loaded() -> HostLoad:
    h = HostLoad(0.5, ["prefill", "decode"])
    h.begin()
    for i in range(40):
        h.stepped((i + 1) * 0.005)
    return h


def test_it_takes_from_the_workers_by_how_often_they_waited_for_work_lately():
    h = loaded()
    d = h.demand(0.2)
    assert h.factor("prefill", 0.2, 1.0, waited=False) == pytest.approx(1 + d * 0.5)  # none waited yet: alike
    assert h.factor("prefill", 0.2, 1.0, waited=True) == pytest.approx(1 + d * 2 / 3)  # its wait counts
    assert h.factor("prefill", 0.2, 0.5, waited=False) == pytest.approx(1 + d * 2 / 3 * 0.5)  # half the step beside
    assert h.factor("prefill", 0.2, 0.0, waited=False) == 1.0  # the decode core idles: it runs there
    for _ in range(8):  # the prefill worker waits after each prompt; the decode worker keeps stepping
        h.factor("prefill", 0.2, 1.0, waited=True)
    assert h.share("decode", 0.2, waited=False) == pytest.approx(1 / 11)
    # a second on, the waits count e^-1 as much: what counts is how often they waited lately
    assert h.share("decode", 1.2, waited=True) == pytest.approx((math.exp(-1) + 1) / (11 * math.exp(-1) + 1))
    alone = HostLoad(0.5, ["a"])
    alone.begin()
    alone.stepped(0.1)
    assert alone.factor("a", 0.1, None, waited=False) > 1.0  # one worker and no other core: it shares that one
    assert HostLoad(0.0, ["a", "b"]).factor("a", 0.2, 1.0, waited=True) == 1.0


def test_a_new_rate_starts_with_no_load_and_the_waits_alike():
    h = loaded()
    h.factor("decode", 0.2, 1.0, waited=True)
    h.begin()
    assert h.demand(5.0) == 0.0 and h.share("decode", 5.0, waited=False) == 0.5
