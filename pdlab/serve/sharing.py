"""How the launcher splits what GPU workers share: device memory and host cores. Pure arithmetic, decided
before any worker starts.

Memory: workers placed on one GPU (`share_devices: true`) used to size their pools from the free memory
each saw at start-up. They start at the same moment, so each saw the whole GPU free and the second one ran
out of memory. Now the launcher gives each worker a share of every GPU it runs on (1 / the number of
workers placed there) and the engine sizes its pool from that share of the device's total memory
(pdlab.engine.pool_size), whatever the others are doing.

Host cores: a GPU worker still runs Python, the scheduler and the tokeniser-free host side of every step on
the CPU. Unpinned, with torch's default of one thread per core, a few workers on one node fight over every
core. Each GPU worker gets its own slice of the cores and a matching thread count; the main process
(router, recorder) keeps the first core when there are cores to spare.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def memory_shares(gpus_per_worker: Sequence[Sequence[str]]) -> list[float]:
    """Each worker's share of device memory: 1 / (workers on its most crowded GPU). Workers are given by the
    GPU entries they compute on (their own, not peers made visible for IPC); a CPU worker ([]) gets 1."""
    load = Counter(g for gpus in gpus_per_worker for g in set(gpus))
    return [1.0 / max((load[g] for g in gpus), default=1) for gpus in gpus_per_worker]


def host_cores(cores: Sequence[int], workers: int) -> list[tuple[int, ...]]:
    """Disjoint core slices for `workers` GPU workers out of `cores`; the first core is left to the main
    process when at least one core per worker remains. With fewer cores than workers, slices wrap
    around (cores are shared, as they must be), one core each."""
    if workers <= 0:
        return []
    if not cores:
        return [() for _ in range(workers)]
    pool = list(cores[1:]) if len(cores) > workers else list(cores)
    if len(pool) < workers:
        return [(pool[i % len(pool)],) for i in range(workers)]
    per, extra = divmod(len(pool), workers)
    out, at = [], 0
    for i in range(workers):
        n = per + (1 if i < extra else 0)
        out.append(tuple(pool[at:at + n]))
        at += n
    return out
