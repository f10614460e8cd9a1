"""A profile from a measurement (pdlab.timing.process's result): the split, the fit, its held-out errors and
whether they are good enough, the transports, the host time and the kernels, as the profile's plain form
and the lines `pdlab profile` prints."""

from __future__ import annotations

import datetime
from typing import Optional

import numpy as np

from pdlab.constants import PROFILE_CHECK_MAPE_PCT, PROFILE_MAX_P90_PCT, PROFILE_MIN_R2, PROFILE_PACE_MOVED
from pdlab.engine.timed import StepCounts
from pdlab.timing import fit as F
from pdlab.timing.contention import SPREADS, after_prefill_fit, contention_raw, describe, estimate
from pdlab.timing.host import host_raw
from pdlab.timing.pace import READ_MIB
from pdlab.timing.write import profile_raw

BUSY_SHARE = 0.9  # a measuring process with less of its core than this: the box was busy


def samples_of(res: dict) -> list[F.StepSample]:
    return [F.StepSample(StepCounts(**c), float(ms), int(case), cpu) for c, ms, case, cpu in res["steps"]]


def cpu_share(ss: list[F.StepSample]) -> Optional[float]:
    """The measuring process's CPU time over the steps' wall time (None: not measured, as on CUDA). Pinned to
    one core with one thread it is about 1 when the core was its own."""
    cpu = [s for s in ss if s.cpu_ms is not None]
    wall = sum(s.ms for s in cpu)
    return sum(s.cpu_ms for s in cpu) / wall if cpu and wall > 0 else None


def fit_warnings(held: dict, kinds: dict[str, dict], steps: int) -> list[str]:
    """Held-out R^2 below PROFILE_MIN_R2 or p90 error above PROFILE_MAX_P90_PCT, overall or for a kind of step,
    each with what to do about it."""
    bad = []
    for label, e in [("all steps", held)] + [(f"{k} steps", kinds[k]) for k in F.KINDS]:
        if not e.get("steps"):
            continue
        why = []
        if e.get("r2") is not None and e["r2"] < PROFILE_MIN_R2:
            why.append(f"R^2 {e['r2']:.2f} < {PROFILE_MIN_R2}")
        if e["p90_pct"] > PROFILE_MAX_P90_PCT:
            why.append(f"p90 error {e['p90_pct']:.0f}% > {PROFILE_MAX_P90_PCT:.0f}%")
        if why:
            bad.append(f"{label}: {', '.join(why)}")
    if not bad:
        return []
    return [f"the step model does not fit the held-out steps well ({'; '.join(bad)}): simulated and timed runs "
            "from this profile will be off by as much. On a CPU the usual cause is other processes on the "
            "measured core (see `uptime`): measure again on a quiet machine, or pin the measurement to an idle "
            f"core (--cores N); with more steps (--steps {2 * steps}) the fit has more to go on. "
            "Check it against a real run with pdlab profile --check RUN_DIR --profile FILE."]


def build_profile(res: dict, *, model: str, device: str, dtype: str, steps: int, seed: int, test_fraction: float,
                  host: Optional[dict], name: str) -> tuple[dict, list[str]]:
    """(the profile's plain form, the lines to print) from the measuring process's result `res`."""
    ss = samples_of(res)
    case_kinds = dict(enumerate(res["case_kinds"]))
    train, test = F.split_by_case(ss, case_kinds, test_fraction, np.random.default_rng(seed + 1))
    coef = F.fit_steps(train)
    held, train_err, kinds = F.errors(coef, test), F.errors(coef, train), F.by_kind(coef, test)
    warnings = fit_warnings(held, kinds, steps)
    warnings += pace_warnings(res.get("pace_ms"), res.get("memory_pace_ms"))
    share = cpu_share(ss)
    if share is not None and share < BUSY_SHARE:
        warnings.insert(0, f"the measuring process ran {share:.0%} of its steps' time (its CPU time over their wall "
                           "time): other processes shared its core, and the step times include their interference; "
                           "measure on a quiet machine or pin to an idle core (--cores N)")
    transfers = res["transfers"]
    usable = {k: t for k, t in transfers.items() if t["gbps"] is not None}
    cuda = device.startswith("cuda")
    fit = {
        "method": "non-negative least squares on relative residuals (each step weighted by 1 / its time)",
        "split": f"by case: {test_fraction:.0%} of the designed cases of each kind held out",
        "train_steps": len(train), "test_steps": len(test),
        "held_out": _drop_steps(held), "held_out_by_kind": kinds, "train": _drop_steps(train_err),
        "steps_by_kind": {k: sum(s.kind == k for s in ss) for k in F.KINDS},
        "measured_s": round(res["measured_s"], 1), "dtype": dtype, "threads": res["threads"],
        "cores": res["cores"], "process": "spawned, pinned and set up as a worker (pdlab.timing.process)",
        "malloc_tuned": res["malloc_tuned"], "cpu_share": share, "torch": res["torch"], "seed": seed,
        "warnings": warnings,
        "transfer": {k: {"bytes": t["bytes"], "ms": t["ms"], "baseline_gbps": t["baseline_gbps"], "note": t["note"]}
                     for k, t in transfers.items()},
    }
    contention = None
    probed: dict = {}
    if host is not None:
        fit["host"] = {"requests": host.get("requests"), "samples": host.get("samples"),
                       "how": "a 1P1D pull deployment of the model serving requests one at a time, prefills chained, "
                              "in bursts and staggered (pdlab.timing.host_probe)"}
        if host.get("steps"):
            est = estimate(coef, host["steps"], requests=host.get("request_records"))
            probed = contention_raw(est)
            contention = kept_contention(probed)
            # the probe's workers are a real deployment of the model: its warm steps alone should step at the
            # model's pace, as the profile's own did a minute before (x0.98-1.06 on the 2-core Xeon; BENCHMARKS.md,
            # 2026-12-03 seventh session); far off, the profile did not measure what a worker runs
            fit["host"]["worker_steps"] = {k: round(x, 4) for k, x in est["alone"].items() if x is not None}
            warnings += worker_step_warnings(fit["host"]["worker_steps"], pace_moved(res.get("pace_ms")),
                                             pace_moved(res.get("memory_pace_ms")))
            fit["contention"] = {"samples": est["samples"], "probed": probed,
                                 "how": "the host probe's steps against the fitted step model (pdlab.timing."
                                        "contention); all kept: prefill_x and decode_x (at 1 or more), cold_ms and "
                                        "the decode spreads (a run's steps replace them: pdlab profile --check RUN "
                                        "--profile FILE --write-host)"}
        # the main process's time per worker step: what the probe's workers lost while they stepped together,
        # read as host_load takes it (contention.main_step), where they record their CPU time and it had no core
        # of its own; else its own CPU time per step, less than that (0.25 against 0.38-0.42 ms on the 2-core
        # Xeon: the workers lose more than its CPU time)
        lost = probed.get("main_step_ms")
        main = lost if lost is not None and host.get("main_shared") else host.get("main_step_ms")
        if main is not None:
            contention = {**(contention or {}), "main_step_ms": round(main, 4)}
        cpu = host.get("main_step_ms")
        fit["host"]["main_cpu_ms_per_step"] = None if cpu is None else round(cpu, 4)
    fitted = after_prefill_fit(dict(enumerate(res["after_prefill"]["by_k"])), res["after_prefill"]["settled"]) \
        if res.get("after_prefill") else None
    if fitted is not None:  # pdlab.timing.after_prefill: measured in the worker-like process, beside the steps
        contention = {**(contention or {}), "after_prefill_x": round(fitted[0], 4),
                      "after_prefill_decay": round(fitted[1], 4)}
        fit["after_prefill"] = {"steps": len(res["after_prefill"]["settled"]),
                                "how": "a decode batch's steps right after a prefill on its engine over its settled "
                                       "ones (pdlab.timing.after_prefill)"}
    raw = profile_raw(name=name, source="measured", device=res["device"], date=datetime.date.today().isoformat(),
                      model=model, step=coef, kv_bytes_per_token=res["kv_bytes_per_token"],
                      kv_memory_gb=res["kv_memory_gb"], transfer=usable, fit=fit,
                      device_kind="cuda" if cuda else "cpu", host=host_raw(host) if host else None,
                      kernels=res["kernels"] or None, pace_ms=_mean(res.get("pace_ms")),
                      memory_pace_ms=_mean(res.get("memory_pace_ms")), pace_read_mib=res.get("pace_read_mib"),
                      contention=contention)
    report = [f"measured {len(ss)} steps in {res['measured_s']:.1f} s ({len(train)} to fit, {len(test)} held out)",
              format_step(coef), format_errors("held-out error", held)]
    report += [format_errors(f"  {k}", kinds[k]) for k in F.KINDS]
    report += [format_errors("training error", train_err),
               f"KV {res['kv_bytes_per_token']} bytes/token; kv_memory_gb {res['kv_memory_gb']:.3g}"]
    if res.get("pace_ms"):
        report.append("the box's pace (pdlab.timing.pace; a run's workers time it too): " +
                      " and ".join(f"{x:.3g}" for x in res["pace_ms"]) + " ms, before and after the steps" +
                      (" (its memory half " + " and ".join(f"{x:.3g}" for x in res["memory_pace_ms"]) + " ms)"
                       if res.get("memory_pace_ms") else ""))
    if res["kernels"]:
        report.append("CPU kernels: " + ", ".join(f"{k} {'kernel' if c['use'] else 'torch'}"
                                                  for k, c in res["kernels"].items()))
    for k, t in transfers.items():
        sizes = ", ".join(f"{b / 1e6:.2f} MB {ms:.3f} ms" for b, ms in zip(t["bytes"], t["ms"]))
        base = ", ".join(f"{g:.3g}" for g in t["baseline_gbps"])
        gbps = "unbounded" if t["gbps"] is None else f"{t['gbps']:.3g} GB/s"
        report.append(f"transfer {k}: {gbps}, latency {t['latency_ms']:.3g} ms (from {sizes}; a plain copy of "
                      f"the same bytes: {base} GB/s)")
    if not transfers:
        report.append("transfer: no transport measured")
    if (fit.get("host") or {}).get("worker_steps"):
        report.append("the host probe's workers, warm steps alone against the step model: " +
                      ", ".join(f"{k} x{x:.3g}" for k, x in fit["host"]["worker_steps"].items()))
    if host is not None:
        report.append("host time: " + ", ".join(f"{k} {v:.3g} ms" + (" per 1000 prompt tokens" if "ktok" in k else "")
                                                for k, v in host_raw(host).items()) +
                      f" (samples: {host['samples']})")
    if fit.get("contention"):
        report.append(f"contention (the probe's workers stepping together and after idling): "
                      f"{describe(fit['contention']['probed'])} (samples: {fit['contention']['samples']}); kept: "
                      f"{describe(contention or {})} (a run's steps can replace them: pdlab profile --check RUN "
                      "--profile FILE --write-host; a run in a slow phase of the box reads them low, and "
                      "--write-drift keeps its pace apart instead)")
    if fitted is not None and not fit.get("contention"):
        report.append(f"contention: {describe(contention or {})}")
    report += [f"warning: {w}" for w in warnings]
    return raw, report


def kept_contention(probed: dict) -> Optional[dict]:
    """What a fresh profile keeps of its host probe's contention figures (`contention_raw`): the factors beside
    stepping workers (at 1 or more), the cold step, the decode spreads and the join step (its pull hand-overs'
    join_ktok_ms, pdlab.timing.join); None where it has none of them.

    The factors were once left out (x1.24 probed with short prompts where runs of long ones stepped x1.02-1.05 on
    the Xeon, and keeping them cost 11 of 408 figures there); on the AVX2 EPYC the issue came from, the probe read
    prefill x1.11-1.16 and decode x1.04-1.05, the runs x0.67-1.15 (long prompts lowest) and x1.01-1.15, and two
    validations' forecasts met 92 and 76 of 102 figures with them against 80 and 60 without (BENCHMARKS.md,
    2026-12-07, second). A neighbour's steps do not make a step faster: a factor below 1 is the box's pace moving
    between the probe's steps alone and together (x0.95 and x0.97, read by a profile whose pace moved x1.27; kept
    as read, its forecast met 77 against 84 at 1), so 1 is kept there."""
    kept = {k: max(v, 1.0) if k in ("prefill_x", "decode_x") else v for k, v in probed.items()
            if k in ("prefill_x", "decode_x", "cold_ms", "join_ktok_ms") + SPREADS}
    return kept or None


def pace_moved(paces: Optional[list[float]]) -> Optional[float]:
    """The box's pace after the profile's steps over before them (pdlab.timing.pace; None without both)."""
    if not paces or len(paces) < 2 or min(paces) <= 0:
        return None
    return paces[-1] / paces[0]


def moved_far(x: Optional[float]) -> bool:
    return x is not None and max(x, 1 / x) - 1 > PROFILE_PACE_MOVED


def pace_warnings(paces: Optional[list[float]], memory: Optional[list[float]] = None) -> list[str]:
    """A warning where the box's pace (ms, before and after the steps), or its memory half (`memory`), moved more
    than PROFILE_PACE_MOVED while the steps were measured: the same computation took that much longer or shorter
    a minute later, and the step model carries a mix of both speeds that neither the held-out error nor the R^2
    show (the held-out steps were measured in the same minute). The memory half alone moving is said apart: the
    two drift apart on a shared box (pdlab.timing.pace), and it is the KV reads' terms (context_token_ms) that
    then carry the mix."""
    x, m = pace_moved(paces), pace_moved(memory)
    if moved_far(x):
        what = (f"the box's pace moved from {paces[0]:.3g} to {paces[-1]:.3g} ms (x{x:.2f}"
                + (f"; its memory half x{m:.2f}" if m is not None else "") + ") while the steps were measured: the "
                "box changed speed under the profile")
    elif moved_far(m):
        what = (f"the memory half of the box's pace (a {READ_MIB} MiB read) moved from {memory[0]:.3g} to "
                f"{memory[-1]:.3g} ms (x{m:.2f}" + (f"; the whole x{x:.2f}" if x is not None else "") + ") while the "
                "steps were measured: the step model's term for reading KV (context_token_ms) carries both speeds")
    else:
        return []
    return [f"{what}, and its runs will move too. Measure again when the box is quiet (see `uptime`, and other VMs' "
            "load on a shared host), and read forecasts from this profile with their band (pdlab profile --check "
            "RUN_DIR --profile FILE --write-drift)"]


def worker_step_warnings(alone: dict[str, float], moved: Optional[float] = None,
                         memory_moved: Optional[float] = None) -> list[str]:
    """A warning for each kind of step (kind -> the median of the host probe's warm steps alone over the step
    model) that a real worker stepped more than PROFILE_CHECK_MAPE_PCT off the profile's own. Where the box's
    pace, or its memory half (`memory_moved`), moved far while the steps were measured (`moved`, pace_moved),
    that is the likelier cause, and the warning says so rather than blame the worker path (2026-12-07: the pace
    x0.74, the probe's steps x0.75-0.84)."""
    if moved_far(moved) or moved_far(memory_moved):
        which = (f"the box's pace moved x{moved:.2f}" if moved_far(moved)
                 else f"the memory half of the box's pace moved x{memory_moved:.2f}")
        why = f"; {which} while the profile's steps were measured, the likelier cause: measure again on a quiet box"
    else:
        why = (": the profile's steps were not a worker's. Compare the kernels a run's workers report (env.json) "
               "with the profile's, and measure again on a quiet box")
    return [f"the host probe's workers (a real deployment of the model, right after the steps) ran their {kind} "
            f"steps at x{x:.2f} the step model{why}"
            for kind, x in alone.items() if abs(x - 1) * 100 > PROFILE_CHECK_MAPE_PCT]


def _mean(xs: Optional[list]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _drop_steps(e: dict) -> dict:
    return {k: v for k, v in e.items() if k != "steps"}


def format_step(c: dict) -> str:
    return (f"step ms = {c['fixed_ms']:.4g} + {c['prefill_token_ms']:.4g} x prefill tokens + "
            f"{c['prefill_attention_ms']:.4g} x pairs/1000 + {c['decode_seq_ms']:.4g} x decode seqs + "
            f"{c['context_token_ms']:.4g} x context tokens + {c['chunk_ms']:.4g} x chunks + "
            f"{c['fresh_pair_ms']:.4g} x fresh pairs/1000 + {c['resumed_pair_ms']:.4g} x resumed pairs/1000 + "
            f"{c['resumed_context_ms']:.4g} x resumed context + {c['knee_token_ms']:.4g} x min(tokens, "
            f"{c['knee_tokens']})")


def format_errors(label: str, e: dict) -> str:
    if not e.get("steps"):
        return f"{label}: no steps"
    r2 = f", R^2 {e['r2']:.4f}" if e.get("r2") is not None else ""
    return (f"{label} ({e['steps']} steps): MAPE {e['mape_pct']:.1f}%, p90 {e['p90_pct']:.1f}%, "
            f"max {e['max_pct']:.1f}%{r2}")
