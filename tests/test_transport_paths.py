"""The KV path a variant actually took reaches env.json and the live view as soon as a transfer reports it."""

import io
import json

from pdlab.measure.records import RunDir
from pdlab.measure.transports import TransportPaths
from pdlab.recipe import Deployment
from pdlab.report.live import LiveView

TCP = "UCX intra-node rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo tcp/eth0) ka(tcp/lo)"


def setup(tmp_path, deployment):
    rd = RunDir(str(tmp_path))
    rd.write_env({"host": "h"})
    out = io.StringIO()
    view = LiveView(live=False, out=out)
    paths = TransportPaths(rd, view)
    paths.start("disagg", Deployment.from_raw(deployment, "deployment"))
    return paths, view, out, lambda: json.load(open(rd.file("env.json")))


def test_a_variant_records_what_it_asked_for_then_what_its_transfers_took(tmp_path):
    paths, view, out, env = setup(tmp_path, {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}})
    assert env() == {"host": "h", "transports": {"disagg": {"transport": "shm", "mode": "pull", "paths": []}}}
    assert view.workers["prefill0"].transport == "shm" == view.workers["decode0"].transport
    paths.saw({"transport": "shm", "path": "shm", "src": "prefill0", "dst": "decode0"})
    paths.saw({"transport": "shm", "path": "shm", "src": "prefill0", "dst": "decode0"})  # seen: once
    assert env()["transports"]["disagg"]["paths"] == ["shm"]
    assert out.getvalue().count("via shm") == 1 and "warning" not in out.getvalue()


def test_a_nixl_path_over_tcp_is_shown_and_warned_about(tmp_path):
    paths, view, out, env = setup(tmp_path, {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                                             "mode": "push"})
    paths.saw({"transport": "nixl", "path": TCP, "src": "prefill0", "dst": "decode0"})
    assert env()["transports"]["disagg"]["paths"] == [TCP]
    assert view.workers["decode0"].transport == TCP
    assert f"warning: disagg: NIXL moves KV over TCP ({TCP})" in out.getvalue()
    from rich.console import Console

    con = Console(file=io.StringIO(), width=300)
    con.print(view.render())
    assert "KV transport" in con.file.getvalue() and "rma_am(tcp/lo)" in con.file.getvalue()


def test_unified_variants_have_no_transport_entry(tmp_path):
    paths, view, _, env = setup(tmp_path, {"unified": {"devices": ["cpu:0"]}})
    paths.saw({"transport": "shm", "path": "shm", "src": "a", "dst": "b"})
    assert "transports" not in env()
