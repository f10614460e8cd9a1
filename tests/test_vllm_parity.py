"""Parity with vLLM: on the same saved cpu-demo model and the same token-id prompts, vLLM's greedy outputs
(through pdlab's external backend: server start, streaming client, stop) equal pdlab's engine's, token for
token, unified and P/D. Needs vLLM's environment (scripts/vllm-env.sh --nixl); skipped, saying so, without
it. Each vLLM server takes a core and a minute or more to become healthy."""

import os
import subprocess

import pytest

from engine_helpers import engine, prompts, run
from pdlab.recipe import parse_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("PDLAB_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
LENGTHS = [40, 200, 333, 517, 640, 1000, 129, 256]
NEW_TOKENS = 32

pytestmark = [pytest.mark.slow,  # vLLM servers: minutes
              pytest.mark.skipif(not os.path.isfile(VLLM_PYTHON),
                                 reason=f"vLLM's environment is absent ({VLLM_PYTHON}); create it with "
                                        "scripts/vllm-env.sh --nixl")]


UNIFIED = {"unified": {"devices": ["cpu:0"]}}
PD = {"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}, "mode": "pull"}


def has_nixl() -> bool:
    """Whether vLLM's environment can import NIXL (vllm-env.sh without --nixl leaves it out)."""
    return os.path.isfile(VLLM_PYTHON) and subprocess.run([VLLM_PYTHON, "-c", "import nixl"],
                                                          capture_output=True).returncode == 0


def vllm_outputs(reqs: list[list[int]], tmp_path, deployment: dict) -> dict[str, list[int]]:
    from pdlab.external.cluster import ExternalCluster
    from pdlab.serve.router import RequestDone

    recipe = parse_recipe({"model": {"preset": "cpu-demo"}, "rates": [1],
                           "engine": {"backend": "vllm", "python": VLLM_PYTHON, "prefix_caching": False},
                           "deployment": deployment})
    v = recipe.resolved("default")
    os.environ["PDLAB_MODEL_CACHE"] = str(tmp_path / "models")
    outs: dict[str, list[int]] = {}
    with ExternalCluster(v, v.deployment, label="parity", log_dir=str(tmp_path)) as c:
        c.start()
        for i, p in enumerate(reqs):
            c.submit(str(i), p, {"max_tokens": NEW_TOKENS, "ignore_eos": True})
        while len(outs) < len(reqs):
            for e in c.poll(5.0):
                if isinstance(e, RequestDone):
                    assert e.ok, e.error
                    outs[e.req_id] = e.output_ids
    return outs


@pytest.mark.parametrize("deployment", [UNIFIED, PD], ids=["unified", "pd-nixl"])
def test_greedy_outputs_equal_pdlab_engine(tmp_path, deployment):
    """P/D: the decode server's output, after pulling the prefill server's KV over NIXL."""
    if deployment is PD and not has_nixl():
        pytest.skip(f"vLLM's environment ({VLLM_PYTHON}) has no NIXL; create it with scripts/vllm-env.sh --nixl")
    reqs = prompts(LENGTHS, vocab=4096, seed=8)
    ours, _ = run(engine("cpu-demo", block_size=16, prefix_caching=False), reqs, max_tokens=NEW_TOKENS)
    theirs = vllm_outputs(reqs, tmp_path, deployment)
    same = [k for k in ours if ours[k] == theirs[k]]
    assert len(same) == len(reqs), {k: (ours[k][:8], theirs[k][:8]) for k in ours if k not in same}
