"""Prefill and decode workers exchange a KV fingerprint when they start, and refuse to pair, in one line
naming the difference, when their blocks could not be exchanged: before any request is sent."""

import dataclasses

import pytest

import engine_helpers as eh
from pdlab.engine.config import EngineConfig
from pdlab.kv.fingerprint import KvFingerprint, PairingError, check_pair
from pdlab.recipe import Deployment, ModelSpec
from pdlab.serve import messages as m
from pdlab.serve.cluster import Cluster, ClusterError
from pdlab.serve.router import Router, WorkerState

TINY = ModelSpec.from_raw({"preset": "tiny-llama"}, "model")


def fp(**engine) -> KvFingerprint:
    return KvFingerprint.of(TINY, eh.engine("tiny-llama", kv_blocks=8, **engine))


def test_a_worker_fingerprint_describes_its_blocks():
    f = fp(block_size=8)
    assert f.model == "preset:tiny-llama seed 0" and f.dtype == "float32" and f.block_size == 8 and f.tp == 1
    assert f.block_shape == (2, 2, 8, 2, 16)  # layers, k/v, tokens per block, kv heads, head dim
    assert KvFingerprint.from_raw(m.decode(m.encode(m.Ready("p", 1, None, 8, 8, f.to_raw()))).fingerprint) == f


@pytest.mark.parametrize("change,needle", [
    ({"model": "preset:tiny-llama seed 1"}, "model differs (prefill0: preset:tiny-llama seed 0, decode0: "
                                            "preset:tiny-llama seed 1)"),
    ({"model": "path:/models/other"}, "model differs"),
    ({"dtype": "bfloat16"}, "dtype differs (prefill0: float32, decode0: bfloat16)"),
    ({"layout": "blocks,layers,kv,block_size,kv_heads,head_dim"}, "layout differs"),
])
def test_pairing_refuses_a_mismatch_naming_it(change, needle):
    p = fp(block_size=8)
    check_pair("prefill0", p, "decode0", p)  # the same: fine
    with pytest.raises(PairingError) as e:
        check_pair("prefill0", p, "decode0", dataclasses.replace(p, **change))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_different_tp_pairs_the_heads_are_resliced():
    """A TP-2 decode worker reports the model's whole block shape, so it pairs with a TP-1 prefill worker."""
    p = fp(block_size=8)
    check_pair("prefill0", p, "decode0", dataclasses.replace(p, tp=2))


def test_a_block_size_mismatch_is_named_with_both_shapes():
    with pytest.raises(PairingError, match=r"block_size differs \(prefill0: 8, decode0: 16\)"):
        check_pair("prefill0", fp(block_size=8), "decode0", fp(block_size=16))


def test_the_launcher_refuses_to_pair_before_any_request():
    """Cluster's check after every worker reported Ready (the workers are stood in for by their states)."""
    dep = Deployment.from_raw({"prefill": {"replicas": 2, "devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]},
                               "share_devices": True}, "deployment")
    c = Cluster(TINY, EngineConfig(block_size=8, kv_blocks=8), dep)
    good, bad = fp(block_size=8), fp(block_size=16)
    states = [WorkerState(w.name, w.role, list(w.devices)) for w in dep.workers]
    for s, f in zip(states, (good, good, good)):
        s.fingerprint = f.to_raw()
    c.router = Router(None, states, mode="pull", first_token="decode", transfer_timeout_s=1,
                      heartbeat_timeout_s=1, step_timeout_s=1)
    c._check_pairs()  # all agree
    states[1].fingerprint = bad.to_raw()
    with pytest.raises(ClusterError, match="prefill1 and decode0 cannot exchange KV: block_size differs"):
        c._check_pairs()
    states[1].fingerprint = {}
    with pytest.raises(ClusterError, match="not a KV fingerprint"):
        c._check_pairs()
