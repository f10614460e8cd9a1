"""summary.json: per variant, repeat and rate the metrics; per variant goodput over repeats with its interval.

Everything here is recomputed from the records (requests, steps, transfers) and a few facts of the run
(the SLO it resolved, what one request took alone, how many prefill workers each variant had, the floor of
each rate search), so a summary is by construction what anyone recomputes from the run directory.

- Per repeat: the rates it measured (a grid, or a search's saturation point and trials), goodput at the
  declared ITL statistic and the TPOT-based goodput (pdlab.measure.search.goodput_of), and saturation.
- Per variant: each rate pooled over repeats (with the per-repeat attainment and latencies as mean and
  95% interval), goodput as mean and interval of the repeats' goodputs with their brackets, saturation
  throughput likewise, latencies at goodput (each repeat's last passing rate), and the M/D/1 check.
- Warnings: delivery lag above 5% of the ITL target, an M/D/1 deviation over 25%, non-monotonic attainment,
  KV hand-overs that NIXL moved over TCP, and the box (pdlab.measure.box): one request alone far from the
  recipe's expectation, a fixed rate above saturation.
- Every interval is clamped at its physical bound (no negative latency, rate or throughput; no attainment
  above 1) and says so (`clamped: true`): a Student-t interval from few noisy repeats can reach past it.
- What ran: the recipe's name, start and end, the CPU model (`run`, from env.json) and `schema_version`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

from pdlab.kv.ucx_log import rma_over_tcp
from pdlab.measure.box import alone_finding, over_line, over_saturation
from pdlab.measure.confidence import estimate
from pdlab.measure.metrics import as_rate, summarize_rate
from pdlab.measure.search import goodput_of
from pdlab.measure.slots import decode_slots, slots_warning
from pdlab.recipe.slo import SLO
from pdlab.traces.report import trace_summary
from pdlab.workload import rate_tag

LAG_WARN = 0.05  # delivery lag p99 above this fraction of the ITL target: warn
MD1_WARN = 0.25  # measured mean TTFT this far from M/D/1 at the lowest rate: flag ...
MD1_WARN_MS = 5.0  # ... when it is also this far in absolute terms (a router hop is ~1 ms: not a finding)
MD1_MAX_RHO = 0.9  # above this load the M/D/1 prediction is too sensitive to be a check
MD1_FLAG_RHO = 0.35  # flag only at low load: a short run starts with an empty queue, so at higher load it
#                      queues less than M/D/1's steady state by construction
# latencies reported per repeat and over repeats; a request's worst gap at p90 over requests: the stall one
# request in ten sees (at low load most requests see no prefill at all, so the median hides it)
LATENCIES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"), ("worst_gap_ms", "p90"))
# 2: bounded intervals, `run`, `box`, `definitions`, `schema_version`; transfers.copy_ms (was transfers.ms)
SCHEMA_VERSION = 2
# the two transfer times a summary holds: one name, one definition each (docs/design.md 2.11)
DEFINITIONS = {
    "transfers.copy_ms": "KV copy time: each hand-over's copy from its start to its end (transfers.jsonl), whether "
                         "or not a request waited for it; in push mode most of it overlaps the prefill",
    "ttft_parts_ms.transfer": "exposed transfer: the part of the copy a request still waited for once its prefill "
                              "had ended, max(prefill_end, transfer_start) -> transfer_end; part of TTFT",
}


def bounded_estimate(values: Any, hi: Optional[float] = None) -> dict:
    """estimate() of a quantity that cannot be negative (a latency, a rate, a throughput) nor, with `hi`, above
    it (an attainment: 1): the Student-t interval is clamped there, and `clamped: true` says it was."""
    e = estimate(values).to_dict()
    if e["lo"] is not None and (e["lo"] < 0 or (hi is not None and e["hi"] > hi)):
        e.update(lo=max(0.0, e["lo"]), hi=e["hi"] if hi is None else min(hi, e["hi"]), clamped=True)
    return e


def run_info(run: Any) -> dict:
    """What ran, from a run directory (pdlab.measure.records.Run): recipe name, start and end, CPU model."""
    return {"recipe": run.recipe.get("name"), "started": run.env.get("time"), "ended": run.env.get("ended"),
            "cpu_model": run.env.get("cpu_model"), "simulated": bool(run.env.get("simulated"))}


def _key(kind: str, stat: str) -> str:
    return f"{kind[:-3]}_{stat}_ms"  # ttft_p50_ms, worst_gap_p90_ms


def _by(records: list[dict]) -> dict[tuple[str, int, float], list[dict]]:
    g: dict[tuple[str, int, float], list[dict]] = defaultdict(list)
    for r in records:
        if not r.get("warmup"):
            g[(r["variant"], int(r.get("repeat") or 0), as_rate(r["rate"]))].append(r)
    return g


def _order(rates: set[float]) -> list[float]:
    return sorted(rates, key=lambda r: (math.isinf(r), r))


def mdl1(rate: float, prefill_workers: int, alone_ttft_s: float, measured_ttft_s: Optional[float]) -> dict:
    """M/D/1 at one rate: requests spread over `prefill_workers` servers, each prefill taking `alone_ttft_s`.
    W = D + rho D / (2 (1 - rho)), rho = lambda D, lambda = rate / prefill_workers."""
    lam = rate / max(1, prefill_workers)
    rho = lam * alone_ttft_s
    out = {"rate": rate, "prefill_workers": prefill_workers, "alone_ttft_ms": 1000 * alone_ttft_s, "rho": rho,
           "predicted_ms": None, "measured_ms": None if measured_ttft_s is None else 1000 * measured_ttft_s,
           "deviation": None, "flag": False, "note": None}
    if rho >= MD1_MAX_RHO:
        out["note"] = f"load too high for the check (rho {rho:.2f} >= {MD1_MAX_RHO})"
        return out
    w = alone_ttft_s + rho * alone_ttft_s / (2 * (1 - rho))
    out["predicted_ms"] = 1000 * w
    if measured_ttft_s is not None:
        out["deviation"] = (measured_ttft_s - w) / w
        out["flag"] = (rho <= MD1_FLAG_RHO and abs(out["deviation"]) > MD1_WARN
                       and abs(measured_ttft_s - w) * 1000 > MD1_WARN_MS)
        if rho > MD1_FLAG_RHO:
            out["note"] = f"not at low load (rho {rho:.2f} > {MD1_FLAG_RHO}): shown, not flagged"
    return out


def _repeat(rates: dict[float, dict], slo: SLO, floor: Optional[float], alone_ttft_s: Optional[float],
            prefill_workers: Optional[int]) -> dict:
    points = [(r, s["attainment"]) for r, s in rates.items() if s["attainment"] is not None]
    tpot_points = [(r, s["attainment_tpot"]) for r, s in rates.items() if s["attainment_tpot"] is not None]
    sat = rates.get(math.inf)
    cap = sat["request_throughput"] if sat else None  # no sustained rate above what saturation completes
    g = goodput_of(points, slo.attainment, floor, cap)
    finite = [r for r in rates if not math.isinf(r)]
    out = {"rates": {rate_tag(r): s for r, s in rates.items()}, "goodput": g.to_dict(),
           "goodput_tpot": goodput_of(tpot_points, slo.attainment, floor, cap).to_dict(),
           "saturation": None if sat is None else {k: sat[k] for k in ("output_tok_s", "total_tok_s",
                                                                        "request_throughput", "duration_s")},
           "at_goodput": None, "mdl1": None}
    at = g.last_pass if g.last_pass is not None else None
    if at is not None:
        out["at_goodput"] = {"rate": at, **{_key(k, s): rates[at][k][s] for k, s in LATENCIES}}
    if finite and alone_ttft_s and prefill_workers:
        low = min(finite)
        out["mdl1"] = mdl1(low, prefill_workers, alone_ttft_s, rates[low]["ttft_ms"]["mean"] and
                           rates[low]["ttft_ms"]["mean"] / 1000.0)
    return out


def _goodput_estimate(gs: list[dict]) -> dict:
    e = bounded_estimate(g["goodput"] for g in gs)
    e.update(closed=all(g["closed"] for g in gs), open_above=any(g["open_above"] for g in gs),
             open_below=any(g["open_below"] for g in gs), monotonic=all(g["monotonic"] for g in gs),
             capped=any(g["capped"] for g in gs),
             brackets=[[g["last_pass"], g["first_fail"]] for g in gs])
    return e


def summarize_run(requests: list[dict], steps: list[dict], transfers: list[dict], slo: SLO,
                  grid: Optional[dict[str, Any]] = None, partial: bool = False, reason: Optional[str] = None,
                  alone: Optional[dict] = None, alone_by_variant: Optional[dict[str, dict]] = None,
                  relative: Optional[dict] = None,
                  prefill_workers: Optional[dict[str, int]] = None,
                  floors: Optional[dict[tuple[str, int], float]] = None, warnings: Optional[list[str]] = None,
                  modelled: Optional[dict[str, str]] = None, expect: Any = None,
                  run: Optional[dict] = None, trace: Optional[dict[str, dict]] = None,
                  kernels: Optional[dict[str, dict]] = None,
                  rates_resolved: Optional[dict[str, float]] = None, profile_check: Optional[dict] = None,
                  forecast_band: Optional[dict] = None, max_running: Optional[dict[str, int]] = None) -> dict:
    """The summary of a run. `grid`: variant -> planned rates or "auto" (variants in run order; one that has no
    records is listed with `ran: false`); default: the variants found in the records. `alone`: the
    calibration ({ttft_ms, itl_ms, ...}); `relative`: the SLO multipliers it resolved; `floors`: (variant,
    repeat) -> the lowest rate its search would try (so an all-failing search reads as closed);
    `alone_by_variant`: one request alone on each variant's own deployment, the D of its M/D/1 check
    (default: the calibration's); `modelled`: variant -> which timing model its times come from (its
    times are then not the hardware's); `expect`: the recipe's expectation of this box (pdlab.recipe.Expect:
    alone_ttft_ms, tolerance); `run`: what ran (`run_info`); `forecast_band`: a simulation's band (pdlab.sim.band);
    `max_running`: variant -> its engine.max_running, for its decode workers' slots (pdlab.measure.slots)."""
    rq, st, tr = _by(requests), _by(steps), _by(transfers)
    names = list(grid) if grid is not None else list(dict.fromkeys(v for v, _, _ in rq))
    alone_s = alone["ttft_ms"] / 1000.0 if alone and alone.get("ttft_ms") else None
    warn = list(warnings or [])
    variants: dict[str, Any] = {}
    for v in names:
        keys = [k for k in rq if k[0] == v]
        repeats = sorted({k[1] for k in keys})
        reps = []
        for i in repeats:
            rates = {r: summarize_rate(rq[(v, i, r)], st.get((v, i, r), []), tr.get((v, i, r), []), slo, r)
                     for r in _order({k[2] for k in keys if k[1] == i})}
            own = (alone_by_variant or {}).get(v)
            reps.append({"repeat": i, **_repeat(rates, slo, (floors or {}).get((v, i)),
                                                own["ttft_ms"] / 1000.0 if own else alone_s,
                                                (prefill_workers or {}).get(v))})
        pooled, lags = {}, []
        for r in _order({k[2] for k in keys}):
            reqs = [x for i in repeats for x in rq.get((v, i, r), [])]
            s = summarize_rate(reqs, [x for i in repeats for x in st.get((v, i, r), [])],
                               [x for i in repeats for x in tr.get((v, i, r), [])], slo, r)
            per = [p["rates"][rate_tag(r)] for p in reps if rate_tag(r) in p["rates"]]
            s["repeats"] = len(per)
            s["over_repeats"] = {"attainment": bounded_estimate((p["attainment"] for p in per), hi=1.0),
                                 **{_key(k, q): bounded_estimate(p[k][q] for p in per) for k, q in LATENCIES}}
            pooled[rate_tag(r)] = {"rate": rate_tag(r) if math.isinf(r) else r, **s}
            if s["delivery_lag_ms"]["p99"] is not None:
                lags.append((s["delivery_lag_ms"]["p99"], r))
        lag, at = max(lags, default=(None, None))
        if lag is not None and lag > LAG_WARN * slo.itl_ms:
            warn.append(f"{v}: delivery lag p99 up to {lag:.1f} ms (at {rate_tag(at)} req/s), over {LAG_WARN:.0%} "
                        "of the ITL target: the main process is slow to read tokens (token times are the workers' own, "
                        "so latencies stand; sends may be late)")
        sats = [p["saturation"] for p in reps if p["saturation"]]
        at = [p["at_goodput"] for p in reps if p["at_goodput"]]
        md = [p["mdl1"] for p in reps if p["mdl1"]]
        variants[v] = {
            "ran": bool(reps), "mode": "search" if (grid or {}).get(v) == "auto" else "grid",
            "rates": pooled, "repeats": reps,
            "goodput": _goodput_estimate([p["goodput"] for p in reps]),
            "goodput_tpot": _goodput_estimate([p["goodput_tpot"] for p in reps]),
            "saturation": {k: bounded_estimate(s[k] for s in sats) for k in
                           ("output_tok_s", "total_tok_s", "request_throughput")} if sats else None,
            "at_goodput": {"rates": [a["rate"] for a in at],
                           **{_key(k, q): bounded_estimate(a[_key(k, q)] for a in at) for k, q in LATENCIES}}
            if at else None,
            "mdl1": {"flagged": any(m["flag"] for m in md), "repeats": md} if md else None,
        }
        if any(m["flag"] for m in md):
            worst = max((m for m in md if m["flag"]), key=lambda m: abs(m["deviation"]))
            why = ("the harness or interference, not queueing alone, sets TTFT at low load" if worst["deviation"] > 0
                   else "TTFT is below what one request alone takes: D does not describe this load (prefix-cache "
                        "hits, shorter prompts), so the check says nothing about the harness")
            warn.append(f"{v}: mean TTFT at {worst['rate']:g} req/s is {worst['measured_ms']:.0f} ms against "
                        f"{worst['predicted_ms']:.0f} ms from M/D/1 ({worst['deviation']:+.0%}): {why}")
        cap = (max_running or {}).get(v)
        slots = decode_slots([x for k, xs in st.items() if k[0] == v for x in xs], cap) if cap else {}
        variants[v]["decode_slots"] = {"max_running": cap, "rates": slots} if slots else None
        line = slots_warning(v, slots, cap, (modelled or {}).get(v)) if slots else None
        if line:
            warn.append(line)
        if reps and not variants[v]["goodput"]["monotonic"]:
            warn.append(f"{v}: attainment is not monotonic in rate; goodput is bounded by the first failing rate")
    warn += _nixl_over_tcp(transfers)
    box = {"alone": alone_finding(alone, expect and expect.alone_ttft_ms, expect.tolerance if expect else 2.0),
           "over_saturation": over_saturation(variants, alone_by_variant or {}, alone, prefill_workers or {},
                                              modelled or {})}
    box["lines"] = [x for x in ((box["alone"] or {}).get("line"), over_line(box["over_saturation"])) if x]
    warn += box["lines"]
    return {"schema_version": SCHEMA_VERSION, "run": run, "box": box, "definitions": DEFINITIONS,
            "slo": {k: v for k, v in slo.to_raw().items() if k not in ("ttft", "itl")}, "relative": relative,
            "alone": alone, "alone_by_variant": alone_by_variant or {},
            "repeats": max((len(v["repeats"]) for v in variants.values()), default=0),
            "confidence": "mean and 95% Student-t interval over repeats",
            "percentiles": "numpy linear interpolation", "latency_unit": "ms", "partial": bool(partial),
            "reason": reason, "warnings": warn, "modelled": dict(modelled or {}), "variants": variants,
            # a trace workload: what it was (variant -> pdlab.traces Replay.facts) beside what was measured of it
            "trace": trace_summary(trace or {}, requests),
            # variant -> {workers: worker -> kernel -> choice, describe: one line} (pdlab.measure.kernels)
            "kernels": dict(kernels or {}),
            # rates written relative to the machine (0.5x: of 1 / TTFT alone) -> the req/s they resolved to
            "rates_resolved": dict(rates_resolved or {}),
            # each variant's steps against the timing profile its recipe names (pdlab.timing.check): per kind of
            # step MAPE and measured/predicted, host time; `lines`: what the run printed last
            "profile_check": dict(profile_check or {}),
            # a simulation from a profile checked against runs: its figures with every worker at the slow and
            # the fast end of the box's drift against the profile (pdlab.sim.band); None otherwise
            "forecast_band": forecast_band}


def _nixl_over_tcp(transfers: list[dict]) -> list[str]:
    """One warning per KV path over which NIXL moved data by TCP (UCX's fallback when nothing faster works)."""
    paths = sorted({(x["variant"], x["path"]) for x in transfers if x.get("transport") == "nixl" and x.get("path")})
    return [f"{v}: NIXL moved KV over TCP ({p}): slower than shared memory or RDMA; see pdlab doctor"
            for v, p in paths if rma_over_tcp(p)]
