"""Recipes that place workers on other nodes: `nodes: {b: {devices: [...]}}`, devices written `b:cpu:2`, and the
control plane they need. Everything wrong is one line naming the key, before anything starts."""

import os

import pytest

from pdlab.devices import split_node
from pdlab.recipe import Deployment, RecipeError
from pdlab.recipe.nixl import nixl_module
from pdlab.serve.curve import init_keys
from pdlab.serve.topology import ClusterError, place

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTROL = {"address": "tcp://127.0.0.1:5555", "keys": "/k"}
NIXL = pytest.mark.skipif(nixl_module() is None, reason="NIXL not installed")


def dep(**raw):
    return Deployment.from_raw(raw, "deployment")


def test_a_device_names_its_node_before_its_kind():
    assert split_node("b:cpu:2-3") == ("b", "cpu:2-3") and split_node("node-2:cuda:0,1") == ("node-2", "cuda:0,1")
    assert split_node("cpu:0") == (None, "cpu:0") and split_node("gpu:0") == (None, "gpu:0")  # a bad spec stays one


@NIXL
def test_workers_on_another_node_use_nixl_and_come_back_from_recipe_yaml():
    d = dep(prefill={"devices": ["cpu:0"]}, decode={"devices": ["b:cpu:2-3"], "replicas": 2}, control=CONTROL,
            nodes={"b": {"devices": ["cpu:2-3"]}})
    assert [(w.name, w.devices, w.node, w.where) for w in d.workers] == [
        ("prefill0", ("cpu:0",), None, ("cpu:0",)), ("decode0", ("cpu:2",), "b", ("b:cpu:2",)),
        ("decode1", ("cpu:3",), "b", ("b:cpu:3",))]
    assert d.transport == "nixl" and d.remote_nodes == ["b"]  # the default between nodes
    raw = d.to_raw()
    assert raw["decode"]["devices"] == ["b:cpu:2", "b:cpu:3"] and raw["nodes"] == {"b": {"devices": ["cpu:2-3"]}}
    assert Deployment.from_raw(raw, "again") == d


def test_the_old_control_address_stays_a_plain_string():
    d = dep(prefill={"devices": ["cpu:0"]}, decode={"devices": ["cpu:1"]}, control="tcp://127.0.0.1:5555")
    assert d.control.address == "tcp://127.0.0.1:5555" and d.control.curve and d.control.keys is None
    assert d.to_raw()["control"] == "tcp://127.0.0.1:5555" and "nodes" not in d.to_raw()


def test_the_same_core_on_two_machines_is_two_devices(tmp_path):
    init_keys(str(tmp_path / "keys"))
    d = dep(unified={"devices": ["cpu:0", "b:cpu:0"], "replicas": 2},
            control={"address": "tcp://127.0.0.1:0", "keys": str(tmp_path / "keys")})
    assert [w.where for w in d.workers] == [("cpu:0",), ("b:cpu:0",)]
    assert [p.worker.name for p in place(d)] == ["unified0", "unified1"]  # node b's is placed there, not here


def test_the_machine_check_loads_the_routers_keys_and_tries_its_port(tmp_path):
    with pytest.raises(ClusterError, match="deployment.control.keys: keys directory /k: No such file"):
        place(dep(unified={"devices": ["cpu:0"]}, control=CONTROL))
    with pytest.raises(ClusterError, match="cannot listen on tcp://192.0.2.1:5555 here"):  # not this machine's
        place(dep(unified={"devices": ["cpu:0"]}, control="tcp://192.0.2.1:5555"))


@pytest.mark.parametrize("raw, needle", [
    (dict(prefill={"devices": ["cpu:0"]}, decode={"devices": ["b:cpu:1"]}, transport="shm", control=CONTROL),
     "deployment.transport: shm moves KV within one machine; these workers run on this machine and b: use "
     "transport: nixl"),
    (dict(prefill={"devices": ["cpu:0"]}, decode={"devices": ["b:cpu:1"]}),
     "deployment.control: workers on node b reach the router over TCP"),
    (dict(unified={"devices": ["b:cpu:1"]}, control="tcp://127.0.0.1:5555"),
     "deployment.control.keys: missing; a worker on node b must prove it belongs to the cluster: run `pdlab keys "
     "init DIR`"),
    (dict(unified={"devices": ["bb:cpu:1"]}, control=CONTROL, nodes={"b": {"devices": ["cpu:1"]}}),
     "deployment.unified.devices: node 'bb' is not in nodes (did you mean 'b'?)"),
    (dict(unified={"devices": ["b:cpu:4"]}, control=CONTROL, nodes={"b": {"devices": ["cpu:0-3"]}}),
     "deployment.unified.devices: unified0 is placed on b:cpu:4, which nodes.b.devices (cpu:0-3) does not offer"),
    (dict(unified={"devices": ["cpu:0", "b:cpu:0"], "tp": 2}, control=CONTROL),
     "deployment.unified.devices: a worker would span machines (cpu:0, b:cpu:0)"),
    (dict(unified={"devices": ["cpu:0"]}, control={"address": "ipc:///tmp/x", "keys": "/k"}),
     "deployment.control.keys: only for a tcp:// address"),
    (dict(unified={"devices": ["cpu:0"]}, control={"address": "tcp://h:1", "keys": "/k", "insecure": True}),
     "deployment.control.insecure: give keys or insecure: true, not both"),
    (dict(unified={"devices": ["cpu:0"]}, control="tcp://host"),
     "deployment.control.address: expected a tcp://HOST:PORT or ipc://PATH address"),
    (dict(unified={"devices": ["cpu:0"]}, control={"adress": "tcp://h:1"}),
     "deployment.control.adress: unknown key (did you mean 'address'?)"),
    (dict(unified={"devices": ["cpu:0"]}, nodes={"cuda": {"devices": ["cpu:0"]}}),
     "deployment.nodes.cuda: bad node name 'cuda'"),
    (dict(unified={"devices": ["cpu:0"]}, nodes={"b": {"devices": ["b:cpu:0"]}}),
     "deployment.nodes.b.devices: expected a list of this node's device specs"),
])
def test_what_cannot_run_across_nodes_is_one_line_naming_the_key(raw, needle):
    with pytest.raises(RecipeError) as e:
        dep(**raw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_insecure_plain_tcp_is_said_explicitly():
    d = dep(unified={"devices": ["b:cpu:0"]}, control={"address": "tcp://10.0.0.1:5555", "insecure": True})
    assert not d.control.curve and d.to_raw()["control"]["insecure"] is True


def test_the_calibration_runs_where_the_first_worker_runs():
    """One request alone is measured on the first worker's machine: a first worker on node b calibrates on b
    (with the variant's control plane and nodes), not on this machine's core of the same number."""
    import yaml

    from pdlab.harness import calibration_deployment, worker_cores
    from pdlab.recipe import parse_recipe

    raw = yaml.safe_load(open(os.path.join(ROOT, "recipes", "two-nodes.yaml")))
    raw["variants"]["remote-first"] = {"deployment": {"unified": {"devices": ["b:cpu:1"]}}}
    r = parse_recipe(raw)
    dep, where = calibration_deployment(r.resolved("remote-first"))
    (w,) = dep.workers
    assert (w.node, w.devices, where) == ("b", ("cpu:1",), "b:cpu:1")
    assert dep.to_raw()["control"] == r.resolved("remote-first").deployment.to_raw()["control"]
    dep, where = calibration_deployment(r.resolved("unified"))
    assert dep.workers[0].node is None and where == "cpu:0"
    assert worker_cores(r) == {0}  # node b's cores are b's, not this machine's
