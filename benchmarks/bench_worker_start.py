"""How long pdlab takes to start and stop a deployment's workers, spawned or forked from the fork server
(pdlab.serve.launch; $PDLAB_WORKER_START), as a fresh `pdlab run` process would: each round is a new Python
process that starts a 1P1D tiny-llama cluster (two CPU workers), stops it, starts it again and stops it.

  first    the first start in a process: spawn imports torch and transformers in every worker; the fork
           server imports them once, and its workers fork from it
  again    the second start in the same process (every later variant of a run, every test after the first)
  stop     stop(): Stop, join, reap
  cpu      CPU seconds of the round's process and its children (user + sys)

    python benchmarks/bench_worker_start.py [--rounds 3] [--json out.json]

The two ways alternate within each round. Run it on a quiet box: every figure is a wall-clock figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

ROUND = r"""
import json, time
from pdlab.engine.config import EngineConfig
from pdlab.recipe import Deployment, ModelSpec
from pdlab.serve.cluster import Cluster

def cluster():
    return Cluster(ModelSpec.from_raw({"preset": "tiny-llama"}, "model"),
                   EngineConfig.from_raw({"block_size": 8, "kv_blocks": 48}, "engine"),
                   Deployment.from_raw({"prefill": {"devices": ["cpu:0"]}, "decode": {"devices": ["cpu:1"]}},
                                       "deployment"))

if __name__ == "__main__":
    out = {}
    for key in ("first", "again"):
        c = cluster()
        t = time.monotonic(); c.start(); out[key] = time.monotonic() - t
        t = time.monotonic(); c.stop(); out["stop_" + key] = time.monotonic() - t
    print(json.dumps(out))
"""


def one(mode: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-c", ROUND], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PDLAB_WORKER_START": mode})
    if p.returncode != 0:
        raise SystemExit(f"{mode}: {p.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    got["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {"spawn": [], "fork-server": []}
    for r in range(a.rounds):
        for mode in (("spawn", "fork-server") if r % 2 == 0 else ("fork-server", "spawn")):
            runs[mode].append(one(mode))
    print(f"{'mode':<12} {'first s':>16} {'again s':>16} {'stop s':>16} {'cpu s':>16}   (median [min-max] of {a.rounds})")
    for mode, rs in runs.items():
        cells = []
        for key in ("first", "again", "stop_again", "cpu"):
            xs = [x[key] for x in rs]
            cells.append(f"{statistics.median(xs):5.2f} [{min(xs):.2f}-{max(xs):.2f}]")
        print(f"{mode:<12} " + " ".join(f"{c:>16}" for c in cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
