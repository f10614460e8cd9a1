"""External engines: a variant with `engine.backend: vllm` runs on vLLM servers that pdlab starts, stamps
and stops; one with `engine.backend: endpoint` on a running server that pdlab only measures
(docs/external.md). `ExternalCluster` and `EndpointCluster` play the Cluster's part for the harness."""

from __future__ import annotations

import os
from typing import Any

from pdlab.serve.topology import ClusterError


def check_variant(v: Any) -> None:
    """What can be checked before anything starts (ClusterError): the external engine's interpreter exists;
    an endpoint answers as the recipe expects."""
    if not v.backend.external:
        return
    if v.backend.endpoint:  # reachable, the key accepted, the model served, streaming: or one line, exit 2
        from pdlab.external.probe import check_endpoint

        check_endpoint(v)
        return
    exe = v.backend.interpreter
    if not os.path.isfile(exe):
        raise ClusterError(f"variant {v.name}: engine.python {exe} does not exist; create vLLM's environment "
                           "with scripts/vllm-env.sh, or point engine.python at its python")
    if not os.access(exe, os.X_OK):
        raise ClusterError(f"variant {v.name}: engine.python {exe} is not executable")
