"""pdlab.timing.pace: the box's pace as a worker reports it, with the read it timed."""

import math

import pytest

from pdlab.serve import messages as m
from pdlab.serve.router import Router, WorkerState
from pdlab.timing.pace import OLD_READ_MIB, READ_MIB, Pace, same_read


def test_a_pace_keeps_its_read_and_crosses_a_message_as_plain_data():
    """A worker's Ready carries its pace as plain data (never pickle), the read included, and comes back equal."""
    pace = Pace(0.5, 9.25, OLD_READ_MIB)
    assert pace.total_ms == 9.75 and Pace(1.0, 2.0).read_mib == READ_MIB
    raw = pace.to_raw()
    assert raw == {"compute_ms": 0.5, "memory_ms": 9.25, "read_mib": OLD_READ_MIB}
    ready = m.decode(m.encode(m.Ready("unified0", 1, None, 8, 16, {}, {}, raw)))
    assert Pace.from_raw(ready.pace) == pace
    assert m.decode(m.encode(m.Ready("unified0", 1, None, 8, 16))).pace is None  # a timed or GPU worker: none


@pytest.mark.parametrize("raw", [
    None, [], "fast", {"compute_ms": 1.0, "memory_ms": 2.0},  # a field missing
    {"compute_ms": 1.0, "memory_ms": 2.0, "read_mib": 128, "extra": 1},
    {"compute_ms": 0, "memory_ms": 2.0, "read_mib": 128}, {"compute_ms": 1.0, "memory_ms": -2.0, "read_mib": 128},
    {"compute_ms": 1.0, "memory_ms": math.inf, "read_mib": 128},
    {"compute_ms": 1.0, "memory_ms": math.nan, "read_mib": 128},
    {"compute_ms": "1", "memory_ms": 2.0, "read_mib": 128}, {"compute_ms": True, "memory_ms": 2.0, "read_mib": 128},
    {"compute_ms": 1.0, "memory_ms": 2.0, "read_mib": 0}, {"compute_ms": 1.0, "memory_ms": 2.0, "read_mib": 12.5},
    {"compute_ms": 1.0, "memory_ms": 2.0, "read_mib": True},
])
def test_a_malformed_pace_is_none(raw):
    """A pace is a figure shown beside a run: one that is not two finite times > 0 and a whole read > 0 is
    dropped, not a reason to refuse the worker."""
    assert Pace.from_raw(raw) is None


def test_the_router_keeps_the_pace_a_worker_reported():
    states = [WorkerState("unified0", "unified", ["cpu:0"]), WorkerState("unified1", "unified", ["cpu:1"])]
    r = Router(None, states, mode="pull", first_token="decode", transfer_timeout_s=30, heartbeat_timeout_s=30,
               step_timeout_s=30)
    r.dispatch(m.encode(m.Ready("unified0", 1, None, 8, 16, {}, {}, Pace(0.5, 9.0, 64).to_raw())))
    r.dispatch(m.encode(m.Ready("unified1", 2, None, 8, 16, {}, {}, {"compute_ms": "x"})))
    assert r.workers["unified0"].pace == Pace(0.5, 9.0, 64) and r.workers["unified0"].ready
    assert r.workers["unified1"].pace is None and r.workers["unified1"].ready


def test_reads_compare_with_the_old_read_standing_for_none():
    assert same_read(None, OLD_READ_MIB) and same_read(READ_MIB, READ_MIB) and not same_read(None, READ_MIB)
