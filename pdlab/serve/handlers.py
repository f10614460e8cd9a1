"""What a worker does with each message and each step's output, per role.

unified: add requests, stream tokens.
prefill: add requests; a request that sampled its first token is handed off by the worker's half of the
  hand-over protocol (pdlab.serve.sender: pull or push).
decode: KV in through its half of the hand-over protocol (pdlab.serve.intake: reservations with a lease,
  landing, failures); a `Submit` (selective routing) or a `Recompute` (failed hand-over) is prefilled here like
  a unified worker would. With selective routing it reports its prefix-cache changes (`CacheEvents`) so the
  router can mirror them.

The hand-over halves call back through the public methods here: send, fail, forget, start_decoding,
track_local.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pdlab.engine import RequestError, SamplingParams
from pdlab.kv.copy import copy_blocks
from pdlab.kv.modelled import modelled_copy
from pdlab.serve import messages as m
from pdlab.serve.intake import INTAKES, PushIntake
from pdlab.serve.sender import SENDERS, seq_time


class RoleHandler:
    def __init__(self, worker: Any):
        self.w, self.eng, self.role, self.name = worker, worker.engine, worker.role, worker.name
        self.spec, self.transport = worker.spec, worker.transport
        self.seqs: dict[str, Any] = {}  # engine Sequence objects, for their timestamps
        self.local: set[str] = set()  # decode role: requests it prefilled itself
        timing = self.spec.model.timing  # a timed engine: hand-overs take the modelled transfer time
        copy = self.transport.copy if self.transport is not None else copy_blocks  # nixl: READ / WRITE
        self.copy_fn = copy if timing is None else modelled_copy(
            self.eng.block_bytes, self.eng.dims["layers"], timing.transfer_of(self.spec.transport or ""))
        self.pool = getattr(worker, "pool", self.eng.kv)  # a tensor-parallel group: every rank's shard
        self.sender = SENDERS[self.spec.mode](self) if self.role == "prefill" else None
        self.intake = INTAKES[self.spec.mode](self) if self.role == "decode" else None
        if self.intake is not None and self.spec.report_cache:
            self.eng.blocks.events = []

    # ---- messages ----
    def handle(self, msg: Any) -> None:
        if isinstance(msg, m.Submit):
            try:
                self.eng.add(msg.req_id, msg.prompt_ids, SamplingParams(**msg.params))
            except (RequestError, TypeError) as e:
                return self.fail(msg.req_id, str(e))
            self.seqs[msg.req_id] = self.eng.sequence(msg.req_id)
            if self.sender is not None:
                self.sender.take(msg.req_id, msg.push)
            if self.role == "decode":
                self.local.add(msg.req_id)
        elif isinstance(msg, (m.Pull, m.Reserve)):
            self._intake(msg).take(msg)
        elif isinstance(msg, m.Admit):
            self._intake(msg, push=True).admit(msg)
        elif isinstance(msg, m.Renew):
            self._intake(msg, push=True).renew(msg.req_ids)
        elif isinstance(msg, m.Recompute):
            self._intake(msg).recompute(msg)
        elif isinstance(msg, m.Release):
            if self.eng.sequence(msg.req_id) is not None:
                self.eng.release(msg.req_id)
            self.forget(msg.req_id)
        elif isinstance(msg, m.Abort):
            if self.intake is None or not self.intake.abort(msg.req_id):
                self.eng.abort(msg.req_id)
            if self.sender is not None:
                self.sender.abort(msg.req_id)
            self.forget(msg.req_id)
        elif isinstance(msg, m.Query):
            self.send(self.w.stats(msg.token))
        elif isinstance(msg, m.ResetPrefixCache):
            self.eng.reset_prefix_cache()
        else:
            raise m.MessageError(f"{self.name}: unexpected {type(msg).__name__}")

    def _intake(self, msg: Any, push: bool = False) -> Any:
        if self.intake is None or (push and not isinstance(self.intake, PushIntake)):
            raise m.MessageError(f"{self.name} ({self.role}, {self.spec.mode}): unexpected {type(msg).__name__}")
        return self.intake

    # ---- what the hand-over halves call ----
    def send(self, msg: Any) -> None:
        self.w.send(msg)

    def forget(self, req_id: str) -> None:
        self.seqs.pop(req_id, None)
        self.local.discard(req_id)
        if self.sender is not None:
            self.sender.forget(req_id)

    def track_local(self, req_id: str) -> None:
        """Decode role: `req_id` was added to the engine to be prefilled here."""
        self.seqs[req_id] = self.eng.sequence(req_id)
        self.local.add(req_id)

    def fail(self, req_id: str, error: str) -> None:
        self.forget(req_id)
        self.send(m.Finished(self.name, req_id, False, error))

    def start_decoding(self, req_id: str, first_token: int, record: Optional[dict]) -> None:
        """Decode role: the request's KV landed in its reserved blocks."""
        self.eng.admit(req_id, first_token)
        self.send(m.Transferred(self.name, req_id, time.monotonic(), record))
        if self.spec.first_token == "decode":
            self.send(m.Tokens(self.name, [[req_id, first_token, 0, False]], time.monotonic()))

    # ---- the loop ----
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
            self.send(m.CacheEvents(self.name, stored, removed))
            ev.clear()

    def step(self) -> None:
        out = self.eng.step()
        jobs = self.sender.step_ended() if self.sender is not None else {}
        if out.record is not None:
            self.w.step_record(out.record)
        items, done = [], []
        for t in out.tokens:
            if t.error:
                done.append(m.Finished(self.name, t.req_id, False, t.error))
                self.forget(t.req_id)
            elif t.finish_reason == "handoff":
                self.sender.handoff(t.req_id, self.seqs.get(t.req_id), jobs)
            else:
                items.append([t.req_id, t.token_id, t.num_output - 1, t.finished])
                if t.finished:
                    seq = self.seqs.get(t.req_id)
                    phases = {"prefill_start": seq_time(seq, "t_first_scheduled"), "prefill_end": seq_time(seq, "t_prefill_end")}
                    here = self.role != "decode" or t.req_id in self.local
                    done.append(m.Finished(self.name, t.req_id, True, cached_tokens=t.cached_tokens,
                                           phases=phases if here else {}))
                    self.forget(t.req_id)
        if items:  # stamped when sampled: the end of the step that produced them
            self.send(m.Tokens(self.name, items, out.record.end if out.record else time.monotonic()))
        self.flush_cache_events()  # before Finished: the router knows what is cached once a request ends
        for msg in done:
            self.send(msg)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.intake is not None:
            self.intake.close()
