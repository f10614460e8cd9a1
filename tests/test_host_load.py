"""The main process on the workers' cores (pdlab.sim.host_load): what it takes from a simulated worker's steps on
a box where it has no core of its own. Its load is its time per step over the steps ended in the last
WINDOW_S; it takes only while every other worker steps too, and from each worker by its share of their idle
time (the core the scheduler last found idle)."""

import pytest

from pdlab.sim.host_load import MAX_SHARE, WINDOW_S, HostLoad


def test_its_load_is_its_time_per_step_over_the_steps_ended_in_the_window():
    h = HostLoad(0.5, ["a", "b"])
    h.begin(10.0)
    for i in range(40):  # 40 steps ended in 0.2 s: 200 a second, 0.5 ms each: a tenth of a core
        h.stepped("a" if i % 2 else "b", 10.0 + i * 0.005, 10.0 + (i + 1) * 0.005)
    assert h.demand(10.2) == pytest.approx(0.1)
    assert h.demand(10.2 + WINDOW_S + 0.01) == 0.0  # all of them older than the window
    busy = HostLoad(50.0, ["a"])
    busy.begin(0.0)
    for i in range(10):
        busy.stepped("a", i * 0.01, (i + 1) * 0.01)
    assert busy.demand(0.1) == MAX_SHARE  # never the whole core


def test_it_lands_on_the_worker_that_idles_most():
    h = HostLoad(1.0, ["prefill", "decode"])
    h.begin(0.0)
    h.stepped("prefill", 0.0, 0.25)  # busy a quarter of the second
    h.stepped("decode", 0.0, 0.85)
    assert h.share("prefill", 1.0) == pytest.approx(0.75 / (0.75 + 0.15))
    assert h.share("decode", 1.0) == pytest.approx(0.15 / 0.9)
    even = HostLoad(1.0, ["a", "b"])
    even.begin(0.0)
    even.stepped("a", 0.0, 1.0)
    even.stepped("b", 0.0, 1.0)
    assert even.share("a", 1.0) == even.share("b", 1.0) == 0.5  # none idled: alike


def test_a_step_takes_more_only_while_the_others_step_too():
    h = HostLoad(0.5, ["a", "b"])
    h.begin(0.0)
    for i in range(40):
        h.stepped("a" if i % 2 else "b", i * 0.005, (i + 1) * 0.005)
    d, q = h.demand(0.2), h.share("a", 0.2)
    assert h.factor("a", 0.2, 1.0) == pytest.approx(1 + d * q) and d * q > 0
    assert h.factor("a", 0.2, 0.5) == pytest.approx(1 + d * q * 0.5)
    assert h.factor("a", 0.2, 0.0) == 1.0  # another core idles: the main process runs there
    assert h.factor("a", 0.2, None) > 1.0  # one worker and no other core: it shares that one
    assert HostLoad(0.0, ["a", "b"]).factor("a", 0.2, 1.0) == 1.0
