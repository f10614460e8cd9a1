"""Plan a deployment: search unified replica counts and xPyD ratios for a device budget with the simulator,
rank them by goodput at the recipe's SLO (and per device), and set beside each the closed-form estimate of
rate-matching planners (Dynamo, DistServe): prefill capacity from M/D/1 at the TTFT target, decode capacity
from the largest batch whose step fits the ITL target, goodput about the smaller of the two.

Everything here is modelled (the recipe's timing profile); `pdlab plan` then runs the best candidates for
real (worker processes, the same profile) and prints predicted against measured goodput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from pdlab.recipe import SLO, Deployment, Recipe, Variant
from pdlab.sim.experiment import simulate_recipe


@dataclass(frozen=True)
class Candidate:
    name: str  # "unified-4x", "3P1D-push"
    devices: int
    deployment: dict  # raw, as a recipe writes it


def candidates(budget: int, modes: tuple[str, ...] = ("push",), transport: str = "shm",
               per_worker: int = 1, policy: Optional[dict] = None) -> list[Candidate]:
    """Unified with 1..n replicas (the whole budget is the sensible one; fewer are listed too, for goodput
    per device), and every xPyD with x + y = n, where n = budget // per_worker workers: each worker is one
    modelled instance spanning `per_worker` devices (the profile's `devices`: a TP4 profile's worker is four
    GPUs). Workers share the box's cores: their times are the profile's. `policy`: what every xPyD keeps of
    the recipe's own disaggregated deployment (`disagg_policy`: first_token, on_transfer_failure, route)."""
    n = budget // per_worker
    if n < 2:
        raise ValueError(f"plan: a budget of {budget} devices holds {n} worker(s) of {per_worker} devices (the "
                         "profile's devices); at least 2 are needed (1 prefill + 1 decode)")
    cores = lambda k: [f"cpu:{i % 2}" for i in range(k)]  # noqa: E731 - timed workers barely use a core
    out = [Candidate(f"unified-{k}x", k * per_worker,
                     {"unified": {"replicas": k, "devices": cores(k)}, "share_devices": True})
           for k in sorted({n, max(1, n // 2)})]
    for p in range(1, n):
        d = n - p
        for mode in modes:
            out.append(Candidate(f"{p}P{d}D-{mode}", n * per_worker,
                                 {"prefill": {"replicas": p, "devices": cores(p)},
                                  "decode": {"replicas": d, "devices": cores(d)},
                                  "transport": transport, "mode": mode, "share_devices": True, **(policy or {})}))
    return out


def disagg_policy(d: Deployment) -> dict:
    """The keys of a disaggregated deployment that say how requests go, not where workers run: a planned xPyD
    keeps them (a selective recipe is planned selective). Empty for a unified one."""
    if not d.disaggregated:
        return {}
    return {"first_token": d.first_token, "on_transfer_failure": d.on_transfer_failure, "route": d.route.to_raw()}


def closed_form(v: Variant, slo: SLO, deployment: Deployment) -> Optional[float]:
    """Rate-matching estimate of goodput (req/s): min(prefill capacity, decode capacity).

    Prefill: D = the modelled prefill of a mean prompt; per prefill worker the highest rho with M/D/1's
    W = D + rho D / (2 (1 - rho)) <= the TTFT target, i.e. rho = 2 (T - D) / (2 T - D); capacity rho / D.
    Decode: the largest batch B whose step (fixed + B x decode_seq + B x mean context x context_token)
    stays within the ITL target; capacity B / (step time x output tokens) requests per second.
    A unified worker does both: its capacity is 1 / (1 / prefill + 1 / decode) (time sharing)."""
    t = v.model.timing.step
    wl = v.workload
    if wl.trace is not None:  # a trace: lengths vary row by row and its prefix reuse is not in this model
        return None
    prompt = wl.input_len.mean
    out_len = wl.output_len.value if wl.output_len.kind == "fixed" else None
    if not prompt or not out_len:
        return None
    d = v.model.timing.step_s(int(prompt), 0, 0, int(prompt * (prompt + 1) / 2))
    target = slo.ttft_ms / 1000.0
    if d >= target:
        prefill = 0.0
    else:
        rho = min(0.999, 2 * (target - d) / (2 * target - d))
        prefill = rho / d
    itl = slo.itl_ms / 1000.0
    ctx = prompt + out_len / 2
    best = 0.0
    for b in range(1, 1025):
        step = t.step_s(0, b, int(b * ctx))
        if step > itl:
            break
        best = b / (step * out_len)
    roles = [w.role for w in deployment.workers]
    if "unified" in roles:
        n = roles.count("unified")
        return 0.0 if not prefill or not best else n / (1 / prefill + 1 / best)
    return min(roles.count("prefill") * prefill, roles.count("decode") * best)


@dataclass
class Ranked:
    candidate: Candidate
    goodput: dict  # estimate dict over repeats, with capped/open flags
    per_device: Optional[float]
    closed_form: Optional[float]


def plan(recipe: Recipe, budget: int, workloads_for: Any, modes: tuple[str, ...] = ("push",),
         progress: Any = None) -> tuple[list[Ranked], SLO]:
    """Simulate every candidate on the recipe's first variant (its model, timing, engine, workload, SLO,
    rates and repeats; a disaggregated one's routing, `disagg_policy`); returns them ranked by goodput, best
    first, and the SLO they were judged by."""
    base = recipe.resolved(recipe.variant_names[0])
    if not base.model.modelled:
        raise ValueError(f"plan: variant {base.name} has no model.timing; planning needs a timing profile")
    cands = candidates(budget, modes, base.deployment.transport or "shm", base.model.timing.devices,
                       disagg_policy(base.deployment))
    variants = {c.name: replace(base, name=c.name, deployment=Deployment.from_raw(c.deployment, c.name))
                for c in cands}
    planned = replace(recipe, variants=variants)
    res = simulate_recipe(planned, workloads_for(planned), progress=progress)
    s = res.summary()
    out = []
    for c in cands:
        g = s["variants"][c.name]["goodput"]
        out.append(Ranked(c, g, g["mean"] / c.devices if g["mean"] is not None else None,
                          closed_form(variants[c.name], res.slo, variants[c.name].deployment)))
    out.sort(key=lambda r: (-(r.goodput["mean"] or 0), -(r.per_device or 0), r.candidate.name))
    return out, res.slo


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured

