"""The router: main-process side of the control plane. Places requests, follows each one through
prefill, KV hand-over and decode, and turns worker messages into events. A token carries the time the
worker sampled it (time.monotonic() is system-wide on Linux) and the time the router read it: latency
metrics use the first, so a busy main process cannot inflate them; the gap is reported as delivery lag.

Placement: unified replicas by least load (requests in flight); disaggregated, the least-loaded prefill
worker, then the decode worker with the most free KV blocks (less what in-flight hand-overs will take).
A worker "holds" a request from the message that gives it the request until it reports it finished or
is told to release it; when a request ends early (error, timeout, failed worker) every other holder
gets an `Abort`, so no block stays behind on either side.

Selective disaggregation (`route.remote_prefill_min_tokens`): a request whose prompt, less what the chosen
decode worker holds in its prefix cache (pdlab.serve.mirror), is shorter than the threshold is prefilled by
that decode worker itself. A failed KV hand-over (`TransferFailed`, or no `Transferred` in time) follows the
deployment's `on_transfer_failure`: fail the request, or `Recompute` it on its decode worker. In push mode
the decode blocks are given back only after the prefill worker stopped writing into them (its `Aborted`,
its `PrefillDone`, its own `TransferFailed`, or its death): the *fence*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pdlab.constants import TRANSFER_FAILURE_POLICY, cdiv
from pdlab.serve import messages as m
from pdlab.serve.handover import HandOverFailures
from pdlab.serve.events import RequestDone, StepEvent, TokenEvent, TransferEvent, WorkerFailed
from pdlab.serve.mirror import PrefixMirror

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
    cache: PrefixMirror = field(default_factory=PrefixMirror)  # decode, selective routing: its prefix cache
    fingerprint: dict = field(default_factory=dict)  # disaggregated roles: what its KV blocks are (Ready)
    kernels: dict = field(default_factory=dict)  # CPU kernels its engine runs, and why (Ready)


@dataclass
class _Req:
    req_id: str
    prompt_ids: list[int]
    params: dict
    phases: dict
    prefill: Optional[str] = None
    decode: Optional[str] = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token: Optional[int] = None
    handoff_t: float = 0.0  # when the KV hand-over began (timeout clock)
    route: str = "remote"  # where its prompt is prefilled (constants.PREFILL_ROUTES)
    fencing: Optional[str] = None  # push: the hand-over failed for this reason; waiting for the prefill to stop
    cancelled: Optional[str] = None  # abort(): why the client gave it up; it ends once nothing writes for it


class Router(HandOverFailures):
    def __init__(self, sock: Any, workers: list[WorkerState], *, mode: str, first_token: str,
                 transfer_timeout_s: float, heartbeat_timeout_s: float, step_timeout_s: float,
                 on_transfer_failure: str = TRANSFER_FAILURE_POLICY, remote_prefill_min_tokens: int = 0):
        self.sock, self.mode, self.first_token = sock, mode, first_token
        self.on_failure, self.remote_min = on_transfer_failure, remote_prefill_min_tokens
        self.workers = {w.name: w for w in workers}
        self.transfer_timeout_s = transfer_timeout_s
        self.heartbeat_timeout_s, self.step_timeout_s = heartbeat_timeout_s, step_timeout_s
        self.reqs: dict[str, _Req] = {}
        self._renewed = 0.0  # push mode: when the decode leases of requests still in prefill were last renewed
        self.events: list[Any] = []
        self.stats: dict[str, m.Stats] = {}

    def _of(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role and w.failed is None]

    def send(self, worker: str, msg: Any) -> None:
        w = self.workers[worker]
        if w.failed is not None:
            return
        try:
            self.sock.send_multipart([worker.encode(), m.encode(msg)])
        except Exception:  # noqa: BLE001 - unreachable peer: the health check reports it
            pass

    def _give(self, req: _Req, worker: str, msg: Any) -> None:
        self.workers[worker].holds.add(req.req_id)
        self.send(worker, msg)

    # ---- placement ----
    def submit(self, req_id: str, prompt_ids: list[int], params: dict) -> None:
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} is already in flight")
        req = _Req(req_id, list(prompt_ids), dict(params), {"queued": time.monotonic()})
        self.reqs[req_id] = req
        unified = any(w.role == "unified" for w in self.workers.values())
        if unified:
            req.route = "unified"
        elif self.remote_min and self._prefill_locally(req):
            return
        if unified or self.mode == "pull":  # push reserves the decode blocks first (below)
            role = "unified" if unified else "prefill"
            w = self._least_loaded(role)
            if w is None:
                return self._done(req, False, f"no live {role} worker")
            req.prefill = w.name
            self._give(req, w.name, m.Submit(req_id, req.prompt_ids, req.params))
        else:  # push: the decode blocks are reserved first, so prefill knows where to write
            d = self._decode_with_room(req)
            if d is None:
                return self._done(req, False, "no live decode worker")
            req.decode = d.name
            self._give(req, d.name, m.Reserve(req_id, req.prompt_ids, req.params))

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        """End a request its client gave up on (a stop string matched, the client left, shutdown): every worker
        holding it lets go, and it is reported done (not ok, `reason`). In push mode, while its prefill worker
        may still be writing into the decode blocks, the decode side is told only after that worker stopped
        (the same fence as a failed hand-over, pdlab.serve.handover). Unknown or finished requests: nothing."""
        req = self.reqs.get(req_id)
        if req is None or req.cancelled is not None:
            return
        req.cancelled = reason
        if req.fencing is not None:
            return  # already waiting for the prefill worker to stop: _apply_policy ends it
        p = self.workers.get(req.prefill or "")
        if (self.mode == "push" and req.route == "remote" and req.decode is not None and p is not None
                and p.failed is None and req_id in p.holds and "prefill_end" not in req.phases):
            req.fencing = reason
            p.holds.discard(req_id)
            return self.send(p.name, m.Abort(req_id))
        self._done(req, False, reason)

    def _prefill_locally(self, req: _Req) -> bool:
        """Selective routing: a prompt with fewer uncached tokens than the threshold, after what the chosen
        decode worker (`_decode_for`) holds in its prefix cache, is prefilled by that decode worker."""
        d, cached = self._decode_for(req)
        if d is None or len(req.prompt_ids) - cached >= self.remote_min:
            return False
        req.prefill = req.decode = d.name
        req.route = "local"
        self._give(req, d.name, m.Submit(req.req_id, req.prompt_ids, req.params))
        return True

    def _decode_for(self, req: _Req) -> tuple[Optional[WorkerState], int]:
        """The decode worker for a request, and the prompt tokens it holds: the one that holds the most of the
        prompt in its prefix cache among those with room for the rest (prefix-aware, as llm-d scores its
        KV-cache events: a remote hand-over then moves fewer blocks, a selective local prefill computes fewer
        tokens), else the one with the most room. Without cache reports (one decode worker, no prefix
        cache) every mirror is empty and this is the most room."""
        best: Optional[tuple] = None
        for w in self._of("decode"):
            cached = w.cache.cached_tokens(req.prompt_ids, w.block_size)
            room = self._room(w, req)
            fits = room >= cdiv(len(req.prompt_ids) - cached, max(1, w.block_size))
            key = (fits, cached if fits else 0, room, -len(w.holds), w.name)
            if best is None or key > best[0]:
                best = (key, w, cached if fits else 0)
        return (None, 0) if best is None else (best[1], best[2])

    def _least_loaded(self, role: str) -> Optional[WorkerState]:
        ws = self._of(role)
        return min(ws, key=lambda w: (len(w.holds), w.name)) if ws else None

    def _room(self, w: WorkerState, req: _Req) -> int:
        """Free blocks of decode worker `w` less those promised to hand-overs not yet admitted there."""
        inflight = sum(self._blocks(self.reqs[r], w) for r in w.holds if r in self.reqs and r != req.req_id
                       and "admitted" not in self.reqs[r].phases and self.reqs[r].route == "remote")
        return w.free_blocks - inflight

    def _decode_with_room(self, req: _Req) -> Optional[WorkerState]:
        return self._decode_for(req)[0]

    @staticmethod
    def _blocks(req: _Req, w: WorkerState) -> int:
        return cdiv(len(req.prompt_ids), max(1, w.block_size))

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
            for rid, tok, index, finished in msg.items:
                req = self.reqs.get(rid)
                if req is None:
                    continue
                if index == 0:
                    req.phases.setdefault("sent", msg.t)
                req.output_ids.append(tok)
                self.events.append(TokenEvent(rid, tok, msg.t or now, index, finished, w.name, now))
        elif isinstance(msg, m.Step):
            w.free_blocks = msg.record["kv_blocks_total"] - msg.record["kv_blocks_used"]
            self.events.append(StepEvent(w.name, w.role, msg.record))
        elif isinstance(msg, m.Finished):
            self._finished(w, msg)
        elif isinstance(msg, m.PrefillDone):
            self._prefill_done(w, msg, now)
        elif isinstance(msg, m.Reserved):
            self._reserved(w, msg)
        elif isinstance(msg, m.Transferred):
            self._transferred(w, msg)
        elif isinstance(msg, m.TransferFailed):
            self._transfer_failed(w, msg)
        elif isinstance(msg, m.Aborted):
            self._aborted(msg)
        elif isinstance(msg, m.CacheEvents):
            w.cache.apply(msg.stored, msg.removed)
        elif isinstance(msg, m.Stats):
            self.stats[w.name] = msg
        elif isinstance(msg, m.Ready):
            w.ready, w.pool, w.kv_blocks, w.block_size = True, msg.pool, msg.kv_blocks, msg.block_size
            w.kernels = msg.kernels
            w.fingerprint = msg.fingerprint
            w.free_blocks, w.loop_t = msg.kv_blocks, now
        elif isinstance(msg, m.Fatal):
            self.fail_worker(w.name, msg.reason)

    def _finished(self, w: WorkerState, msg: m.Finished) -> None:
        w.holds.discard(msg.req_id)
        req = self.reqs.get(msg.req_id)
        if req is not None:
            req.cached_tokens = req.cached_tokens or msg.cached_tokens
            for k, v in msg.phases.items():
                if v:
                    req.phases.setdefault(k, v)
            self._done(req, msg.ok, msg.error)

    def _prefill_done(self, w: WorkerState, msg: m.PrefillDone, now: float) -> None:
        req = self.reqs.get(msg.req_id)
        if req is None:
            return self.send(w.name, m.Abort(msg.req_id))
        req.first_token, req.cached_tokens, req.handoff_t = msg.first_token, msg.cached_tokens, now
        req.phases.update(prefill_start=msg.prefill_start, prefill_end=msg.prefill_end)
        if self.first_token == "prefill":
            self._deliver_first(req, msg.prefill_end or now, w.name)
        if req.fencing is not None:  # push: the hand-over failed meanwhile; the prefill writes no more
            return self._apply_policy(req, req.fencing)
        if msg.transfer is not None:  # push: the KV is already in the decode pool
            self._transfer_record(req, msg.transfer)
            self.send(req.decode, m.Admit(req.req_id, msg.first_token, msg.written))
            return
        d = self._decode_with_room(req)
        if d is None:
            return self._done(req, False, "no live decode worker")
        req.decode = d.name
        self._give(req, d.name, m.Pull(req.req_id, req.prompt_ids, req.params, msg.first_token, w.name,
                                       w.pool or {}, msg.blocks))

    def _reserved(self, w: WorkerState, msg: m.Reserved) -> None:
        req = self.reqs.get(msg.req_id)
        if req is None:
            return self.send(w.name, m.Abort(msg.req_id))
        p = self._least_loaded("prefill")
        if p is None:
            return self._done(req, False, "no live prefill worker")
        req.prefill = p.name
        push = {"dst": w.name, "pool": w.pool or {}, "blocks": msg.blocks, "skip": msg.skip}
        self._give(req, p.name, m.Submit(req.req_id, req.prompt_ids, req.params, push))

    def _transferred(self, w: WorkerState, msg: m.Transferred) -> None:
        req = self.reqs.get(msg.req_id)
        if req is None:
            return self.send(w.name, m.Abort(msg.req_id))
        req.phases["admitted"] = msg.admitted
        if msg.record is not None:
            self._transfer_record(req, msg.record)
        if req.prefill is not None and req.req_id in self.workers[req.prefill].holds:
            self.workers[req.prefill].holds.discard(req.req_id)
            self.send(req.prefill, m.Release(req.req_id))

    def _deliver_first(self, req: _Req, t: float, worker: str) -> None:
        """first_token: prefill: the router delivers the prefill worker's first token (once)."""
        if req.output_ids or req.first_token is None:
            return
        req.phases["sent"] = t
        req.output_ids.append(req.first_token)
        self.events.append(TokenEvent(req.req_id, req.first_token, t, 0, False, worker, time.monotonic()))

    def _transfer_record(self, req: _Req, rec: dict) -> None:
        req.phases.update(transfer_start=rec["start"], transfer_end=rec["end"])
        self.events.append(TransferEvent(rec))

    def _done(self, req: _Req, ok: bool, error: str) -> None:
        """End a request: report it, and tell every worker still holding it to let go."""
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
        self._renew_leases(now)
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
        for req in list(self.reqs.values()):
            if req.handoff_t and "admitted" not in req.phases and now - req.handoff_t > self.transfer_timeout_s + 2:
                self._apply_policy(req, f"KV hand-over {req.prefill} -> {req.decode} did not finish "
                                        f"within {self.transfer_timeout_s:g}s")

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
                self._done(req, False, f"worker {name} failed: {reason}")
        w.holds.clear()
        for req in [r for r in self.reqs.values() if r.fencing is not None and r.prefill == name]:
            self._apply_policy(req, req.fencing)  # a dead prefill worker writes no more
