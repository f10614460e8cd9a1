"""A timing profile held against a run's own steps: `pdlab profile --check RUN_DIR`, and the last line of a
run whose recipe names a profile.

Every step record carries what the step computed (pdlab.engine.timed.StepCounts), so the profile's step
model predicts each step of the run and the error is read per kind of step (prefill-only, decode-only,
mixed): MAPE, p90, and the median ratio measured / predicted (1.3x: the run's steps are 30% slower than
the profile says). Beside it, the run's own host time (pdlab.timing.host) against the profile's.

Which profile checks a variant's steps (`profile_for`): its `model.timing` when that names a profile (timed
workers: how faithfully they kept the model), else its `model.check_timing`, else the profile another
variant of the same model is timed with (a recipe that runs a model for real beside its modelled double).
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Optional

from pdlab.constants import DTYPES, PACE_DRIFT, PROFILE_CHECK_MAPE_PCT
from pdlab.engine.model import PRESETS
from pdlab.timing.contention import SPREADS, contention_raw, estimate, tail
from pdlab.timing.fit import KINDS, StepSample, errors, predict
from pdlab.timing.host import FIGURES, host_times
from pdlab.timing.pace import OLD_READ_MIB, ratio, same_read
from pdlab.timing.records import CheckError, samples  # noqa: F401 - CheckError: its callers catch it from here


def check_steps(profile: Any, steps: list[dict]) -> dict:
    """{steps, overall, kinds: {kind: {steps, mape_pct, p90_pct, max_pct, r2, ratio, busy_ratio}}}: the profile's
    step model against `steps` (ratio: the median of measured / predicted; busy_ratio: the steps' measured
    time over their predicted time, summed: what pdlab.timing.replay scales a worker's steps by)."""
    ss = samples(steps)
    coef = profile.step.to_raw()
    out: dict = {"steps": len(ss), "overall": _errors(coef, ss), "kinds": {}}
    for k in KINDS:
        out["kinds"][k] = _errors(coef, [s for s in ss if s.kind == k])
    return out


def _errors(coef: dict, ss: list[StepSample]) -> dict:
    e = errors(coef, ss)
    if ss:
        p = predict(coef, ss)
        e["ratio"] = float(statistics.median(s.ms / max(x, 1e-9) for s, x in zip(ss, p)))
        e["busy_ratio"] = busy_ratio([s.ms for s in ss], p)
    return e


def busy_ratio(measured: Any, predicted: Any) -> float:
    """Steps' measured time over their predicted time, summed (1.3: the steps took 30% longer in all)."""
    return float(sum(measured) / max(float(sum(predicted)), 1e-9))


def profile_for(name: str, variants: dict[str, Any]) -> Optional[tuple[Any, str]]:
    """(profile, why it is this one) for variant `name` of a recipe's resolved variants; None: no profile."""
    v = variants[name]
    if v.model.timing is not None:
        return (v.model.timing, "its model.timing") if v.model.timing.source != "inline" else None
    if v.model.check_timing is not None:
        return v.model.check_timing, "its model.check_timing"
    for other, w in variants.items():
        t = w.model.timing
        if (t is not None and t.source != "inline" and w.model.source == v.model.source
                and w.model.dtype == v.model.dtype):
            return t, f"variant {other}'s model.timing"
    return None


def check_run(variants: dict[str, Any], steps: list[dict], requests: list[dict],
              profile: Optional[Any] = None, kernels: Optional[dict[str, dict]] = None,
              paces: Optional[dict[str, dict]] = None, memory_paces: Optional[dict[str, dict]] = None,
              pace_reads: Optional[dict[str, dict]] = None) -> dict:
    """variant -> {profile, by, modelled, other_model, steps, overall, kinds, host, profile_host, contention,
    profile_contention, kernels, pace, memory_pace, pace_other, cpu_share} for every
    variant with a profile to check (`profile` given: that one for every variant) and steps to check it on.
    `kernels`: variant -> worker -> the CPU kernels it ran (env.json's cpu_kernels); `kernels` in the result is
    a warning when they are not the profile's (pdlab.timing.provenance), else None. `paces`: variant -> worker
    -> the box's pace at its start (env.json's worker_pace_ms); `pace` in the result is the median of its
    workers' over the profile's (pdlab.timing.pace.ratio), None where either is missing; `memory_paces` and
    `memory_pace` the same of its memory half (env.json's worker_memory_pace_ms). Only workers that timed the
    profile's read count (`pace_reads`: variant -> worker -> MiB, env.json's worker_pace_read_mib through
    `env_pace_reads`; a worker without one timed OLD_READ_MIB; pdlab.timing.pace.same_read): both None where
    none did, and `pace_other` says which did not. `contention`: the
    run's own (pdlab.timing.contention; None for timed workers, which wait the model out). `other_model`: how the
    model the variant ran differs from the profile's (other_model), None where it does not or the workers were
    timed."""
    from pdlab.timing.provenance import worker_warning

    out = {}
    for name, v in variants.items():
        found = (profile, "given") if profile is not None else profile_for(name, variants)
        mine = [s for s in steps if s.get("variant") == name]
        if found is None or not mine:
            continue
        p, by = found
        res = check_steps(p, mine)
        if not res["steps"]:
            continue
        reqs = [r for r in requests if r.get("variant") == name]
        host = host_times(mine, reqs)
        ran, ran_memory, other = paced_workers(p.pace_read_mib, *(((x or {}).get(name) or {})
                                                                  for x in (paces, memory_paces, pace_reads)))
        paced = not v.model.modelled and bool(ran)
        out[name] = {"profile": p.name, "by": by, "modelled": v.model.modelled, **res, "host": host,
                     "other_model": None if v.model.modelled else other_model(p, v.model),
                     "cpu_share": cpu_shares(mine),
                     "profile_host": p.host.to_raw(),
                     "contention": None if v.model.modelled else run_contention(p, v, mine, reqs),
                     "profile_contention": p.contention.to_raw(),
                     "kernels": worker_warning(name, p, (kernels or {}).get(name) or {}),
                     "pace": ratio(ran, p.pace_ms) if paced else None,
                     "memory_pace": ratio(ran_memory, p.memory_pace_ms) if paced else None,
                     "pace_other": None if v.model.modelled or not (p.pace_ms and other)
                     else other_reads(p.pace_read_mib, other, len(ran) + len(other))}
    return out


def paced_workers(profile_mib: Optional[int], paces: dict, memory_paces: dict,
                  reads: dict) -> tuple[list[float], list[float], dict[str, int]]:
    """A variant's workers' paces and memory halves that timed the profile's read, and {worker: MiB} of those that
    timed another (a worker without a read kept: OLD_READ_MIB)."""
    same = [w for w in paces if same_read(profile_mib, reads.get(w))]
    other = {w: reads.get(w) or OLD_READ_MIB for w in paces if w not in same}
    return [paces[w] for w in same], [memory_paces[w] for w in same if w in memory_paces], other


def other_reads(profile_mib: Optional[int], other: dict[str, int], workers: int) -> str:
    """pace_other's line: which workers' paces are not set beside the profile's, and why."""
    mib = "/".join(str(x) for x in sorted(set(other.values())))
    who, those = (("the run's workers'", "") if len(other) == workers
                  else (f"{len(other)} of the run's {workers} workers'", "those "))
    return (f"the profile's pace read {profile_mib or OLD_READ_MIB} MiB, {who} {mib} MiB: {those}not set side by "
            "side (pdlab.timing.pace)")


def env_pace_reads(env: dict) -> dict[str, dict[str, int]]:
    """A run's env.json worker_pace_read_mib as check_run takes it (variant -> worker -> MiB). Runs of
    2026-12-07 kept one integer for every worker (the harness's own read), runs before that none."""
    reads = env.get("worker_pace_read_mib")
    if isinstance(reads, dict):
        return reads
    if isinstance(reads, int):
        return {v: {w: reads for w in ws} for v, ws in (env.get("worker_pace_ms") or {}).items()}
    return {}


def _same_model(measured: str, ran: str) -> Optional[bool]:
    """Whether two model sources name one model: equal as written, or two directories with one real path (a
    relative and an absolute path); None where it cannot be told (a path that does not resolve here, a hub id
    beside a directory): then nothing is claimed."""
    if measured == ran:
        return True
    a, b = (os.path.expanduser(x) for x in (measured, ran))
    dirs = os.path.isdir(a), os.path.isdir(b)
    if all(dirs):
        return os.path.realpath(a) == os.path.realpath(b)
    if not any(dirs) and measured in PRESETS and ran in PRESETS:
        return False  # two presets
    if any(dirs) and (measured in PRESETS or ran in PRESETS):
        return False  # a preset and a directory
    return None


def _dtype(x: Optional[str]) -> Optional[str]:
    """A dtype as compared (bf16 is bfloat16); None for none or auto (the device decides: not known here)."""
    d = DTYPES.get(str(x).lower()) if x else None
    return None if d in (None, "auto") else d


def other_model(profile: Any, model: Any) -> Optional[str]:
    """What differs between the model `profile` was measured on and the one a variant ran (`model`, a resolved
    ModelSpec): 'ran tiny-llama float32; the profile, cpu-demo float32', or None when they are the same or it
    cannot be told (the profile does not say, a path that does not resolve here). A run of another model or
    dtype measures the mismatch, not the box: its figures must not go into the profile (pdlab profile --check
    --write-host / --write-drift refuse them)."""
    ran, measured = _dtype(model.dtype), _dtype((getattr(profile, "fit", None) or {}).get("dtype"))
    same_model = not profile.model or _same_model(profile.model, model.source) is not False
    same_dtype = ran is None or measured is None or ran == measured
    if same_model and same_dtype:
        return None
    return (f"ran {model.source} {ran or model.dtype or 'at its default dtype'}; the profile, "
            f"{profile.model or 'unnamed'} {measured or 'of an unrecorded dtype'}")


def run_contention(profile: Any, v: Any, steps: list[dict], requests: Optional[list[dict]] = None) -> dict:
    """The run's own contention figures (pdlab.timing.contention) against `profile`; main_step_ms only where a
    run of the variant here leaves the main process no core of its own (else its steps lost nothing to it, and
    a 0 would say nothing of a box where it does), and there prefill_x and decode_x from the steps' own CPU
    time."""
    from pdlab.serve.topology import main_shares_cores

    coef = profile.step.to_raw()
    raw = contention_raw(estimate(coef, steps, requests=requests))
    if not main_shares_cores(v.deployment):
        raw.pop("main_step_ms", None)
        return raw
    # the steps' wall time holds what the main process took, which main_step_ms stands for: the co-running
    # factors are read from their own CPU time, so that a simulation with both counts it once
    own = contention_raw(estimate(coef, steps, own_cpu=True))
    for k in ("prefill_x", "decode_x"):
        if k in own:
            raw[k] = own[k]
        else:
            raw.pop(k, None)
    return raw


def cpu_shares(steps: list[dict]) -> dict[str, float]:
    """worker -> its steps' own CPU time over their wall time (`cpu_s`: CPU workers that compute). Below 1, the
    rest of its core went elsewhere while it stepped: to other processes (on a box with no spare core, the
    router and harness) or to its own other threads (a pull's copy)."""
    by: dict[str, list[float]] = {}
    for s in steps:
        if s.get("cpu_s") is not None and s["end"] > s["start"]:
            t = by.setdefault(s.get("worker") or "?", [0.0, 0.0])
            t[0] += s["cpu_s"]
            t[1] += s["end"] - s["start"]
    return {w: min(c / wall, 1.0) for w, (c, wall) in sorted(by.items()) if wall > 0}


def worst_mape(result: dict) -> Optional[float]:
    """The largest MAPE over the kinds of step checked (None: none)."""
    return max((e["mape_pct"] for e in result["kinds"].values() if e.get("steps")), default=None)


def lines(checks: dict) -> tuple[list[str], list[str]]:
    """(one line per variant checked, warnings: kinds of step beyond PROFILE_CHECK_MAPE_PCT, other kernels)."""
    out, warn = [], []
    for name, c in checks.items():
        if c.get("kernels"):
            warn.append(c["kernels"])
        if c.get("other_model"):
            warn.append(f"{name}: profile {c['profile']} was measured on another model or dtype than this run "
                        f"({c['other_model']}): its errors measure the mismatch, not the box")
        kinds = ", ".join(f"{k} {e['mape_pct']:.0f}% (x{e['ratio']:.2f}, {e['steps']})"
                          for k, e in c["kinds"].items() if e.get("steps"))
        h, ph = c["host"], c["profile_host"]
        host = ", ".join(f"{k[:-3]} {_ms(h.get(k))} ({_ms(ph.get(k))})" for k in FIGURES if h.get(k) is not None)
        what = "timed steps" if c["modelled"] else "steps"
        pace, memory = c.get("pace"), c.get("memory_pace")
        con = c.get("contention") or {}
        pc = c["profile_contention"]
        contention = ", ".join([f"{k} {con[k]:.3g} ({pc.get(k, 0):.3g})" for k in ("prefill_x", "decode_x", "cold_ms",
                                                                                  "after_prefill_x", "main_step_ms",
                                                                                  "join_ktok_ms")
                                if con.get(k) is not None] +
                               [f"{k} {tail(con[k])} ({tail(pc[k]) if pc.get(k) else 'none'})" for k in SPREADS
                                if con.get(k)])
        out.append(f"{name}: {what} against profile {c['profile']} ({c['by']}): MAPE {kinds} [measured/predicted, "
                   f"steps]" + (f"; host ms {host} [run (profile)]" if host else "") +
                   (f"; contention {contention} [run (profile)]" if contention else "") +
                   (f"; the box's pace x{pace:.2f} the profile's" + (f", its memory half x{memory:.2f}"
                                                                    if memory is not None else "") +
                    " (a fixed computation timed at each worker's start)" if pace is not None else "") +
                   (f"; {c['pace_other']}" if c.get("pace_other") else "") +
                   ("; own CPU " + ", ".join(f"{w} {x:.2f}" for w, x in c["cpu_share"].items()) +
                    " of their steps' time (the rest: other processes on their cores)" if c.get("cpu_share") else ""))
        for k, e in c["kinds"].items():
            if not e.get("steps") or e["mape_pct"] <= PROFILE_CHECK_MAPE_PCT:
                continue
            off = (f"MAPE {e['mape_pct']:.0f}%, beyond {PROFILE_CHECK_MAPE_PCT:.0f}% (measured/predicted "
                   f"x{e['ratio']:.2f})")
            if c["modelled"]:  # timed workers wait the model out: only a late wake-up makes them longer
                warn.append(f"{name}: its timed workers' {k} steps missed profile {c['profile']}'s times, {off}: the "
                            "box wakes them late (too loaded for the model's pace); its times are not the model's")
            else:
                warn.append(f"{name}: profile {c['profile']} predicts its {k} steps with {off}: it does not "
                            "describe these workers"
                            + _pace_said(pace, memory) + "; measure one here "
                            "with pdlab profile, just before the run")
    return out, warn


def _pace_said(pace: Optional[float], memory: Optional[float]) -> str:
    """What a warning says of the workers' pace at their start against the profile's, where it or its memory
    half moved beyond PACE_DRIFT: ' (the box's pace at their start was x1.45 the profile's, its memory half
    x1.60)', ' (the memory half of the box's pace at their start was x1.40 the profile's)', or ''."""
    def far(x: Optional[float]) -> bool:
        return x is not None and abs(x - 1) > PACE_DRIFT

    if far(pace):
        return (f" (the box's pace at their start was x{pace:.2f} the profile's"
                + (f", its memory half x{memory:.2f}" if memory is not None else "") + ")")
    if far(memory):
        return f" (the memory half of the box's pace at their start was x{memory:.2f} the profile's)"
    return ""


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2g}" if x < 10 else f"{x:.0f}"


def run_facts(variants: dict[str, Any], steps: list[dict], requests: list[dict],
              kernels: Optional[dict[str, dict]] = None,
              paces: Optional[dict[str, dict]] = None,
              memory_paces: Optional[dict[str, dict]] = None,
              pace_reads: Optional[dict[str, dict]] = None) -> tuple[dict, list[str]]:
    """What a run's summary says of its profiles: ({variants: check_run's result, lines}, warnings): the check
    of every variant whose recipe names a profile, and the profile's provenance for timed variants (measured
    on another CPU, with other kernels than this machine chooses: pdlab.timing.provenance). `pace_reads`: the
    read each worker's pace timed, as its Ready message said (pdlab.measure.kernels.KernelLog)."""
    try:
        checks = check_run(variants, steps, requests, kernels=kernels, paces=paces, memory_paces=memory_paces,
                           pace_reads=pace_reads)
    except CheckError as e:
        return {"variants": {}, "lines": [], "error": str(e)}, [f"profile check: {e}"]
    out, warn = lines(checks)
    return {"variants": checks, "lines": out}, warn + modelled_warnings(variants)


def modelled_warnings(variants: dict[str, Any]) -> list[str]:
    """pdlab.timing.provenance.machine_warnings of every modelled variant, once per profile."""
    from pdlab.timing.provenance import machine_warnings

    by: dict[str, list[str]] = {}
    for name, v in variants.items():
        if v.model.timing is not None and v.model.timing.source == "measured":
            by.setdefault(v.model.timing.name, []).append(name)
    out = []
    for names in by.values():
        v = variants[names[0]]
        out += machine_warnings(", ".join(names), v.model.timing, v.model)
    return out
