"""What a worker does with each message and each step's output, per role.

unified: add requests, stream tokens.
prefill: add requests; a request that sampled its first token is handed off (`PrefillDone`) and keeps its
  blocks until `Release`. In push mode each layer's KV goes to the decode pool during the last step.
decode: `Pull` (reserve, read the prefill pool, admit) or `Reserve` + `Admit` (push: the KV was written
  by the prefill worker); requests without room wait here until `transfer_timeout_s`. A pull's copy runs
  beside the loop (PullCopier) while the running requests keep decoding; the request is admitted when its
  KV has landed. Its blocks stay reserved until the copy ended, also if it was aborted or timed out.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pdlab.constants import cdiv
from pdlab.engine import RequestError, SamplingParams
from pdlab.kv.pull import PullCopier, PullJob
from pdlab.kv.push import PushCopier, PushJob
from pdlab.kv.modelled import modelled_copy
from pdlab.kv.transfer import TransferRecord, copy_blocks
from pdlab.serve import messages as m


class RoleHandler:
    def __init__(self, worker: Any):
        self.w, self.eng, self.role = worker, worker.engine, worker.role
        self.spec, self.transport = worker.spec, worker.transport
        self.seqs: dict[str, Any] = {}  # engine Sequence objects, for their timestamps
        self.push: dict[str, dict] = {}  # prefill, push mode: req -> decode blocks to write
        self.pending: list[tuple[Any, float]] = []  # decode: Pull/Reserve waiting for room
        self.reserved: dict[str, tuple[list[int], int]] = {}  # decode, push mode: req -> (blocks, skip)
        self.pulls: dict[str, tuple[m.Pull, int, int, PullJob]] = {}  # decode, pull: copies in flight
        self.dropped: set[str] = set()  # pulls aborted or timed out: cancel the reservation once copied
        self.copier: Optional[PushCopier] = None
        self.puller: Optional[PullCopier] = None  # decode: started at the first Pull
        timing = self.spec.model.timing  # a timed engine: hand-overs take the modelled transfer time
        copy = self.transport.copy if self.transport is not None else copy_blocks  # nixl: READ / WRITE
        self.copy_fn = copy if timing is None else modelled_copy(
            self.eng.block_bytes, self.eng.dims["layers"], timing.transfer_of(self.spec.transport or ""))
        self.pool = getattr(worker, "pool", self.eng.kv)  # a tensor-parallel group: every rank's shard
        # Rank 0's layer hook fires before the other ranks have necessarily written that layer; they have
        # written the layer before (its all-reduce is behind every rank), so a sharded push lags one layer.
        self.lag = 1 if getattr(self.pool, "tp", 1) > 1 else 0
        if self.role == "prefill" and self.spec.mode == "push":
            self.copier = PushCopier(self.pool, self.copy_fn)
            self.eng.layer_hook = self._layer_hook

    # ---- messages ----
    def handle(self, msg: Any) -> None:
        if isinstance(msg, m.Submit):
            try:
                self.eng.add(msg.req_id, msg.prompt_ids, SamplingParams(**msg.params))
            except (RequestError, TypeError) as e:
                return self._fail(msg.req_id, str(e))
            self.seqs[msg.req_id] = self.eng.sequence(msg.req_id)
            if msg.push:
                self.push[msg.req_id] = msg.push
        elif isinstance(msg, (m.Pull, m.Reserve)):
            self.pending.append((msg, time.monotonic()))
            self._reserve_pending()
        elif isinstance(msg, m.Admit):
            self._admit_pushed(msg)
        elif isinstance(msg, m.Release):
            if self.eng.sequence(msg.req_id) is not None:
                self.eng.release(msg.req_id)
            self._forget(msg.req_id)
        elif isinstance(msg, m.Abort):
            self.pending = [(p, t) for p, t in self.pending if p.req_id != msg.req_id]
            self.reserved.pop(msg.req_id, None)
            if msg.req_id in self.pulls:  # its copy may still write into its blocks: free them after it
                self.dropped.add(msg.req_id)
                self.puller.cancel(self.pulls[msg.req_id][3])
            else:
                self.eng.abort(msg.req_id)
            self._forget(msg.req_id)
        elif isinstance(msg, m.Query):
            self.w._send(self.w.stats(msg.token))
        elif isinstance(msg, m.ResetPrefixCache):
            self.eng.reset_prefix_cache()
        else:
            raise m.MessageError(f"{self.w.name}: unexpected {type(msg).__name__}")

    def _forget(self, req_id: str) -> None:
        self.seqs.pop(req_id, None)
        self.push.pop(req_id, None)

    def _fail(self, req_id: str, error: str) -> None:
        self._forget(req_id)
        self.w._send(m.Finished(self.w.name, req_id, False, error))

    # ---- decode: KV in ----
    def has_pending(self) -> bool:
        return bool(self.pending) or bool(self.pulls)

    def poll_pending(self) -> None:
        """Admit the pulls whose copy ended, then reserve blocks for waiting hand-overs."""
        if self.pulls:
            if not self.eng.has_work():
                self.puller.wait(0.002)  # nothing to step: do not spin on the core the copy runs on
            self._collect_pulls()
        self._reserve_pending()

    def _reserve_pending(self) -> None:
        """Try to reserve blocks for waiting hand-overs, oldest first; time out those that wait too long."""
        still = []
        for i, (msg, t0) in enumerate(self.pending):
            try:
                first = msg.first_token if isinstance(msg, m.Pull) else None  # push: given at Admit
                r = self.eng.reserve(msg.req_id, msg.prompt_ids, first, SamplingParams(**msg.params))
            except (RequestError, TypeError) as e:
                self._fail(msg.req_id, str(e))
                continue
            if r is None:
                if time.monotonic() - t0 > self.spec.transfer_timeout_s:
                    self._fail(msg.req_id, f"{self.w.name}: no KV room for {msg.req_id} within "
                                           f"{self.spec.transfer_timeout_s:g}s")
                else:
                    still.append((msg, t0))
                continue
            if isinstance(msg, m.Pull):
                self._pull(msg, r)
            else:
                self.reserved[msg.req_id] = (r.block_ids, r.cached_blocks)
                self.w._send(m.Reserved(self.w.name, msg.req_id, r.block_ids, r.cached_blocks))
        self.pending = still

    def _pull(self, msg: m.Pull, r: Any) -> None:
        skip = r.cached_blocks
        try:
            src = self.transport.open(msg.src_pool)
            if self.puller is None:
                self.puller = PullCopier(self.pool, self.copy_fn)
            job = self.puller.submit(msg.req_id, src, msg.src_blocks[skip:], r.block_ids[skip:])
        except Exception as e:  # noqa: BLE001 - the request fails, the worker keeps serving
            self.eng.cancel_reservation(msg.req_id)
            return self._fail(msg.req_id, f"{self.w.name}: KV pull from {msg.src} failed: {e}")
        self.pulls[msg.req_id] = (msg, skip, len(r.block_ids) - skip, job)

    def _collect_pulls(self) -> None:
        for job in self.puller.poll():
            msg, skip, blocks, _ = self.pulls.pop(job.req_id)
            if job.req_id in self.dropped:  # aborted or timed out: nobody waits for it any more
                self.dropped.discard(job.req_id)
                self.eng.cancel_reservation(job.req_id)
            elif job.error:
                self.eng.cancel_reservation(job.req_id)
                self._fail(job.req_id, f"{self.w.name}: KV pull from {msg.src} failed: {job.error}")
            else:
                rec = TransferRecord(job.req_id, job.bytes, blocks, job.start, job.end, self.transport.name, "pull",
                                     msg.src, self.w.name, skip * self.eng.block_bytes, job.busy,
                                     self.transport.path(msg.src_pool["name"]))
                self._start_decoding(job.req_id, msg.first_token, rec.to_dict())
        now = time.monotonic()
        for rid, (msg, _, _, job) in self.pulls.items():
            if rid not in self.dropped and now - job.submitted > self.spec.transfer_timeout_s:
                self.dropped.add(rid)  # its blocks stay reserved until the copy ends
                self.puller.cancel(job)
                self._fail(rid, f"{self.w.name}: KV pull of {rid} from {msg.src} did not finish within "
                                f"{self.spec.transfer_timeout_s:g}s")

    def _admit_pushed(self, msg: m.Admit) -> None:
        if msg.req_id not in self.reserved:
            return self._fail(msg.req_id, f"{self.w.name}: admit for {msg.req_id}, which holds no reservation")
        blocks, skip = self.reserved.pop(msg.req_id)
        self.transport.stage_in(blocks[skip:])
        self._start_decoding(msg.req_id, msg.first_token, None)

    def _start_decoding(self, req_id: str, first_token: int, record: Optional[dict]) -> None:
        self.eng.admit(req_id, first_token)
        self.w._send(m.Transferred(self.w.name, req_id, time.monotonic(), record))
        if self.spec.first_token == "decode":
            self.w._send(m.Tokens(self.w.name, [[req_id, first_token, 0, False]], time.monotonic()))

    # ---- prefill: KV out ----
    def _layer_hook(self, layer: int) -> None:
        if layer == 0:
            jobs = []
            nb = self.eng.config.block_size
            for rid, _, end in self.eng.step_requests():
                tgt, seq = self.push.get(rid), self.eng.sequence(rid)
                if tgt is None or end < seq.prompt_len:
                    continue  # not pushed, or its prompt is not complete after this step
                n, skip = cdiv(seq.prompt_len, nb), tgt["skip"]
                jobs.append(PushJob(rid, seq.block_table[skip:n], self.transport.open(tgt["pool"]),
                                    tgt["blocks"][skip:n]))
            self.copier.begin(jobs)
        if layer >= self.lag:
            self.copier.on_layer(layer - self.lag)

    def _handoff(self, req_id: str, jobs: dict[str, PushJob]) -> None:
        info, seq = self.eng.handoff(req_id), self.seqs.get(req_id)
        rec = None
        tgt = self.push.pop(req_id, None)
        if tgt is not None:
            job = jobs.get(req_id)
            if job is None or job.error:
                self.eng.release(req_id)
                return self._fail(req_id, f"{self.w.name}: KV push to {tgt['dst']} failed: "
                                          f"{job.error if job else 'not pushed'}")
            rec = TransferRecord(req_id, job.bytes, len(job.src_blocks), job.start, job.end, self.transport.name, "push",
                                 self.w.name, tgt["dst"], tgt["skip"] * self.eng.block_bytes, job.busy,
                                 self.transport.path(tgt["pool"]["name"])).to_dict()
        else:
            self.transport.stage_out(info.block_ids)  # host transport: D2H into this worker's mirror
        self.w._send(m.PrefillDone(self.w.name, req_id, info.first_token, info.block_ids,
                                   seq.num_cached if seq else 0, _t(seq, "t_first_scheduled"),
                                   _t(seq, "t_prefill_end"), rec))

    # ---- the step ----
    def step(self) -> None:
        out = self.eng.step()
        if self.copier is not None and self.lag:
            self.copier.on_layer(self.eng.dims["layers"] - 1)  # the forward is over on every rank
        jobs = {j.req_id: j for j in self.copier.finish(self.spec.transfer_timeout_s)} if self.copier else {}
        if out.record is not None:
            self.w.step_record(out.record)
        items, done = [], []
        for t in out.tokens:
            if t.error:
                done.append(m.Finished(self.w.name, t.req_id, False, t.error))
                self._forget(t.req_id)
            elif t.finish_reason == "handoff":
                self._handoff(t.req_id, jobs)
            else:
                items.append([t.req_id, t.token_id, t.num_output - 1, t.finished])
                if t.finished:
                    seq = self.seqs.get(t.req_id)
                    phases = {"prefill_start": _t(seq, "t_first_scheduled"), "prefill_end": _t(seq, "t_prefill_end")}
                    done.append(m.Finished(self.w.name, t.req_id, True, cached_tokens=t.cached_tokens,
                                           phases=phases if self.role != "decode" else {}))
                    self._forget(t.req_id)
        if items:  # stamped when sampled: the end of the step that produced them
            self.w._send(m.Tokens(self.w.name, items, out.record.end if out.record else time.monotonic()))
        for msg in done:
            self.w._send(msg)

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self.puller is not None:
            self.puller.close()


def _t(seq: Any, attr: str) -> float:
    v = getattr(seq, attr, None) if seq is not None else None
    return float(v) if v is not None else 0.0
