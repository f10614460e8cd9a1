"""Chrome / Perfetto trace JSON from the run's records (opens in ui.perfetto.dev or chrome://tracing).

Layout: one process per (variant, worker) with its engine steps as slices and counters for queue depth
(`waiting`), running sequences and KV use; one process per variant for requests (async tracks, one per
request, with its sequential phases queue -> prefill -> transfer -> admission -> decode) and one for
KV transfers (slices per src -> dst). A "run" process marks each (variant, rate) span. Timestamps are
microseconds from the earliest timestamp in the records (the run start).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

US = 1e6


def _name_step(s: dict) -> str:
    p, d = int(s.get("prefill_tokens") or 0), int(s.get("decode_seqs") or 0)
    return "prefill+decode" if p and d else "prefill" if p else "decode" if d else "idle"


def _rate_text(rate: Any) -> str:
    # deferred: numpy
    from pdlab.measure.metrics import as_rate
    from pdlab.workload import rate_tag

    return rate_tag(as_rate(rate))


def _start_time(requests: list[dict], steps: list[dict], transfers: list[dict]) -> float:
    ts = [r["arrival"] for r in requests if r.get("arrival") is not None]
    ts += [s["start"] for s in steps] + [x["start"] for x in transfers]
    return min(ts) if ts else 0.0


def request_phases(r: dict) -> list[tuple[str, float, float]]:
    """Sequential, non-overlapping phases (name, start, end) in seconds, from what the record has."""
    times = r.get("token_times") or []
    ph = {k: v for k, v in (r.get("phases") or {}).items() if v is not None}
    first = times[0] if times else None
    marks: list[tuple[str, Optional[float]]] = [
        ("queue", r["arrival"]), ("prefill", ph.get("prefill_start")),
        ("transfer", ph.get("prefill_end") if "transfer_end" in ph else None),
        ("admission", ph.get("transfer_end") if "admitted" in ph else None),
        ("decode", ph.get("admitted", ph.get("transfer_end", ph.get("prefill_end", first)))),
    ]
    end = times[-1] if times else max([r["arrival"], *ph.values()])
    out: list[tuple[str, float, float]] = []
    pts = [(n, t) for n, t in marks if t is not None]
    if not ph and first is not None:  # no phase timestamps: waiting for the first token, then decode
        pts = [("ttft", r["arrival"]), ("decode", first)]
    prev = r["arrival"]
    for i, (name, t) in enumerate(pts):
        start = max(t, prev)
        stop = pts[i + 1][1] if i + 1 < len(pts) else end
        stop = max(min(stop, end), start)
        if stop > start or name == "queue":
            out.append((name, start, stop))
        prev = stop
    return out


def build_trace(requests: list[dict], steps: list[dict], transfers: list[dict],
                t0: Optional[float] = None) -> dict:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    t0 = _start_time(requests, steps, transfers) if t0 is None else t0
    ev: list[dict] = []
    pids: dict[str, int] = {}

    def us(t: float) -> float:
        return round((t - t0) * US, 3)

    def pid(name: str) -> int:
        if name not in pids:
            pids[name] = len(pids) + 1
            ev.append({"ph": "M", "name": "process_name", "pid": pids[name], "tid": 0, "args": {"name": name}})
            ev.append({"ph": "M", "name": "process_sort_index", "pid": pids[name], "tid": 0,
                       "args": {"sort_index": pids[name]}})
        return pids[name]

    # one slice per variant, rate and repeat: a rate's repeats run apart, with the other rates between them
    spans: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [float("inf"), float("-inf")])
    for r in requests:
        sp = spans[(r["variant"], _rate_text(r["rate"]), int(r.get("repeat") or 0))]
        sp[0] = min(sp[0], r["arrival"])
        sp[1] = max(sp[1], (r.get("token_times") or [r["arrival"]])[-1])
    run_pid = pid("run")
    repeats = any(k[2] for k in spans)
    for (variant, rate, repeat), (a, b) in spans.items():
        name = f"{variant} @ {rate} req/s" + (f" (repeat {repeat + 1})" if repeats else "")
        ev.append({"ph": "X", "name": name, "pid": run_pid, "tid": 1, "ts": us(a),
                   "dur": max(0.0, round((b - a) * US, 3)), "args": {"variant": variant, "rate": rate,
                                                                     "repeat": repeat}})

    for s in sorted(steps, key=lambda s: s["start"]):
        p = pid(f"{s['variant']}/{s['worker']} ({s.get('role', '?')})")
        used, total = s.get("kv_blocks_used"), s.get("kv_blocks_total")
        kv = (100.0 * used / total) if used is not None and total else None
        args = {k: s.get(k) for k in ("prefill_tokens", "decode_seqs", "kv_blocks_used", "kv_blocks_total",
                                      "waiting", "running", "preempted")}
        args.update(kv_use_pct=kv, rate=_rate_text(s["rate"]))
        ev.append({"ph": "X", "name": _name_step(s), "cat": "step", "pid": p, "tid": 1, "ts": us(s["start"]),
                   "dur": max(0.0, round((s["end"] - s["start"]) * US, 3)), "args": args})
        ev.append({"ph": "C", "name": "waiting", "pid": p, "ts": us(s["start"]),
                   "args": {"waiting": s.get("waiting") or 0, "running": s.get("running") or 0}})
        if kv is not None:
            ev.append({"ph": "C", "name": "kv_use_pct", "pid": p, "ts": us(s["start"]), "args": {"kv_use_pct": kv}})

    for r in requests:
        if r.get("warmup"):
            continue
        p = pid(f"{r['variant']}/requests")
        rid = f"{r['variant']}/{_rate_text(r['rate'])}/{r['id']}"
        phases = request_phases(r)
        if not phases:
            continue
        args = {k: r.get(k) for k in ("prompt_len", "output_len", "cached_tokens", "ttft", "ok", "error",
                                      "slo_ok", "prefill_worker", "decode_worker")}
        a, b = phases[0][1], phases[-1][2]
        ev.append({"ph": "b", "cat": "request", "name": f"req {r['id']}", "id": rid, "pid": p, "tid": 0,
                   "ts": us(a), "args": args})
        for name, s0, s1 in phases:
            ev.append({"ph": "b", "cat": "request", "name": name, "id": rid, "pid": p, "tid": 0, "ts": us(s0)})
            ev.append({"ph": "e", "cat": "request", "name": name, "id": rid, "pid": p, "tid": 0, "ts": us(s1)})
        ev.append({"ph": "e", "cat": "request", "name": f"req {r['id']}", "id": rid, "pid": p, "tid": 0,
                   "ts": us(b)})

    tids: dict[tuple[int, str], int] = {}
    for x in sorted(transfers, key=lambda x: x["start"]):
        p = pid(f"{x['variant']}/transfers")
        lane = f"{x.get('src', '?')} -> {x.get('dst', '?')}"
        if (p, lane) not in tids:
            tids[(p, lane)] = len([k for k in tids if k[0] == p]) + 1
            ev.append({"ph": "M", "name": "thread_name", "pid": p, "tid": tids[(p, lane)], "args": {"name": lane}})
        dur = x["end"] - x["start"]
        args = {k: x.get(k) for k in ("request", "bytes", "blocks", "transport", "mode", "saved_bytes", "path")}
        args.update(rate=_rate_text(x["rate"]), gb_s=(x.get("bytes") or 0) / dur / 1e9 if dur > 0 else None)
        ev.append({"ph": "X", "name": f"kv {x.get('request')}", "cat": "transfer", "pid": p, "tid": tids[(p, lane)],
                   "ts": us(x["start"]), "dur": max(0.0, round(dur * US, 3)), "args": args})
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"t0_monotonic_s": t0}}
