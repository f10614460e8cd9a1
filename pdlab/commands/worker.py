"""`pdlab worker --join tcp://HOST:PORT --devices cpu:2-3`: this machine as a node of a run (pdlab.serve.agent)."""

from __future__ import annotations

import socket
import sys
from typing import Optional

from pdlab.devices import Device, check_node_name, format_devices, parse_devices
from pdlab.serve.agent import Agent
from pdlab.serve.curve import ClusterKeys, KeysError
from pdlab.serve.launch import stop_helpers


def _err(msg: str) -> int:
    print(f"pdlab worker: error: {msg}", file=sys.stderr)
    return 2


def main(join: str, devices: list[str], name: Optional[str], keys: Optional[str], insecure: bool,
         once: bool) -> int:
    # deferred: numpy
    from pdlab.recipe.nodes import ControlSpec
    from pdlab.recipe import RecipeError
    from pdlab.serve.topology import cpu_cores, gpu_ids

    # Everything that can be wrong is found here, before anything connects.
    try:
        if not ControlSpec.from_raw(join, "--join").tcp:
            return _err(f"--join {join}: expected tcp://HOST:PORT (the recipe's control address)")
    except RecipeError:
        return _err(f"--join {join}: expected tcp://HOST:PORT (the recipe's control address)")
    try:
        offered = parse_devices(devices)
    except ValueError as e:
        return _err(f"--devices: {e}")
    kind = offered[0].kind
    have = cpu_cores() if kind == "cpu" else list(range(len(gpu_ids())))
    missing = [d for d in offered if d.index not in have]
    if missing:
        return _err(f"--devices: {format_devices(missing)} does not exist here (this process may use "
                    f"{format_devices([Device(kind, i) for i in have]) or 'none'})")
    name = name or socket.gethostname().split(".")[0]
    try:
        check_node_name(name)
    except ValueError as e:
        return _err(f"--name: {e}" + ("" if name != socket.gethostname().split(".")[0] else
                                      " (this machine's name; give --name)"))
    if (keys is None) == (not insecure):
        return _err("give --keys DIR (the cluster's keys, from `pdlab keys init DIR`) or --insecure (plain TCP, "
                    "for a recipe with control: {insecure: true})")
    member = None
    if keys is not None:
        try:
            member = ClusterKeys.load(keys, server=False)
        except KeysError as e:
            return _err(f"--keys: {e}")
    else:
        print("pdlab worker: warning: --insecure: plain TCP; anyone who can reach the router can read what its "
              "workers are sent", file=sys.stderr)
    try:
        return Agent(join, [format_devices(offered)], name, member, once,
                     say=lambda s: print(s, flush=True)).run()
    finally:
        stop_helpers()
