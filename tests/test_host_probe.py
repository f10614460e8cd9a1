"""pdlab.timing.host_probe: the host probe's phases, on a real 1P1D deployment of a tiny model."""

import pytest

from pdlab.timing.host_probe import BURST, BURSTS, CHAINED, CO_REQUESTS, PHASES, REQUESTS, probe_host


@pytest.mark.slow
def test_the_probes_steps_alone_straddle_its_steps_together():
    """Contention is the steps together over the steps alone: a box whose pace moves over the probe must move
    both alike, so the requests served alone (one at a time, chained) come before and after the ones served
    together (bursts, staggered), every request of each kind served once."""
    res = probe_host("tiny-llama", "float32", [0, 1])
    recs = res["request_records"]
    assert len(recs) == res["requests"] == REQUESTS + CHAINED + BURSTS * BURST + CO_REQUESTS
    assert {k: sum(n for kind, n in PHASES if kind == k) for k in ("one", "chained", "burst", "staggered")} == {
        "one": REQUESTS, "chained": CHAINED, "burst": BURSTS, "staggered": CO_REQUESTS}
    alone = {kind: sorted(r["arrival"] for r in recs if r["id"][0] == first) for kind, first in
             (("one", "h"), ("chained", "p"))}
    together = sorted(r["arrival"] for r in recs if r["id"][0] in "bc")
    assert len(together) == BURSTS * BURST + CO_REQUESTS
    for kind, times in alone.items():
        assert times[0] < together[0] and times[-1] > together[-1], kind
    assert res["send_ms"] is not None  # the bursts' send time, each burst read
