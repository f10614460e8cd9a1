"""What an agent starts for a session on its node: the run's workers placed here, or a doctor's probe peer.

The router sends specs as plain data; everything that depends on this machine is decided here, where the
machine is: which cores and GPUs exist (pdlab.serve.topology, with node=this one), what each worker may see,
the address the workers reach the router at (the one the agent joined) and the keys they prove themselves
with (the agent's, in their spawn arguments). A spec that asks for a device the agent does not offer is
refused: `--devices` is what the node lends, whatever the recipe says.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from pdlab.devices import format_devices, parse_devices
from pdlab.serve.peer_probe import PeerSpec, run_peer
from pdlab.serve.launch import start_process


def start_workers(deployment: dict, specs: list[dict], node: str, offered: list[str], join: str,
                  member: Optional[dict]) -> dict[str, Any]:
    """Start the workers of `specs` (raw WorkerSpecs of `deployment`, its recipe form) placed on `node`; returns
    their processes by name. ValueError (RecipeError, ClusterError) when one cannot run here; nothing is left
    running then."""
    # deferred: numpy
    from pdlab.recipe.deployment import Deployment
    from pdlab.serve.topology import place
    from pdlab.serve.spec import WorkerSpec
    from pdlab.serve.worker import run_worker

    placed = {p.worker.name: p for p in place(Deployment.from_raw(deployment, "deployment"), node=node)}
    have = set(parse_devices(offered))
    procs: dict[str, Any] = {}
    try:
        for raw in specs:
            spec = WorkerSpec.from_raw(raw)
            p = placed.get(spec.name)
            if p is None or p.worker.node != node:
                raise ValueError(f"{spec.name} is not placed on node {node} by the deployment it came with")
            outside = [d for d in parse_devices(list(spec.devices)) if d not in have]
            if outside:
                raise ValueError(f"{spec.name} asks for {format_devices(outside)}, which this node does not offer "
                                 f"(--devices {', '.join(offered)})")
            spec = replace(spec, endpoint=join, curve=member, visible_gpus=p.visible_gpus,
                           memory_share=p.memory_share, host_cores=p.host_cores)
            proc = start_process(run_worker, (spec.to_raw(),), f"pdlab-{spec.name}", gpus=bool(spec.visible_gpus))
            procs[spec.name] = proc
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.join()
        raise
    return procs


def start_probe(spec: dict, join: str, member: Optional[dict], prefix: str) -> dict[str, Any]:
    """Start `pdlab doctor --peer`'s probe peer (pdlab.serve.peer_probe) here; `prefix`: the session's run
    prefix, which names what the peer leaves in the temporary directory (swept at the session's end)."""

    peer = replace(PeerSpec.from_raw(spec), endpoint=join, curve=member, prefix=prefix)
    proc = start_process(run_peer, (peer.to_raw(),), f"pdlab-{peer.name}")  # DRAM: no GPU
    return {peer.name: proc}
