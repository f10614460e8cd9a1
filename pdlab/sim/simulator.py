"""A virtual-time simulator: the real engine, scheduler and block manager of every worker of a deployment,
stepped on a virtual clock with the router's placement rules and the profile's transfer model, in one
process and without sleeping. It writes the records a run writes (requests, steps, transfers), so the same
metrics, goodput and compare code read them.

Each worker is an Engine with a timed runner whose clock jumps instead of sleeping; the simulator always
advances the earliest thing that can happen next: an arrival, a KV hand-over landing, or a worker starting
its next step (when it is free and has work). A step's tokens are stamped at its end, as a worker stamps
them. Placement is pdlab.serve.placement's, the router's own rules, over views of the simulated engines:
unified and prefill workers by least load (requests held); decode workers by the prompt tokens their prefix
caches hold (where a run's router mirrors them), then by free KV blocks less those promised to hand-overs
heading there; push reserves the decode blocks before prefill; with selective routing
(`route.remote_prefill_min_tokens`) a prompt with fewer uncached tokens than the threshold is prefilled by its
decode worker (route `local`), as a decode worker does with the router's `Submit`. A pull hand-over lands
latency + bytes / bandwidth after the prefill step ends; a push overlaps the prefill step layer by layer and
lands the last layer's share after it. When it lands, the request's blocks are copied from the prefill
engine's pool into the decode engine's (the timed pools are tiny), so the decode side samples from the KV it
holds, as a decode worker does (pdlab.engine.timed).

Host time (the profile's `host`, pdlab.timing.host): a worker starts its next step `gap_ms` after its last
one ended (its own time in between: sending tokens, reading messages); the router takes requests one at a
time, `send_ms` apart (a burst reaches the workers spread out, as a run's does), and a request in an idle
worker's socket starts its step `hop_ms` after the router took it, with what reached the worker meanwhile (a
stepping worker takes it at its next step); a hand-over reaches the decode side `handoff_ms` after the prefill ended
(pull: the transfer starts then, and not before the decode worker's current step is over, since a worker reads its
messages between steps; push: the decode worker admits the request that long after the KV landed). A CPU decode
worker pulling over shm copies on its own core, and its next step waits for the copy and the admission: in the
runs of 2026-12-08 on the 2-core Xeon, 87 of 96 pulls started, landed and were admitted within one gap between
the decode worker's steps (BENCHMARKS.md), where a simulation that stepped on beside the copy admitted 93 of 96 a
step late. Elsewhere (a GPU's side stream, NIXL) the copy runs beside the steps. A
request whose KV lands while its decode worker steps is admitted, and its first token sent, when that step
ends: a worker reads its landings between steps, and its second token is a whole step later; each hand-over
it admits puts `admit_ms` more before its next step (its own time for it: reserving, pulling, admitting), and
a pull `admit_ktok_ms` per 1000 prompt tokens copied more (the copy shares the worker's core). So
simulated TTFT and ITL carry the time a run's do around its steps. Tokens are stamped at step ends.

Contention (the profile's `contention`, pdlab.timing.contention): a step takes prefill_x (decode_x for a
decode-only step) times its model when every other worker steps beside it throughout (linear in the share of
its modelled time they do: one with work steps throughout, one without until its step in progress ends), and
cold_ms more when its worker's last step ended constants.COLD_AFTER_MS
or more before it (its first step included: a run's workers wait for their first request). A decode-only step
is drawn from the profile's decode spreads where it has them (alone and beside, weighted by the same share),
and carries after_prefill_x's excess, decayed by after_prefill_decay a step, after its worker's last prefill.
A decode worker's first step after it admitted hand-overs takes join_ktok_ms more per 1000 prompt tokens
admitted (their KV, written by another core, read there first; pdlab.timing.join).

A worker's pace (pdlab.sim.pace.WorkerPace, given per worker: a run replayed at its own pace) scales its
steps by its factor at the rate being simulated, and draws its gaps from the quantiles it carries.

Simulated hand-overs never fail (no lease runs out, no copy breaks), so `on_transfer_failure` never applies
here: no request takes the `recompute` route.

Everything it produces is modelled: it runs no model and measures nothing.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.constants import COLD_AFTER_MS
from pdlab.engine import Engine, SamplingParams
from pdlab.engine.model import load_stand_in
from pdlab.kv.copy import copy_blocks
from pdlab.measure.metrics import build_request_record
from pdlab.recipe import SLO, Variant
from pdlab.serve.placement import WorkerView, choose_decode, least_loaded, mirrors_caches, place_arrival
from pdlab.serve.topology import main_shares_cores
from pdlab.sim.host_load import HostLoad
from pdlab.sim.pace import WorkerPace
from pdlab.sim.worker_time import WorkerTime
from pdlab.workload import WorkloadRequest


class VirtualClock:
    """A clock that jumps: the engine reads it, its timed runner advances it instead of sleeping."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance_to(self, t: float) -> float:
        self.t = max(self.t, t)
        return self.t


@dataclass
class _Worker:
    name: str
    role: str
    engine: Engine
    clock: VirtualClock
    timing: WorkerTime
    free_at: float = 0.0
    step_end: Optional[float] = None  # when its last step ended (None: none yet)
    holds: set = field(default_factory=set)
    pulls_in_gap: bool = False  # a decode worker whose pulls' copies take its core between steps (_start_pull)


@dataclass
class _Req:
    wr: WorkloadRequest
    arrival: float
    tokens: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    prefill: Optional[str] = None
    decode: Optional[str] = None
    first: Optional[int] = None
    cached: int = 0
    reservation: Any = None
    src_blocks: list = field(default_factory=list)  # the prompt's blocks in the prefill engine's pool
    route: str = "remote"  # where its prompt is prefilled (constants.PREFILL_ROUTES)
    routed: float = 0.0  # when the router took it (its arrival, or send_ms after the request before)
    seq: Any = None  # unified and local routes: its engine Sequence, for the prefill's timestamps


class Simulator:
    """One variant's deployment, simulated. `run(reqs, rate, repeat)` returns (requests, steps, transfers).
    `paces`: worker name -> its pace (pdlab.sim.pace); a worker without one takes the profile as it is."""

    def __init__(self, variant: Variant, slo: SLO, paces: Optional[dict[str, WorkerPace]] = None,
                 shares_cores: Optional[bool] = None):
        """`shares_cores`: whether a run of this deployment leaves its main process no core of its own (then the
        profile's contention.main_step_ms comes from the workers' steps, pdlab.sim.host_load); None: as it would
        on this machine (topology.main_shares_cores)."""
        if not variant.model.modelled:
            raise ValueError(f"variant {variant.name}: the simulator needs a modelled timing (model.timing)")
        self.v, self.slo, self.timing = variant, slo, variant.model.timing
        dep = variant.deployment
        self.mode, self.first_token = dep.mode, dep.first_token
        self.remote_min = dep.route.remote_prefill_min_tokens
        decoders = sum(1 for w in dep.workers if w.role == "decode")
        self.mirror = mirrors_caches(dep.disaggregated, decoders, dep.route.selective, variant.engine.prefix_caching)
        self.xfer = self.timing.transfer_of(dep.transport) if dep.disaggregated else None
        host = self.timing.host
        self.gap_s, self.hop_s, self.handoff_s = host.gap_ms / 1e3, host.hop_ms / 1e3, host.handoff_ms / 1e3
        self.send_s, self.admit_s = host.send_ms / 1e3, host.admit_ms / 1e3
        # a pull's copy runs on the decode worker's core; a push's on its prefill worker's
        self.admit_tok_s = host.admit_ktok_ms / 1e6 if self.mode == "pull" else 0.0
        stand_in = load_stand_in(variant.model)
        self.workers: dict[str, _Worker] = {}
        unknown = set(paces or {}) - {w.name for w in dep.workers}
        if unknown:
            raise ValueError(f"variant {variant.name}: paces for workers it does not have: "
                             f"{', '.join(sorted(unknown))}")
        for w in dep.workers:
            clock = VirtualClock()
            pace = (paces or {}).get(w.name)
            timing = WorkerTime(self.timing, w.name, pace)
            eng = Engine(stand_in, variant.engine, role=w.role, step_timing=timing, clock=clock)
            self.workers[w.name] = _Worker(w.name, w.role, eng, clock, timing,
                                           pulls_in_gap=self.mode == "pull" and w.kind == "cpu"
                                           and dep.transport == "shm")
        self.layers = next(iter(self.workers.values())).engine.dims["layers"]
        shares = main_shares_cores(dep) if shares_cores is None else shares_cores
        step_ms = self.timing.contention.main_step_ms
        self.host = HostLoad(step_ms, list(self.workers)) if shares and step_ms > 0 else None
        for w in self.workers.values():
            w.timing.host = self.host

    def _of(self, role: str) -> list[_Worker]:
        return [w for w in self.workers.values() if w.role == role]

    # ---- placement (pdlab.serve.placement) ----
    def _view(self, w: _Worker) -> WorkerView:
        """What placement sees of `w`: exact here, where a router sees the workers' reports. Room: free blocks
        less those of requests heading here that hold no reservation yet."""
        bs = w.engine.config.block_size
        waiting = (self._reqs[r] for r in w.holds if r in self._reqs)
        room = w.engine.blocks.num_free - sum(-(-len(r.wr.prompt_ids) // bs) for r in waiting
                                              if r.route == "remote" and r.reservation is None)
        cached = (lambda p: len(w.engine.blocks.match_prefix(p, len(p) - 1)) * bs) if self.mirror else (lambda p: 0)
        return WorkerView(w.name, w.role, len(w.holds), room, bs, cached)

    def _least_loaded(self, role: str) -> _Worker:
        return self.workers[least_loaded([self._view(w) for w in self._of(role)]).name]

    def _choose_decode(self, r: _Req) -> _Worker:
        return self.workers[choose_decode([self._view(w) for w in self._of("decode")], r.wr.prompt_ids).worker.name]

    def _transfer_s(self, nbytes: int) -> float:
        return 0.0 if self.xfer is None else self.xfer.transfer_s(nbytes)

    def run(self, reqs: list[WorkloadRequest], rate: float, repeat: int = 0, warmup: bool = False,
            cold: bool = True) -> tuple[list[dict], list[dict], list[dict]]:
        """`reqs` at `rate` from a second after every worker is free. `cold`: each worker's prefix cache is
        reset first, as a run resets it before each rate; False after the rate's warm-up, whose prefixes a real
        run's measured requests find cached."""
        for w in self.workers.values():
            w.timing.begin(rate, repeat)
            if cold:
                w.engine.reset_prefix_cache()
            t = max(w.free_at, w.clock.t)
            w.clock.advance_to(t)
            w.free_at = t
        t0 = max(w.free_at for w in self.workers.values()) + 1.0
        if self.host is not None:
            self.host.begin()
        state = {r.id: _Req(r, t0 + (0.0 if math.isinf(r.arrival) else r.arrival)) for r in reqs}
        self._records: list[dict] = []
        self._steps: list[dict] = []
        self._transfers: list[dict] = []
        self._tag = {"variant": self.v.name, "rate": rate, "repeat": repeat, **({"warmup": True} if warmup else {})}
        self._reqs, self._done, self._waiting_room = state, set(), []
        self._full: dict[str, int] = {}  # decode worker -> its free blocks when a reservation last failed
        events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, req id)
        seq = 0
        routed = -math.inf  # when the router took the last request: one at a time, send_s each
        for r in sorted(state.values(), key=lambda r: r.arrival):
            routed = r.routed = max(r.arrival, routed + self.send_s)
            heapq.heappush(events, (routed, seq, "arrive", r.wr.id))  # in its worker's socket (_wake: the hop)
            seq += 1
        self._events, self._seq = events, seq
        now = t0
        blocked: set[str] = set()  # workers whose last step could schedule nothing: wait for a change
        while len(self._done) < len(state):
            busy = [(max(w.free_at, now), w.name) for w in self.workers.values()
                    if w.engine.has_work() and w.name not in blocked]
            t_step = min(busy) if busy else (math.inf, "")
            t_event = events[0][0] if events else math.inf
            if t_event == math.inf and t_step[0] == math.inf:
                self._fail_stuck(now)  # a real run would hit its hand-over or stall timeout here
                break
            if t_event <= t_step[0]:
                now, _, kind, rid = heapq.heappop(events)
                self._event(kind, rid, now)
                blocked.clear()
            else:
                now = t_step[0]
                if self._step(self.workers[t_step[1]], now):
                    blocked.clear()
                else:
                    blocked.add(t_step[1])
        return self._records, self._steps, self._transfers

    def _fail_stuck(self, now: float) -> None:
        for r in self._reqs.values():
            if r.wr.id not in self._done:
                self._finish(r, None, now, error="simulation: no KV room anywhere for this request to progress "
                                                 "(every block held or reserved): a real run ends it by timeout")

    # ---- events ----
    def _push(self, t: float, kind: str, rid: str) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, rid))
        self._seq += 1

    def _event(self, kind: str, rid: str, now: float) -> None:
        r = self._reqs[rid]
        params = SamplingParams(max_tokens=r.wr.output_len, ignore_eos=True)
        if kind == "arrive":
            r.phases["queued"] = r.routed  # when the router took it (send_ms behind the one before)
            to = place_arrival([self._view(w) for w in self.workers.values()], r.wr.prompt_ids, self.mode,
                               self.remote_min)
            w, r.route = self.workers[to.worker.name], to.route
            if to.role == "decode" and to.route == "remote":  # push: reserve decode blocks first, then prefill
                r.decode = w.name  # writes into them
                w.holds.add(rid)
                self._waiting_room.append(rid)
                self._reserve_waiting(now)
            else:  # unified, pull's prefill worker, or a local prefill on the decode worker
                self._give(r, w, now)
                self._wake(w, now)
                w.engine.add(rid, r.wr.prompt_ids, params)
                if to.route != "remote":
                    r.seq = w.engine.sequence(rid)
        elif kind == "land":  # the KV is in the decode pool
            d, p = self.workers[r.decode], self.workers[r.prefill]
            skip = r.reservation.cached_blocks  # held by decode's prefix cache: not sent
            copy_blocks(p.engine.kv, r.src_blocks[skip:], d.engine.kv, r.reservation.block_ids[skip:])
            d.clock.advance_to(now)
            d.engine.admit(rid, r.first)  # its next step takes the request: the one in progress has its batch
            # a worker reads its messages and landings between steps: mid-step, the request is admitted, and
            # its first token sent, when the step ends (the token 2 then follows one gap and one step later)
            admitted = max(now, d.step_end) if d.step_end is not None else now
            copied = max(len(r.wr.prompt_ids) - skip * d.engine.config.block_size, 0)
            # its own time for it (and a pull's copy), before its next step; a copy that held the worker already
            # took its share of that time (admit_ms and admit_ktok_ms were read from gaps that held the copy)
            own = self.admit_s + self.admit_tok_s * copied
            if d.pulls_in_gap:
                own = max(own - (r.phases["transfer_end"] - r.phases["transfer_start"]), 0.0)
            d.free_at = max(d.free_at, admitted) + own
            d.timing.joined_ktok += copied / 1000.0  # its next step reads their KV first (join_ktok_ms)
            r.phases["admitted"] = admitted
            p.engine.release(rid)
            p.holds.discard(rid)
            if self.first_token == "decode":
                self._token(r, r.first, admitted)
            self._reserve_waiting(now)
        elif kind == "handed":  # pull: the decode side has the hand-over; it reserves and pulls
            self._waiting_room.append(rid)
            self._reserve_waiting(now)

    def _give(self, r: _Req, w: _Worker, now: float) -> None:
        w.holds.add(r.wr.id)
        r.prefill = w.name
        if w.role == "decode":  # a local prefill: it decodes where it is prefilled
            r.decode = w.name
        w.clock.advance_to(now)

    def _wake(self, w: _Worker, now: float) -> None:
        """A request reaches `w`'s socket at `now`. Idle, the worker wakes, reads it and steps hop_ms later, and
        what reaches it meanwhile joins that step (at rate inf a run's worker takes most of a burst in its first
        step); stepping, it reads it between steps and its next step takes it, with no hop (one routed just
        before a step ends joins the next)."""
        if not w.engine.has_work() and w.free_at <= now:
            w.free_at = now + self.hop_s

    def _reserve_waiting(self, now: float) -> None:
        """Reserve decode blocks for hand-overs waiting for room, oldest first (as decode workers do). A worker
        whose free blocks did not grow since a reservation failed there is not asked again (it would fail
        again: this keeps a long queue at saturation from costing a reservation attempt per step)."""
        still = []
        for rid in self._waiting_room:
            r = self._reqs[rid]
            if r.decode is None:  # pull: the decode worker is chosen when the hand-over reaches the decode side
                r.decode = self._choose_decode(r).name
                self.workers[r.decode].holds.add(rid)
            d = self.workers[r.decode]
            if self._full.get(d.name, -1) >= d.engine.blocks.num_free:
                r.decode = d.name
                still.append(rid)
                continue
            params = SamplingParams(max_tokens=r.wr.output_len, ignore_eos=True)
            res = d.engine.reserve(rid, r.wr.prompt_ids, r.first if self.mode == "pull" else None, params)
            if res is None:
                r.decode = d.name
                self._full[d.name] = d.engine.blocks.num_free
                still.append(rid)
                continue
            r.decode, r.reservation = d.name, res
            d.holds.add(rid)
            if self.mode == "pull":
                self._start_pull(r, now)
            else:
                p = self._least_loaded("prefill")
                self._give(r, p, now)
                self._wake(p, now)
                p.engine.add(rid, r.wr.prompt_ids, params)
        self._waiting_room = still

    def _start_pull(self, r: _Req, now: float) -> None:
        d = self.workers[r.decode]
        skip = r.reservation.cached_blocks
        blocks = len(r.reservation.block_ids) - skip
        nbytes = blocks * d.engine.block_bytes
        now = max(now, d.free_at)  # a worker reads its messages between steps
        end = now + self._transfer_s(nbytes)
        if d.pulls_in_gap:  # its next step waits for the copy and the admission (the land event: ties go first)
            d.free_at = max(d.free_at, end)
        r.phases.update(transfer_start=now, transfer_end=end)
        self._transfers.append({**self._tag, "request": r.wr.id, "bytes": nbytes, "blocks": blocks, "start": now,
                                "end": end, "transport": self.v.deployment.transport, "mode": "pull",
                                "src": r.prefill, "dst": r.decode, "saved_bytes": skip * d.engine.block_bytes,
                                "copy_s": end - now})
        self._push(end, "land", r.wr.id)

    # ---- steps ----
    def _step(self, w: _Worker, start: float) -> bool:
        """One engine step of `w` starting at `start`; False when it could schedule nothing."""
        w.clock.advance_to(start)
        # a worker with work steps beside this step throughout (back to back, with gaps of a fraction of a
        # millisecond); one without, until its step in progress ends
        w.timing.step_start = start
        w.timing.others = [(o.engine.has_work(), o.step_end) for o in self.workers.values() if o is not w]
        w.timing.cold = w.step_end is None or start - w.step_end >= COLD_AFTER_MS / 1e3
        out = w.engine.step()
        if out.record is None and not out.tokens:
            return False
        end = w.step_end = w.clock.t
        w.timing.waited = not w.engine.has_work()  # nothing left to step: its core idles until its next step
        if self.host is not None:
            self.host.stepped(end)
        # the worker's own time before its next step
        w.free_at = end + w.timing.gap_s(self.gap_s)
        if out.record is not None:
            self._steps.append({**self._tag, "worker": w.name, "role": w.role, **out.record.__dict__})
        for t in out.tokens:
            r = self._reqs.get(t.req_id)
            if r is None:
                continue
            if t.error:
                self._finish(r, w, now=end, error=t.error)
            elif t.finish_reason == "handoff":
                self._handoff(r, w, out.record, end)
            else:
                self._token(r, t.token_id, end)
                if t.finished:
                    r.cached = r.cached or t.cached_tokens
                    self._finish(r, w, now=end)
        if w.role == "decode":
            self._reserve_waiting(end)
        return True

    def _handoff(self, r: _Req, p: _Worker, record: Any, end: float) -> None:
        info = p.engine.handoff(r.wr.id)
        seq_cached = p.engine.sequence(r.wr.id).num_cached
        r.first, r.cached, r.src_blocks = info.first_token, seq_cached, info.block_ids
        r.phases.update(prefill_start=p.engine.sequence(r.wr.id).t_first_scheduled, prefill_end=end)
        if self.first_token == "prefill":
            self._token(r, info.first_token, end)
        if self.mode == "pull":
            self._push(end + self.handoff_s, "handed", r.wr.id)
            return
        d = self.workers[r.decode]
        skip = r.reservation.cached_blocks
        blocks = len(r.reservation.block_ids) - skip
        nbytes = blocks * d.engine.block_bytes
        c = self._transfer_s(nbytes)
        step = end - record.start
        land = max(end + c / self.layers, record.start + step / self.layers + c)  # layer by layer, overlapped
        r.phases.update(transfer_start=record.start + step / self.layers, transfer_end=land)
        self._transfers.append({**self._tag, "request": r.wr.id, "bytes": nbytes, "blocks": blocks,
                                "start": record.start + step / self.layers, "end": land,
                                "transport": self.v.deployment.transport, "mode": "push", "src": p.name,
                                "dst": d.name, "saved_bytes": skip * d.engine.block_bytes, "copy_s": c})
        self._push(land + self.handoff_s, "land", r.wr.id)  # admitted once the decode side hears of it

    def _token(self, r: _Req, token: int, t: float) -> None:
        if not r.tokens:
            r.phases.setdefault("sent", t)
        r.tokens.append(t)
        r.output_ids.append(token)

    def _finish(self, r: _Req, w: Optional[_Worker], now: float, error: Optional[str] = None) -> None:
        rid = r.wr.id
        for x in self.workers.values():
            x.holds.discard(rid)
        self._done.add(rid)
        workers = {"prefill": r.prefill, "decode": r.decode} if r.decode else {"unified": r.prefill}
        if r.seq is not None:  # prefilled where it decodes: the worker's own prefill timestamps, as a worker reports
            for k, attr in (("prefill_start", "t_first_scheduled"), ("prefill_end", "t_prefill_end")):
                if getattr(r.seq, attr, None):
                    r.phases.setdefault(k, getattr(r.seq, attr))
        self._records.append(build_request_record(
            variant=self.v.name, rate=self._tag["rate"], id=rid, prompt_ids=r.wr.prompt_ids,
            output_ids=r.output_ids, arrival=r.arrival, token_times=r.tokens, slo=self.slo, error=error,
            phases=r.phases, workers=workers, cached_tokens=r.cached, warmup=bool(self._tag.get("warmup")),
            repeat=self._tag["repeat"], delivery_lag=[0.0] * len(r.tokens), route=r.route))
