"""The decode worker's half of a KV hand-over, one object per mode (`PullIntake`, `PushIntake`; the router's
half is pdlab.serve.handover, the prefill worker's pdlab.serve.sender): reserve blocks, receive the KV,
admit, or give the blocks back. RoleHandler calls `take`, `recompute`, `abort`, `poll` (and in push mode
`admit`, `renew`); the intake acts through the handler's public methods (send, fail, start_decoding,
track_local).

A `Pull` or `Reserve` waits here until the engine has room (up to `transfer_timeout_s`), then holds a
*lease*: its blocks, reserved until `transfer_timeout_s` later. In push mode the router renews the leases of
requests whose prefill worker is alive and still computing them (`Renew`), so time in the prefill's queue
does not count; once the prefill is done, the lease runs. Within the lease the KV must land: a pull's
copy ends (it runs beside the loop, PullCopier), or a push's `Admit` arrives. Either way the worker learns
it from one `Landing` notice, the one place every transport's hand-over ends (and where pdlab.kv.faults
injects its test faults). A notice is checked against the lease before anything is read from the blocks:
a notice for blocks other than those reserved is refused, a late one (the lease is gone) ignored.

When a hand-over fails (the lease runs out, the copy fails, the notice is refused) the worker reports
`TransferFailed` and the router decides (fail, or `Recompute` here). The blocks are given back only when
nothing can write into them any more: a pull's once its copy has ended; a push's once the router says so
(`Abort` or `Recompute`, sent after the prefill worker stopped writing). They never enter the prefix cache:
keys are set only at admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.engine import RequestError, SamplingParams
from pdlab.kv.faults import FaultInjector, Landing
from pdlab.kv.pull import PullCopier, PullJob
from pdlab.kv.transfer import TransferRecord
from pdlab.serve import messages as m


@dataclass
class Lease:
    msg: Any  # the Pull or Reserve that asked for it
    blocks: list[int]  # the request's whole block table for its prompt
    skip: int  # leading blocks already held (prefix cache): not transferred
    deadline: float  # time.monotonic() after which the hand-over has failed
    job: Optional[PullJob] = None  # pull: its copy
    copying: bool = False  # pull: the copy has not ended yet (its blocks may still be written)
    failed: bool = False  # the hand-over failed: the blocks wait to be given back
    then: Optional[m.Recompute] = None  # prefill the request here once the blocks are given back


class KvIntake:
    """What both modes share: waiting for room, leases, landing, failure, giving back, recomputing here."""

    def __init__(self, handler: Any):
        self.h, self.eng, self.spec, self.name = handler, handler.eng, handler.spec, handler.name
        self.pending: list[tuple[Any, float]] = []  # Pull/Reserve waiting for room, with when they came
        self.leases: dict[str, Lease] = {}
        self.faults = FaultInjector.from_env(self.spec.transfer_timeout_s)

    def busy(self) -> bool:
        """Work that needs the loop to go round at once (waiting for room; pull: a copy to collect). Leases
        and delayed notices only need a look now and then: the loop's idle wait (50 ms) is fine for them."""
        return bool(self.pending)

    # ---- router messages ----
    def take(self, msg: Any) -> None:
        self.pending.append((msg, time.monotonic()))
        self._reserve_pending()

    def abort(self, req_id: str) -> bool:
        """Drop what is held here for `req_id`; False when nothing is (the engine may still run it)."""
        self.pending = [(p, t) for p, t in self.pending if p.req_id != req_id]
        lease = self.leases.get(req_id)
        if lease is None:
            return False
        lease.then = None
        self._give_back(lease)
        return True

    def recompute(self, msg: m.Recompute) -> None:
        self.pending = [(p, t) for p, t in self.pending if p.req_id != msg.req_id]
        lease = self.leases.get(msg.req_id)
        if lease is None:
            return self._prefill_here(msg)
        lease.then = msg
        self._give_back(lease)

    # ---- the loop ----
    def poll(self) -> None:
        """Act on delayed notices, expire leases, reserve for waiting ones."""
        for landing in self.faults.due():
            self._land(landing)
        now = time.monotonic()
        for rid, lease in list(self.leases.items()):
            if not lease.failed and now > lease.deadline:
                self._failed(lease, f"{self.name}: KV hand-over of {rid} did not complete within "
                                    f"{self.spec.transfer_timeout_s:g}s (its lease ran out)")
        self._reserve_pending()

    def _reserve_pending(self) -> None:
        """Reserve blocks for waiting hand-overs, oldest first; fail those that waited too long for room."""
        still = []
        for msg, t0 in self.pending:
            try:
                first = msg.first_token if isinstance(msg, m.Pull) else None  # push: given at Admit
                r = self.eng.reserve(msg.req_id, msg.prompt_ids, first, SamplingParams(**msg.params))
            except (RequestError, TypeError) as e:
                self.h.fail(msg.req_id, str(e))
                continue
            if r is None:
                if time.monotonic() - t0 > self.spec.transfer_timeout_s:
                    self.h.fail(msg.req_id, f"{self.name}: no KV room for {msg.req_id} within "
                                            f"{self.spec.transfer_timeout_s:g}s")
                else:
                    still.append((msg, t0))
                continue
            lease = Lease(msg, r.block_ids, r.cached_blocks, time.monotonic() + self.spec.transfer_timeout_s)
            self.leases[msg.req_id] = lease
            self._reserved(lease)
        self.pending = still

    def _reserved(self, lease: Lease) -> None:
        """The blocks are held: get the KV into them (mode-specific)."""
        raise NotImplementedError

    # ---- landing, failure, giving back ----
    def _notice(self, landing: Landing) -> None:
        landing = self.faults.filter(landing)
        if landing is not None:
            self._land(landing)

    def _land(self, landing: Landing) -> None:
        lease = self.leases.get(landing.req_id)
        if lease is None or lease.failed:
            return  # late: the lease ran out (or the request ended) before it came
        want = tuple(lease.blocks[lease.skip:])
        if landing.blocks != want:
            return self._failed(lease, f"{self.name}: refused a bad hand-over notice for {landing.req_id}: it names "
                                       f"blocks {list(landing.blocks)[:8]}, the lease holds {list(want)[:8]}")
        del self.leases[landing.req_id]
        self._landed(landing)
        self.h.start_decoding(landing.req_id, landing.first_token, landing.record)

    def _landed(self, landing: Landing) -> None:
        """The KV is in the reserved blocks, checked: anything to do before decoding starts."""

    def _failed(self, lease: Lease, reason: str) -> None:
        lease.failed = True
        self._keep_or_give_back(lease)
        self.h.send(m.TransferFailed(self.name, lease.msg.req_id, reason))

    def _keep_or_give_back(self, lease: Lease) -> None:
        raise NotImplementedError

    def _give_back(self, lease: Lease) -> None:
        """Cancel the reservation (now: subclasses wait while something may still write into it)."""
        rid = lease.msg.req_id
        self.leases.pop(rid, None)
        if self.eng.sequence(rid) is not None:
            self.eng.cancel_reservation(rid)
        if lease.then is not None:
            self._prefill_here(lease.then)

    def _prefill_here(self, msg: m.Recompute) -> None:
        """The hand-over failed: prefill the request on this worker (keeping a first token already sampled)."""
        try:
            self.eng.add(msg.req_id, msg.prompt_ids, SamplingParams(**msg.params), first_token=msg.first_token)
        except (RequestError, TypeError) as e:
            return self.h.fail(msg.req_id, str(e))
        self.h.track_local(msg.req_id)
        if msg.first_token is not None and self.spec.first_token == "decode":
            self.h.send(m.Tokens(self.name, [[msg.req_id, msg.first_token, 0, False]], time.monotonic()))

    def close(self) -> None:
        pass


class PullIntake(KvIntake):
    """pull: this worker copies the KV out of the prefill worker's pool (beside its loop, PullCopier)."""

    def __init__(self, handler: Any):
        super().__init__(handler)
        self.transport = handler.transport
        self.puller: Optional[PullCopier] = None  # started at the first Pull

    def busy(self) -> bool:
        return super().busy() or (self.puller is not None and self.puller.busy)

    def poll(self) -> None:
        """Admit the pulls whose copy ended, then what both modes do."""
        if self.puller is not None and self.puller.busy:
            if not self.eng.has_work():
                self.puller.wait(0.002)  # nothing to step: do not spin on the core the copy runs on
            self._collect_pulls()
        super().poll()

    def _reserved(self, lease: Lease) -> None:
        msg, skip = lease.msg, lease.skip
        try:
            src = self.transport.open(msg.src_pool)
            if self.puller is None:
                self.puller = PullCopier(self.h.pool, self.h.copy_fn)  # a TP group: every rank's shard
            lease.job = self.puller.submit(msg.req_id, src, msg.src_blocks[skip:], lease.blocks[skip:])
            lease.copying = True
        except Exception as e:  # noqa: BLE001 - the request's hand-over fails, the worker keeps serving
            self._failed(lease, f"{self.name}: KV pull from {msg.src} failed: {e}")

    def _collect_pulls(self) -> None:
        for job in self.puller.poll():
            lease = self.leases.get(job.req_id)
            if lease is None or lease.job is not job:
                continue
            lease.copying = False
            msg = lease.msg
            if lease.failed:
                self._give_back(lease)
            elif job.error:
                self._failed(lease, f"{self.name}: KV pull from {msg.src} failed: {job.error}")
            else:
                rec = TransferRecord(job.req_id, job.bytes, len(job.dst_blocks), job.start, job.end,
                                     self.transport.name, "pull", msg.src, self.name,
                                     lease.skip * self.eng.block_bytes, job.busy,
                                     self.transport.path(msg.src_pool["name"]))
                self._notice(Landing(job.req_id, tuple(job.dst_blocks), msg.first_token, rec.to_dict()))

    def _keep_or_give_back(self, lease: Lease) -> None:
        if lease.copying:
            self.puller.cancel(lease.job)  # skipped if not started; the blocks wait for it to end
        else:
            self._give_back(lease)  # nothing writes into them any more

    def _give_back(self, lease: Lease) -> None:
        if lease.copying:  # the copy may still write into the blocks: once it ended (_collect_pulls)
            lease.failed = True
            self.puller.cancel(lease.job)
            return
        super()._give_back(lease)

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()


class PushIntake(KvIntake):
    """push: the prefill worker writes into the blocks reserved here; the router's `Admit` says it is done."""

    def _reserved(self, lease: Lease) -> None:
        self.h.send(m.Reserved(self.name, lease.msg.req_id, lease.blocks, lease.skip))

    def admit(self, msg: m.Admit) -> None:
        self._notice(Landing(msg.req_id, tuple(msg.written), msg.first_token))

    def renew(self, req_ids: list) -> None:
        deadline = time.monotonic() + self.spec.transfer_timeout_s
        for rid in req_ids:
            lease = self.leases.get(rid)
            if lease is not None and not lease.failed:
                lease.deadline = max(lease.deadline, deadline)

    def _landed(self, landing: Landing) -> None:
        self.h.transport.stage_in(landing.blocks)  # the prefill worker wrote our exchange area (host: the mirror)

    def _keep_or_give_back(self, lease: Lease) -> None:
        pass  # the blocks stay until the router's Abort or Recompute: the prefill worker may still write


INTAKES = {"pull": PullIntake, "push": PushIntake}
