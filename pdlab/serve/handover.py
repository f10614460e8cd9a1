"""The router's part in a failed KV hand-over: the failure policy, the push fence, and push lease renewal.

A hand-over fails when its decode worker reports `TransferFailed` (its lease ran out, the copy failed, it
refused a bad notice), when the prefill worker's push failed, or when no `Transferred` came within
`transfer_timeout_s` (+2 s) of `PrefillDone`. The deployment's `on_transfer_failure` then decides:
`fail` ends the request with the reason (a failed miss); `recompute` releases the prefill worker's copy and
sends `Recompute` to the decode worker, which prefills the request itself (route `recompute`).

The fence (push mode): the prefill worker writes into the decode blocks while it computes; if the hand-over
failed before it finished, the decode blocks may be reused only once it stopped. The router aborts it and
waits for its `Aborted` (or its `PrefillDone`, its own `TransferFailed`, or its death) before acting.
"""

from __future__ import annotations

import time
from typing import Any

from pdlab.constants import HEARTBEAT_S
from pdlab.serve import messages as m


class HandOverFailures:
    """Mixed into Router: uses its reqs, workers, send, _give, _done, _deliver_first."""

    reqs: dict
    workers: dict
    mode: str
    first_token: str
    on_failure: str
    _renewed: float

    def _transfer_failed(self, w: Any, msg: m.TransferFailed) -> None:
        req = self.reqs.get(msg.req_id)
        if req is None:
            return self.send(w.name, m.Abort(msg.req_id))  # ended already: give its blocks back
        if msg.first_token is not None and req.first_token is None:
            req.first_token = msg.first_token
            if self.first_token == "prefill":
                self._deliver_first(req, time.monotonic(), w.name)
        p = req.prefill
        writing = (p is not None and req.req_id in self.workers[p].holds and "prefill_end" not in req.phases
                   and self.workers[p].failed is None)
        if w.role == "decode" and self.mode == "push" and writing:
            req.fencing = msg.reason  # the prefill worker may still write into the decode blocks: stop it first
            self.workers[p].holds.discard(req.req_id)
            return self.send(p, m.Abort(req.req_id))
        if w.role == "prefill":
            w.holds.discard(req.req_id)  # it released the request when its push failed
        self._apply_policy(req, msg.reason)

    def _apply_policy(self, req: Any, reason: str) -> None:
        """The hand-over failed and nothing writes into the decode blocks any more: fail, or recompute."""
        req.fencing, req.handoff_t = None, 0.0
        if req.cancelled is not None:  # its client gave it up (Router.abort): end it, do not recompute
            return self._done(req, False, req.cancelled)
        d = self.workers.get(req.decode or "")
        if self.on_failure != "recompute" or d is None or d.failed is not None:
            return self._done(req, False, f"KV hand-over failed: {reason}")
        p = self.workers.get(req.prefill or "")
        if p is not None and req.req_id in p.holds:  # its prefill blocks are of no use now
            p.holds.discard(req.req_id)
            self.send(p.name, m.Abort(req.req_id))
        req.route, req.prefill = "recompute", d.name
        req.phases["recompute"] = time.monotonic()
        self._give(req, d.name, m.Recompute(req.req_id, req.prompt_ids, req.params, req.first_token))

    def _aborted(self, msg: m.Aborted) -> None:
        req = self.reqs.get(msg.req_id)
        if req is not None and req.fencing is not None:
            self._apply_policy(req, req.fencing)

    def _renew_leases(self, now: float) -> None:
        """Push mode: a decode reservation's lease must not run out while its prefill worker, alive, is still
        computing the request (it may wait in that worker's queue); renew those, once per heartbeat period."""
        if self.mode != "push" or now - self._renewed < HEARTBEAT_S:
            return
        self._renewed = now
        for d in self._of("decode"):
            ids = [rid for rid in d.holds if (r := self.reqs.get(rid)) is not None and r.route == "remote"
                   and r.fencing is None and "prefill_end" not in r.phases and r.prefill is not None
                   and self.workers[r.prefill].failed is None and rid in self.workers[r.prefill].holds]
            if ids:
                self.send(d.name, m.Renew(ids))
