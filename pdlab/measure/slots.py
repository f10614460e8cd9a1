"""A decode worker's slots: how close its running batch came to `engine.max_running`, rate by rate.

Why: a disaggregated decode worker admits a hand-over (its first token is sent) whenever the KV lands, also
when every slot of its running batch is taken; the request then waits in its queue until one frees, and that
wait is its first gap, an ITL. Below the limit nothing of this shows; at it, a request's p99 ITL jumps from a
step to many steps. So the figure is a cliff: on the developers' 2-core box a short-prompt burst on a 1P1D pull
deployment (`max_running` 32) met 31 slots simulated and 32 real, and its ITL p90 read 16 ms against 32-45 ms;
the same cell simulated with the decode steps 20% slower read 20 ms, 30% slower 49 ms (BENCHMARKS.md, issue 25).
A forecast or a run near the limit says so, since the figure there moves far more than the pace does.

Read from step records (a run's or a simulation's): per decode worker and rate, the most sequences a step
decoded (`peak`) and the share of its steps after which every slot was taken with requests waiting (`full`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from pdlab.constants import SLOTS_NEAR
from pdlab.measure.metrics import as_rate
from pdlab.workload import rate_tag


def decode_slots(steps: list[dict], max_running: int) -> dict[str, dict[str, dict]]:
    """rate tag -> decode worker -> {peak, full, steps} over one variant's steps (warm-up left out): `peak` the
    most sequences a step decoded, `full` the share of its steps after which all `max_running` slots were taken
    (`running`, counted once the step's finished requests left) with requests waiting for one."""
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in steps:
        if s.get("role") == "decode" and not s.get("warmup") and s.get("running") is not None:
            by[(rate_tag(as_rate(s["rate"])), s["worker"])].append(s)
    out: dict[str, dict[str, dict]] = {}
    for (tag, worker), ss in by.items():
        full = sum(1 for s in ss if s["running"] >= max_running and (s.get("waiting") or 0) > 0)
        peak = max(s.get("decode_seqs", s["running"]) for s in ss)
        out.setdefault(tag, {})[worker] = {"peak": peak, "full": full / len(ss), "steps": len(ss)}
    return out


def slots_warning(variant: str, slots: dict[str, dict[str, dict]], max_running: int,
                  modelled: Optional[str] = None) -> Optional[str]:
    """One line where a decode worker ran every slot with requests waiting, or came within SLOTS_NEAR of it; the
    rate where it came closest (None: never near). `modelled`: what the variant's times came from (summary.json
    `modelled`: a simulation's, or a timed run's model), said beside the rate."""
    near = [(w["full"], w["peak"], tag, name) for tag, ws in slots.items() for name, w in ws.items()
            if w["peak"] >= SLOTS_NEAR * max_running]
    if not near:
        return None
    full, peak, tag, name = max(near)
    said = ("" if not modelled else " (simulated)" if modelled.startswith("simulated")
            else " (under its timing model)")
    if full > 0:
        what = (f"ran all {max_running} of its slots (engine.max_running) with requests waiting in {full:.0%} of its "
                f"steps at {tag} req/s{said}: an admitted request's first gap is then its wait for a slot")
    else:
        what = (f"decoded up to {peak} of its {max_running} slots (engine.max_running) at {tag} req/s{said}: a little "
                "more load or slower decode steps and admitted requests wait for a slot, their first gap that wait")
    return (f"{variant}: decode worker {name} {what}, so ITL there rises far faster than load or step time; "
            "more slots (engine.max_running) or another decode worker move the cliff")
