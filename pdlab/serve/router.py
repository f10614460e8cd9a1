"""The router: main-process side of the control plane. Places requests, follows each one through
prefill, KV hand-over and decode, and turns worker messages into events. A token carries the time the
worker sampled it (time.monotonic() is system-wide on Linux) and the time the router read it: latency
metrics use the first, so a busy main process cannot inflate them; the gap is reported as delivery lag.

Placement is pdlab.serve.placement's (the simulator follows the same rules): unified replicas by least load
(requests held); disaggregated, the least-loaded prefill worker and the decode worker that holds most of the
prompt in its prefix cache (as mirrored from its cache events, pdlab.serve.mirror) among those with room,
else the one with most room (free KV blocks less what in-flight hand-overs will take); with selective routing
(`route.remote_prefill_min_tokens`) a prompt with fewer uncached tokens than the threshold is prefilled by
that decode worker itself. The KV hand-over of a remotely prefilled request is the business of the router's
half of the hand-over protocol (pdlab.serve.handover: one object per mode; failures, the failure policy and
the push fence live there). Each request's state is explicit (pdlab.serve.request.ReqState).

A worker "holds" a request from the message that gives it the request until it reports it finished or
is told to release it; when a request ends early (error, timeout, failed worker) every other holder
gets an `Abort`, so no block stays behind on either side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.constants import TRANSFER_FAILURE_POLICY
from pdlab.serve import messages as m
from pdlab.serve.events import RequestDone, StepEvent, TokenEvent, TransferEvent, WorkerFailed
from pdlab.serve.handover import HANDOVERS
from pdlab.serve.mirror import PrefixMirror
from pdlab.serve.placement import DecodeChoice, WorkerView, choose_decode, least_loaded, place_arrival
from pdlab.serve.request import ReqState, Request
from pdlab.timing.pace import Pace

__all__ = ["Router", "WorkerState", "RequestDone", "StepEvent", "TokenEvent", "TransferEvent", "WorkerFailed"]


@dataclass
class WorkerState:
    name: str
    role: str
    devices: list[str]
    proc: Any = None
    ready: bool = False
    pool: Optional[dict] = None
    kv_blocks: int = 0
    block_size: int = 16
    free_blocks: int = 0
    last_hb: float = 0.0
    loop_t: float = 0.0
    failed: Optional[str] = None
    holds: set = field(default_factory=set)  # req_ids this worker holds
    cache: PrefixMirror = field(default_factory=PrefixMirror)  # decode: its prefix cache, when it reports it
    fingerprint: dict = field(default_factory=dict)  # disaggregated roles: what its KV blocks are (Ready)
    kernels: dict = field(default_factory=dict)  # CPU kernels its engine runs, and why (Ready)
    pace: Optional[Pace] = None  # the box's pace at its start (Ready; pdlab.timing.pace)


class Router:
    def __init__(self, sock: Any, workers: list[WorkerState], *, mode: str, first_token: str,
                 transfer_timeout_s: float, heartbeat_timeout_s: float, step_timeout_s: float,
                 on_transfer_failure: str = TRANSFER_FAILURE_POLICY, remote_prefill_min_tokens: int = 0):
        self.sock, self.mode, self.first_token = sock, mode, first_token
        self.remote_min = remote_prefill_min_tokens
        self.handover = HANDOVERS[mode](self, on_transfer_failure, transfer_timeout_s)
        self.workers = {w.name: w for w in workers}
        self.heartbeat_timeout_s, self.step_timeout_s = heartbeat_timeout_s, step_timeout_s
        self.reqs: dict[str, Request] = {}
        self.events: list[Any] = []
        self.stats: dict[str, m.Stats] = {}

    def live(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role and w.failed is None]

    def send(self, worker: str, msg: Any) -> None:
        w = self.workers[worker]
        if w.failed is not None:
            return
        try:
            self.sock.send_multipart([worker.encode(), m.encode(msg)])
        except Exception:  # noqa: BLE001 - unreachable peer: the health check reports it
            pass

    def give(self, req: Request, worker: str, msg: Any) -> None:
        """Send `worker` a message that gives it `req`: it holds the request from now on."""
        self.workers[worker].holds.add(req.req_id)
        self.send(worker, msg)

    # ---- placement (pdlab.serve.placement) ----
    def _views(self, req: Request) -> list[WorkerView]:
        return [WorkerView(w.name, w.role, len(w.holds), self._room(w, req), w.block_size,
                           lambda p, w=w: w.cache.cached_tokens(p, w.block_size))
                for w in self.workers.values() if w.failed is None]

    def _room(self, w: WorkerState, req: Request) -> int:
        """Free blocks of `w` less those promised to hand-overs not yet admitted there."""
        promised = 0
        for rid in w.holds:
            r = self.reqs.get(rid)
            if r is not None and rid != req.req_id and r.awaits_kv:
                promised += -(-len(r.prompt_ids) // max(1, w.block_size))
        return w.free_blocks - promised

    def decode_for(self, req: Request) -> Optional[DecodeChoice]:
        """The decode worker for `req` now, and the prompt tokens it holds."""
        return choose_decode([v for v in self._views(req) if v.role == "decode"], req.prompt_ids)

    def least_loaded(self, role: str) -> Optional[str]:
        w = least_loaded([WorkerView(w.name, w.role, len(w.holds), 0, w.block_size) for w in self.live(role)])
        return None if w is None else w.name

    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} is already in flight")
        req = Request(req_id, list(prompt_ids), dict(params), {"queued": time.monotonic()})
        self.reqs[req_id] = req
        to = place_arrival(self._views(req), req.prompt_ids, self.mode, self.remote_min)
        req.route = to.route
        if to.worker is None:
            return self.end(req, False, f"no live {to.role} worker")
        if to.route == "remote":
            return self.handover.start(req, to.worker.name)
        req.prefill, req.state = to.worker.name, ReqState.PREFILLING
        if to.route == "local":
            req.decode = to.worker.name
        self.give(req, to.worker.name, m.Submit(req_id, req.prompt_ids, req.params))

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        """End a request its client gave up on (a stop string matched, the client left, shutdown): every worker
        holding it lets go, and it is reported done (not ok, `reason`). In push mode, while its prefill worker
        may still be writing into the decode blocks, the decode side is told only after that worker stopped
        (the same fence as a failed hand-over, pdlab.serve.handover). Unknown or finished requests: nothing."""
        req = self.reqs.get(req_id)
        if req is None or req.cancelled is not None:
            return
        req.cancelled = reason
        if req.state is ReqState.FENCED or self.handover.fence(req, reason):
            return  # it ends once the prefill worker stopped writing
        self.end(req, False, reason)

    # ---- worker messages ----
    def dispatch(self, frame: bytes) -> None:
        now = time.monotonic()
        msg = m.decode(frame)
        w = self.workers.get(getattr(msg, "worker", ""))
        if w is None:
            return
        if isinstance(msg, m.Heartbeat):
            w.last_hb, w.loop_t = now, msg.loop_t
            return
        if w.failed is not None:
            return  # late words from a worker already declared failed
        w.last_hb = max(w.last_hb, now)
        if isinstance(msg, m.Tokens):
            self._tokens(w, msg, now)
        elif isinstance(msg, m.Step):
            w.free_blocks = msg.record["kv_blocks_total"] - msg.record["kv_blocks_used"]
            self.events.append(StepEvent(w.name, w.role, msg.record))
        elif isinstance(msg, m.Finished):
            self._finished(w, msg)
        elif isinstance(msg, m.PrefillDone):
            self.handover.prefill_done(w, msg, now)
        elif isinstance(msg, m.Reserved):
            self.handover.reserved(w, msg)
        elif isinstance(msg, m.Transferred):
            self.handover.transferred(w, msg)
        elif isinstance(msg, m.TransferFailed):
            self.handover.transfer_failed(w, msg)
        elif isinstance(msg, m.Aborted):
            self.handover.aborted(msg)
        elif isinstance(msg, m.CacheEvents):
            w.cache.apply(msg.stored, msg.removed)
        elif isinstance(msg, m.Stats):
            self.stats[w.name] = msg
        elif isinstance(msg, m.Ready):
            w.ready, w.pool, w.kv_blocks, w.block_size = True, msg.pool, msg.kv_blocks, msg.block_size
            w.kernels, w.pace = msg.kernels, Pace.from_raw(msg.pace)
            w.fingerprint = msg.fingerprint
            w.free_blocks, w.loop_t = msg.kv_blocks, now
            w.last_hb = now  # the start-up grace ends: from here on a worker is silent for heartbeat_timeout_s at most
        elif isinstance(msg, m.Fatal):
            self.fail_worker(w.name, msg.reason)

    def _tokens(self, w: WorkerState, msg: m.Tokens, now: float) -> None:
        for rid, tok, index, finished in msg.items:
            req = self.reqs.get(rid)
            if req is None:
                continue
            if index == 0:
                req.phases.setdefault("sent", msg.t)
            if req.state is ReqState.PREFILLING and req.route != "remote":  # prefilled where it decodes
                req.state = ReqState.DECODING
            req.output_ids.append(tok)
            self.events.append(TokenEvent(rid, tok, msg.t or now, index, finished, w.name, now))

    def _finished(self, w: WorkerState, msg: m.Finished) -> None:
        w.holds.discard(msg.req_id)
        req = self.reqs.get(msg.req_id)
        if req is not None:
            req.cached_tokens = req.cached_tokens or msg.cached_tokens
            for k, v in msg.phases.items():
                if v:
                    req.phases.setdefault(k, v)
            self.end(req, msg.ok, msg.error)

    def deliver_first(self, req: Request, t: float, worker: str) -> None:
        """first_token: prefill: the router delivers the prefill worker's first token (once)."""
        if req.output_ids or req.first_token is None:
            return
        req.phases["sent"] = t
        req.output_ids.append(req.first_token)
        self.events.append(TokenEvent(req.req_id, req.first_token, t, 0, False, worker, time.monotonic()))

    def record_transfer(self, req: Request, rec: dict) -> None:
        req.phases.update(transfer_start=rec["start"], transfer_end=rec["end"])
        self.events.append(TransferEvent(rec))

    def end(self, req: Request, ok: bool, error: str) -> None:
        """End a request: report it, and tell every worker still holding it to let go."""
        req.state = ReqState.DONE if ok else ReqState.FAILED
        self.reqs.pop(req.req_id, None)
        for w in self.workers.values():
            if req.req_id in w.holds:
                w.holds.discard(req.req_id)
                self.send(w.name, m.Abort(req.req_id))
        self.events.append(RequestDone(req.req_id, ok, error, list(req.output_ids), req.cached_tokens,
                                       req.prefill, req.decode, dict(req.phases), req.route))

    # ---- faults ----
    def check_health(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.handover.renew_leases(now)
        for w in self.workers.values():
            if w.failed is not None or w.proc is None:
                continue
            code = w.proc.exitcode
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self.fail_worker(w.name, f"worker {w.name} (pid {w.proc.pid}) {how}")
            elif w.last_hb and now - w.last_hb > self.heartbeat_timeout_s:
                self.fail_worker(w.name, f"worker {w.name} sent no heartbeat for {now - w.last_hb:.1f}s", kill=True)
            elif w.ready and now - w.loop_t > self.step_timeout_s:
                self.fail_worker(w.name, f"worker {w.name} is hung: one step has run {now - w.loop_t:.0f}s", kill=True)
        self.handover.expire(now)

    def fail_worker(self, name: str, reason: str, kill: bool = False) -> None:
        w = self.workers[name]
        if w.failed is not None:
            return
        w.failed = reason
        if kill and w.proc is not None and w.proc.exitcode is None:
            w.proc.kill()
        self.events.append(WorkerFailed(name, reason))
        for rid in list(w.holds):
            req = self.reqs.get(rid)
            if req is not None:
                self.end(req, False, f"worker {name} failed: {reason}")
        w.holds.clear()
        self.handover.worker_failed(name)
