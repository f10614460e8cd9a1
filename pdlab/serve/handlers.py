"""What a worker does with each message and each step's output, per role.

unified: add requests, stream tokens.
prefill: add requests; a request that sampled its first token is handed off (`PrefillDone`) and keeps its
  blocks until `Release`. In push mode each layer's KV goes to the decode pool during the last step; a push
  that failed is reported as `TransferFailed`, and an aborted push is confirmed (`Aborted`): from then on
  nothing is written into the decode blocks reserved for it.
decode: KV in through pdlab.serve.intake (reservations with a lease, landing, failures); a `Submit` (selective
  routing) or a `Recompute` (failed hand-over) is prefilled here like a unified worker would. With selective
  routing it reports its prefix-cache changes (`CacheEvents`) so the router can mirror them.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pdlab.constants import cdiv
from pdlab.engine import RequestError, SamplingParams
from pdlab.kv.push import PushCopier, PushJob
from pdlab.kv.modelled import modelled_copy
from pdlab.kv.copy import copy_blocks
from pdlab.kv.transfer import TransferRecord
from pdlab.serve import messages as m


class RoleHandler:
    def __init__(self, worker: Any):
        self.w, self.eng, self.role = worker, worker.engine, worker.role
        self.spec, self.transport = worker.spec, worker.transport
        self.seqs: dict[str, Any] = {}  # engine Sequence objects, for their timestamps
        self.prefilled_here: set[str] = set()  # decode role: requests it prefilled itself
        self.push: dict[str, dict] = {}  # prefill, push mode: req -> decode blocks to write
        self.copier: Optional[PushCopier] = None
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
        self.intake = None
        if self.role == "decode":
            from pdlab.serve.intake import KvIntake

            self.intake = KvIntake(self)
            if self.spec.report_cache:
                self.eng.blocks.events = []

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
            if self.role == "decode":
                self.prefilled_here.add(msg.req_id)
        elif isinstance(msg, (m.Pull, m.Reserve)):
            self.intake.take(msg)
        elif isinstance(msg, m.Admit):
            self.intake.admit_pushed(msg)
        elif isinstance(msg, m.Recompute):
            self.intake.recompute(msg)
        elif isinstance(msg, m.Renew):
            self.intake.renew(msg.req_ids)
        elif isinstance(msg, m.Release):
            if self.eng.sequence(msg.req_id) is not None:
                self.eng.release(msg.req_id)
            self._forget(msg.req_id)
        elif isinstance(msg, m.Abort):
            if self.intake is None or not self.intake.abort(msg.req_id):
                self.eng.abort(msg.req_id)
            if msg.req_id in self.push:  # its push had not ended: confirm that nothing more is written
                self.w._send(m.Aborted(self.w.name, msg.req_id))
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
        self.prefilled_here.discard(req_id)

    def local(self, req_id: str) -> None:
        """Decode role: `req_id` was added to the engine to be prefilled here."""
        self.seqs[req_id] = self.eng.sequence(req_id)
        self.prefilled_here.add(req_id)

    def _fail(self, req_id: str, error: str) -> None:
        self._forget(req_id)
        self.w._send(m.Finished(self.w.name, req_id, False, error))

    # ---- decode: KV in (pdlab.serve.intake) ----
    def has_pending(self) -> bool:
        return self.intake is not None and self.intake.busy()

    def poll_pending(self) -> None:
        if self.intake is not None:
            self.intake.poll()
        self.flush_cache_events()

    def flush_cache_events(self) -> None:
        ev = self.eng.blocks.events
        if ev:
            last = dict((k, add) for add, k in ev)  # each key's final state: stored, or dropped
            stored, removed = [k for k, a in last.items() if a], [k for k, a in last.items() if not a]
            self.w._send(m.CacheEvents(self.w.name, stored, removed))
            ev.clear()

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
                self._forget(req_id)
                return self.w._send(m.TransferFailed(self.w.name, req_id, f"{self.w.name}: KV push to {tgt['dst']} "
                                                     f"failed: {job.error if job else 'not pushed'}", info.first_token))
            rec = TransferRecord(req_id, job.bytes, len(job.src_blocks), job.start, job.end, self.transport.name, "push",
                                 self.w.name, tgt["dst"], tgt["skip"] * self.eng.block_bytes, job.busy,
                                 self.transport.path(tgt["pool"]["name"])).to_dict()
        else:
            self.transport.stage_out(info.block_ids)  # host transport: D2H into this worker's mirror
        self.w._send(m.PrefillDone(self.w.name, req_id, info.first_token, info.block_ids,
                                   seq.num_cached if seq else 0, _t(seq, "t_first_scheduled"),
                                   _t(seq, "t_prefill_end"), rec, list(job.dst_blocks) if rec else []))

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
                    here = self.role != "decode" or t.req_id in self.prefilled_here
                    done.append(m.Finished(self.w.name, t.req_id, True, cached_tokens=t.cached_tokens,
                                           phases=phases if here else {}))
                    self._forget(t.req_id)
        if items:  # stamped when sampled: the end of the step that produced them
            self.w._send(m.Tokens(self.w.name, items, out.record.end if out.record else time.monotonic()))
        for msg in done:
            self.w._send(msg)
        self.flush_cache_events()

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self.intake is not None:
            self.intake.close()


def _t(seq: Any, attr: str) -> float:
    v = getattr(seq, attr, None) if seq is not None else None
    return float(v) if v is not None else 0.0
