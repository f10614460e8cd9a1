"""A CPU engine process keeps its activations on the heap (glibc mallopt), unless PDLAB_MALLOC_TUNE=0."""

import os
import subprocess
import sys

import pytest

CODE = ("from pdlab.engine import Engine, EngineConfig, load_model\n"
        "from pdlab.engine import host_malloc\n"
        "Engine(load_model('tiny-llama'), EngineConfig(kv_blocks=8))\n"
        "print(host_malloc._applied)\n")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.parametrize("env,want", [({}, "True"), ({"PDLAB_MALLOC_TUNE": "0"}, "False")])
def test_a_cpu_engine_tunes_malloc_once_unless_told_not_to(env, want):
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "PDLAB_MALLOC_TUNE"}, **env})
    assert r.returncode == 0, r.stderr[-1000:]
    assert r.stdout.split()[-1] == want
