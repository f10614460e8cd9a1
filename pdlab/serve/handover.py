"""The router's half of a KV hand-over, one object per mode (`PullHandOver`, `PushHandOver`), in the shape of
vLLM v1's KV connector: a scheduler-facing half here, worker-facing halves in the workers (pdlab.serve.sender
on a prefill worker, pdlab.serve.intake on a decode worker). The router gives it the requests it placed
remotely (`start`) and the hand-over messages (`reserved`, `prefill_done`, `transferred`, `transfer_failed`,
`aborted`); the hand-over acts through the router's public methods (send, give, end, deliver_first,
record_transfer, decode_for, least_loaded).

pull: the prefill worker gets the request; when its prefill is done the decode worker is chosen and pulls
  the KV (`Pull`), then reports `Transferred`; the prefill worker's copy is released.
push: the decode blocks are reserved first (`Reserve` / `Reserved`), then the prefill worker writes into them
  layer by layer while it computes; its `PrefillDone` carries the transfer and the decode worker is told
  to `Admit`. While the prefill is queued or running, the router renews the decode reservation's lease.

A hand-over fails when its decode worker reports `TransferFailed` (its lease ran out, the copy failed, it
refused a bad notice), when the prefill worker's push failed, or when no `Transferred` came within
`transfer_timeout_s` (+2 s) of `PrefillDone`. The deployment's `on_transfer_failure` then decides
(pdlab.serve.placement.after_failed_handover): fail the request with the reason, or send `Recompute` to its
decode worker, which prefills it itself (route `recompute`).

The fence (push): if the hand-over failed, or the client gave the request up, while the prefill worker may
still be writing into the decode blocks, those blocks may be reused only once it stopped. The request is
FENCED: the prefill worker is aborted, and the request acts on its failure or abort when that worker's
`Aborted` (or its `PrefillDone`, its own `TransferFailed`, or its death) says it stopped.
"""

from __future__ import annotations

import time
from typing import Any

from pdlab.constants import HEARTBEAT_S
from pdlab.serve import messages as m
from pdlab.serve.placement import after_failed_handover
from pdlab.serve.request import ReqState, Request


class HandOver:
    """What both modes share: admission, failures, the failure policy, the hand-over timeout."""

    mode = ""

    def __init__(self, router: Any, on_failure: str, transfer_timeout_s: float):
        self.r, self.on_failure, self.transfer_timeout_s = router, on_failure, transfer_timeout_s

    # ---- the request's way ----
    def start(self, req: Request, worker: str) -> None:
        """`req` goes remote: `worker` is where placement sends it first (pdlab.serve.placement.Arrival)."""
        raise NotImplementedError

    def reserved(self, w: Any, msg: m.Reserved) -> None:
        raise m.MessageError(f"{w.name}: Reserved in {self.mode} mode")

    def prefill_done(self, w: Any, msg: m.PrefillDone, now: float) -> None:
        req = self.r.reqs.get(msg.req_id)
        if req is None:
            return self.r.send(w.name, m.Abort(msg.req_id))
        req.first_token, req.cached_tokens, req.handoff_t = msg.first_token, msg.cached_tokens, now
        req.phases.update(prefill_start=msg.prefill_start, prefill_end=msg.prefill_end)
        if self.r.first_token == "prefill":
            self.r.deliver_first(req, msg.prefill_end or now, w.name)
        if req.state is ReqState.FENCED:  # push: the hand-over failed meanwhile; the prefill writes no more
            return self._apply_policy(req, req.reason)
        req.state = ReqState.TRANSFERRING
        self._send_kv(req, w, msg)

    def _send_kv(self, req: Request, w: Any, msg: m.PrefillDone) -> None:
        raise NotImplementedError

    def transferred(self, w: Any, msg: m.Transferred) -> None:
        req = self.r.reqs.get(msg.req_id)
        if req is None:
            return self.r.send(w.name, m.Abort(msg.req_id))
        req.state = ReqState.DECODING
        req.phases["admitted"] = msg.admitted
        if msg.record is not None:
            self.r.record_transfer(req, msg.record)
        p = self.r.workers.get(req.prefill or "")
        if p is not None and req.req_id in p.holds:
            p.holds.discard(req.req_id)
            self.r.send(p.name, m.Release(req.req_id))

    # ---- failures ----
    def transfer_failed(self, w: Any, msg: m.TransferFailed) -> None:
        req = self.r.reqs.get(msg.req_id)
        if req is None:
            return self.r.send(w.name, m.Abort(msg.req_id))  # ended already: give its blocks back
        if msg.first_token is not None and req.first_token is None:
            req.first_token = msg.first_token
            if self.r.first_token == "prefill":
                self.r.deliver_first(req, time.monotonic(), w.name)
        if w.role == "decode" and self.fence(req, msg.reason):
            return
        if w.role == "prefill":
            w.holds.discard(req.req_id)  # it released the request when its push failed
        self._apply_policy(req, msg.reason)

    def fence(self, req: Request, reason: str) -> bool:
        """Push: if the prefill worker may still be writing into `req`'s decode blocks, stop it and wait for it
        (True: `req` is FENCED). Pull: nothing writes into another worker's blocks (False)."""
        return False

    def aborted(self, msg: m.Aborted) -> None:
        req = self.r.reqs.get(msg.req_id)
        if req is not None and req.state is ReqState.FENCED:
            self._apply_policy(req, req.reason)

    def worker_failed(self, name: str) -> None:
        """A dead prefill worker writes no more: its fenced requests go on."""
        for req in [r for r in self.r.reqs.values() if r.state is ReqState.FENCED and r.prefill == name]:
            self._apply_policy(req, req.reason)

    def renew_leases(self, now: float) -> None:
        """Push only (PushHandOver)."""

    def expire(self, now: float) -> None:
        """Hand-overs that did not end within the timeout (+2 s: the decode worker's own lease goes first)."""
        for req in list(self.r.reqs.values()):
            if req.state is ReqState.TRANSFERRING and now - req.handoff_t > self.transfer_timeout_s + 2:
                self._apply_policy(req, f"KV hand-over {req.prefill} -> {req.decode} did not finish "
                                        f"within {self.transfer_timeout_s:g}s")

    def _apply_policy(self, req: Request, reason: str) -> None:
        """The hand-over failed and nothing writes into the decode blocks any more: fail, or recompute."""
        req.reason, req.handoff_t = None, 0.0
        if req.cancelled is not None:  # its client gave it up (Router.abort): end it, do not recompute
            return self.r.end(req, False, req.cancelled)
        d = self.r.workers.get(req.decode or "")
        if after_failed_handover(self.on_failure, d is not None and d.failed is None) == "fail":
            return self.r.end(req, False, f"KV hand-over failed: {reason}")
        p = self.r.workers.get(req.prefill or "")
        if p is not None and req.req_id in p.holds:  # its prefill blocks are of no use now
            p.holds.discard(req.req_id)
            self.r.send(p.name, m.Abort(req.req_id))
        req.route, req.prefill, req.state = "recompute", d.name, ReqState.PREFILLING
        req.phases["recompute"] = time.monotonic()
        self.r.give(req, d.name, m.Recompute(req.req_id, req.prompt_ids, req.params, req.first_token))


class PullHandOver(HandOver):
    mode = "pull"

    def start(self, req: Request, worker: str) -> None:
        req.prefill, req.state = worker, ReqState.PREFILLING
        self.r.give(req, worker, m.Submit(req.req_id, req.prompt_ids, req.params))

    def _send_kv(self, req: Request, w: Any, msg: m.PrefillDone) -> None:
        choice = self.r.decode_for(req)
        if choice is None:
            return self.r.end(req, False, "no live decode worker")
        req.decode = choice.worker.name
        self.r.give(req, req.decode, m.Pull(req.req_id, req.prompt_ids, req.params, msg.first_token, w.name,
                                            w.pool or {}, msg.blocks))


class PushHandOver(HandOver):
    mode = "push"

    def __init__(self, router: Any, on_failure: str, transfer_timeout_s: float):
        super().__init__(router, on_failure, transfer_timeout_s)
        self._renewed = 0.0  # when the leases of requests still in prefill were last renewed

    def start(self, req: Request, worker: str) -> None:
        req.decode, req.state = worker, ReqState.QUEUED  # its blocks first, so the prefill knows where to write
        self.r.give(req, worker, m.Reserve(req.req_id, req.prompt_ids, req.params))

    def reserved(self, w: Any, msg: m.Reserved) -> None:
        req = self.r.reqs.get(msg.req_id)
        if req is None:
            return self.r.send(w.name, m.Abort(msg.req_id))
        p = self.r.least_loaded("prefill")
        if p is None:
            return self.r.end(req, False, "no live prefill worker")
        req.prefill, req.state = p, ReqState.PREFILLING
        push = {"dst": w.name, "pool": w.pool or {}, "blocks": msg.blocks, "skip": msg.skip}
        self.r.give(req, p, m.Submit(req.req_id, req.prompt_ids, req.params, push))

    def _send_kv(self, req: Request, w: Any, msg: m.PrefillDone) -> None:
        if msg.transfer is None:  # every push-mode prefill has a target: its worker pushed nothing
            return self._apply_policy(req, f"{w.name} reported {req.req_id} prefilled without pushing its KV")
        self.r.record_transfer(req, msg.transfer)  # the KV is already in the decode pool
        self.r.send(req.decode, m.Admit(req.req_id, msg.first_token, msg.written))

    def fence(self, req: Request, reason: str) -> bool:
        p = self.r.workers.get(req.prefill or "")
        if not req.remote_prefilling or p is None or p.failed is not None or req.req_id not in p.holds:
            return False
        req.state, req.reason = ReqState.FENCED, reason
        p.holds.discard(req.req_id)
        self.r.send(p.name, m.Abort(req.req_id))
        return True

    def renew_leases(self, now: float) -> None:
        """A decode reservation's lease must not run out while its prefill worker, alive, is still computing
        the request (it may wait in that worker's queue); renew those, once per heartbeat period."""
        if now - self._renewed < HEARTBEAT_S:
            return
        self._renewed = now
        for d in self.r.live("decode"):
            ids = [rid for rid in d.holds if (r := self.r.reqs.get(rid)) is not None and r.remote_prefilling
                   and self.r.workers[r.prefill].failed is None and rid in self.r.workers[r.prefill].holds]
            if ids:
                self.r.send(d.name, m.Renew(ids))


HANDOVERS = {"pull": PullHandOver, "push": PushHandOver}
