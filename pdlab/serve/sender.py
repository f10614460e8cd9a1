"""The prefill worker's half of a KV hand-over, one object per mode (`PullSender`, `PushSender`); the router's
half is pdlab.serve.handover, the decode worker's pdlab.serve.intake. RoleHandler calls it: `take` when a
request arrives (push: with the decode blocks to write), `step_ended` after each engine step, `handoff`
for each request whose prefill ended there, `abort` when the router gives a request up.

pull: a handed-off request keeps its blocks until the router's `Release` (the decode worker copies them);
  the host transport first stages them out of the private pool into the mirror its peers read.
push: each layer's KV of the requests whose prompt completes in a step is written into the decode blocks
  while the step runs (a layer hook, PushCopier); the `PrefillDone` carries the transfer record and the
  blocks written. A push that failed is reported as `TransferFailed` (with the sampled first token) and the
  request released; an aborted push is confirmed with `Aborted`: nothing more is written for it.
"""

from __future__ import annotations

from typing import Any, Optional

from pdlab.constants import cdiv
from pdlab.kv.push import PushCopier, PushJob
from pdlab.kv.transfer import TransferRecord
from pdlab.serve import messages as m


def seq_time(seq: Any, attr: str) -> float:
    """A timestamp of an engine Sequence (t_first_scheduled, t_prefill_end), 0.0 when unknown."""
    v = getattr(seq, attr, None) if seq is not None else None
    return float(v) if v is not None else 0.0


class PullSender:
    def __init__(self, handler: Any):
        self.h, self.eng, self.transport = handler, handler.eng, handler.transport

    def take(self, req_id: str, target: Optional[dict]) -> None:
        if target is not None:
            raise m.MessageError(f"{self.h.name}: a push target for {req_id} in pull mode")

    def step_ended(self) -> dict[str, PushJob]:
        return {}

    def handoff(self, req_id: str, seq: Any, jobs: dict[str, PushJob]) -> None:
        info = self.eng.handoff(req_id)
        self.transport.stage_out(info.block_ids)  # host transport: D2H into this worker's mirror
        self.h.send(m.PrefillDone(self.h.name, req_id, info.first_token, info.block_ids,
                                  seq.num_cached if seq else 0, seq_time(seq, "t_first_scheduled"),
                                  seq_time(seq, "t_prefill_end")))

    def abort(self, req_id: str) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class PushSender:
    def __init__(self, handler: Any):
        self.h, self.eng, self.transport = handler, handler.eng, handler.transport
        self.targets: dict[str, dict] = {}  # req -> the decode blocks to write
        self.copier = PushCopier(handler.pool, handler.copy_fn)
        # Rank 0's layer hook fires before the other ranks have necessarily written that layer; they have
        # written the layer before (its all-reduce is behind every rank), so a sharded push lags one layer.
        self.lag = 1 if getattr(handler.pool, "tp", 1) > 1 else 0
        self.eng.layer_hook = self._layer_hook

    def take(self, req_id: str, target: Optional[dict]) -> None:
        if target is None:
            raise m.MessageError(f"{self.h.name}: no push target for {req_id} in push mode")
        self.targets[req_id] = target

    def _layer_hook(self, layer: int) -> None:
        if layer == 0:
            jobs = []
            nb = self.eng.config.block_size
            for rid, _, end in self.eng.step_requests():
                tgt, seq = self.targets.get(rid), self.eng.sequence(rid)
                if tgt is None or end < seq.prompt_len:
                    continue  # not pushed, or its prompt is not complete after this step
                n, skip = cdiv(seq.prompt_len, nb), tgt["skip"]
                jobs.append(PushJob(rid, seq.block_table[skip:n], self.transport.open(tgt["pool"]),
                                    tgt["blocks"][skip:n]))
            self.copier.begin(jobs)
        if layer >= self.lag:
            self.copier.on_layer(layer - self.lag)

    def step_ended(self) -> dict[str, PushJob]:
        """The step's pushes, finished (each with its error, if any)."""
        if self.lag:
            self.copier.on_layer(self.eng.dims["layers"] - 1)  # the forward is over on every rank
        return {j.req_id: j for j in self.copier.finish(self.h.spec.transfer_timeout_s)}

    def handoff(self, req_id: str, seq: Any, jobs: dict[str, PushJob]) -> None:
        info = self.eng.handoff(req_id)
        tgt = self.targets.pop(req_id, None)
        job = jobs.get(req_id)
        if tgt is None or job is None or job.error:
            self.eng.release(req_id)
            self.h.forget(req_id)
            dst = tgt["dst"] if tgt else "its decode worker"
            return self.h.send(m.TransferFailed(self.h.name, req_id, f"{self.h.name}: KV push to {dst} failed: "
                                                f"{job.error if job else 'not pushed'}", info.first_token))
        rec = TransferRecord(req_id, job.bytes, len(job.src_blocks), job.start, job.end, self.transport.name, "push",
                             self.h.name, tgt["dst"], tgt["skip"] * self.eng.block_bytes, job.busy,
                             self.transport.path(tgt["pool"]["name"])).to_dict()
        self.h.send(m.PrefillDone(self.h.name, req_id, info.first_token, info.block_ids,
                                  seq.num_cached if seq else 0, seq_time(seq, "t_first_scheduled"),
                                  seq_time(seq, "t_prefill_end"), rec, list(job.dst_blocks)))

    def abort(self, req_id: str) -> None:
        """The router gave `req_id` up: if its push had not ended, confirm that nothing more is written."""
        if self.targets.pop(req_id, None) is not None:
            self.h.send(m.Aborted(self.h.name, req_id))

    def forget(self, req_id: str) -> None:
        self.targets.pop(req_id, None)

    def close(self) -> None:
        self.copier.close()


SENDERS = {"pull": PullSender, "push": PushSender}
