"""The engine: add requests, step, stream tokens. One engine, three roles (unified, prefill, decode)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pdlab.constants import ROLES, cdiv
from pdlab.engine.blocks import BlockManager
from pdlab.engine.config import EngineConfig, RequestError, SamplingParams
from pdlab.engine.host_malloc import tune_malloc
from pdlab.engine.model import model_dims
from pdlab.engine.pool_size import gpu_kv_budget, weight_bytes
from pdlab.engine.runner import ModelRunner
from pdlab.engine.sampler import make_generator, sample
from pdlab.engine.scheduler import Scheduler
from pdlab.engine.sequence import Sequence, Status
from pdlab.engine.tensor_parallel import OP_STEP, describe_step
from pdlab.engine.timed import StepCounts, StepTimeModel, TimedRunner, count_step

CPU_AUTO_KV_BYTES = 1 << 30  # "auto" on CPU: at most 1 GiB of pool per worker
@dataclass
class StepRecord:
    start: float  # time.monotonic()
    end: float
    prefill_tokens: int
    decode_seqs: int
    kv_blocks_used: int
    kv_blocks_total: int
    waiting: int
    running: int
    preempted: int
    forward_s: float  # time inside the model forward (the rest is engine overhead)
    # the rest of what the step computed (pdlab.engine.timed.StepCounts): what a timing profile's step model
    # reads, so `pdlab profile --check` can hold a profile against a run's own steps
    context_tokens: int = 0
    prefill_pairs: int = 0
    chunks: int = 0
    fresh_pairs: int = 0
    resumed_pairs: int = 0
    resumed_context: int = 0
    # the stepping thread's CPU time over the step (CPU workers that compute on one thread; else None): a step
    # whose wall time is well above it spent the rest waiting for its core, taken by another process (the
    # router, a client) or by its worker's other threads (a pull's copy)
    cpu_s: Optional[float] = None


@dataclass
class TokenOut:
    req_id: str
    token_id: Optional[int]  # None when the request failed
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | handoff | abort | error
    error: Optional[str] = None
    cached_tokens: int = 0
    num_output: int = 0


@dataclass
class StepOutput:
    record: Optional[StepRecord]  # None when nothing could run
    tokens: list[TokenOut] = field(default_factory=list)


@dataclass
class HandoffInfo:
    req_id: str
    prompt_ids: list[int]
    first_token: int
    block_ids: list[int]
    block_hashes: list[int]


@dataclass
class Reservation:
    req_id: str
    block_ids: list[int]  # the request's whole block table for its prompt
    cached_blocks: int  # leading blocks already holding this prompt's KV (prefix cache): skip them


class Engine:
    def __init__(self, model: Any, config: EngineConfig, role: str = "unified",
                 kv_alloc: Optional[Callable[[tuple, torch.dtype], torch.Tensor]] = None,
                 step_timing: Optional[StepTimeModel] = None, clock: Optional[Callable[[], float]] = None,
                 tp_channel: Any = None, memory_share: float = 1.0):
        """`step_timing`: a modelled timing (pdlab.engine.timed): the model is not run, each step takes the
        modelled time and samples deterministic tokens; `model` may then be a stand-in without weights.
        `clock`: the time source (default time.monotonic); a simulator passes a virtual clock, and a timed
        engine then advances it instead of sleeping. `tp_channel`: rank 0 of a tensor-parallel group
        (pdlab.engine.tensor_parallel.StepChannel): each step's batch goes to the other ranks first.
        `memory_share`: this worker's share of its GPU when several share it (pdlab.engine.pool_size)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.step_timing = step_timing
        self.memory_share = memory_share
        self.now: Callable[[], float] = clock or time.monotonic
        config.validate("engine")
        self.model, self.config, self.role = model, config, role
        dims = model_dims(model)
        self.dims = dims
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # a CPU step's thread time is its compute with one torch thread; with more (a worker on several cores) it
        # is one thread's, and with a modelled step or on a GPU it is not compute (it waits)
        self._cpu_timed = (self.device.type == "cpu" and step_timing is None and clock is None
                           and torch.get_num_threads() == 1)
        if self.device.type == "cpu" and step_timing is None:
            tune_malloc()  # activations stay on the heap between steps (pdlab.engine.host_malloc)
        self.max_model_len = config.max_model_len or dims["max_model_len"]
        self.eos_ids = set(dims["eos_token_ids"])
        num_blocks = config.kv_blocks if config.kv_blocks != "auto" else self._auto_blocks()
        shape = (dims["layers"], 2, num_blocks, config.block_size, dims["kv_heads"], dims["head_dim"])
        if step_timing is not None:  # nothing computes into the pool: one element per head slot will do
            shape = (dims["layers"], 2, num_blocks, config.block_size, 1, 1)
        # Written, not just allocated: untouched (lazily mapped) pages would fault on every first read
        # later, in the middle of serving. Zeros also keep masked-out padding free of NaNs.
        self.kv = kv_alloc(shape, self.dtype) if kv_alloc else torch.empty(shape, dtype=self.dtype, device=self.device)
        self.kv.zero_()
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.runner: Any = (ModelRunner(model, self.kv, config.block_size) if step_timing is None else
                            TimedRunner(step_timing, dims["layers"], dims["vocab_size"], self.eos_ids,
                                        wait=getattr(clock, "advance_to", None), kv=self.kv))
        self.tp_channel = tp_channel
        self.seqs: dict[str, Sequence] = {}
        self._current: list[tuple[str, int, int]] = []

    # ---- sizing ----
    @property
    def block_bytes(self) -> int:
        d = self.dims
        return d["layers"] * 2 * self.config.block_size * d["kv_heads"] * d["head_dim"] * self.dtype.itemsize

    def _auto_blocks(self) -> int:
        per_seq = cdiv(self.max_model_len, self.config.block_size)
        want = self.config.max_running * per_seq
        modelled_gb = getattr(self.step_timing, "kv_memory_gb", None)
        if modelled_gb:  # a timed engine sizes its pool as the modelled device would
            cap = int(modelled_gb * 1e9 * self.config.kv_memory_fraction)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            cap = gpu_kv_budget(free, total, self.config.kv_memory_fraction, self.memory_share,
                                weight_bytes(self.model))
        else:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            cap = min(int(avail * self.config.kv_memory_fraction), CPU_AUTO_KV_BYTES)
        return max(1, min(want, cap // self.block_bytes))

    # ---- requests ----
    def _validate(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if req_id in self.seqs:
            raise RequestError(f"request {req_id!r} already exists")
        if len(prompt_ids) == 0:
            raise RequestError(f"request {req_id!r}: empty prompt")
        params.validate()
        vocab = self.dims["vocab_size"]
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"request {req_id!r}: token id {bad} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"request {req_id!r}: prompt of {len(prompt_ids)} tokens does not fit the "
                               f"model's context of {self.max_model_len} tokens")
        need = cdiv(len(prompt_ids) + 1, self.config.block_size)
        if need > self.blocks.num_blocks:
            raise RequestError(f"request {req_id!r}: prompt of {len(prompt_ids)} tokens needs {need} KV blocks; "
                               f"the whole pool has {self.blocks.num_blocks}")

    def _new_seq(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self._validate(req_id, prompt_ids, params)
        seq = Sequence(req_id, list(prompt_ids), params, t_arrival=self.now())
        seq.generator = make_generator(params, self.device)
        return seq

    def add(self, req_id: str, prompt_ids: list[int], params: Optional[SamplingParams] = None,
            first_token: Optional[int] = None) -> None:
        """Queue a request. Raises RequestError (engine state unchanged) if it cannot be served.
        `first_token`: already sampled elsewhere (a prefill that was not handed over): the request is
        prefilled with it, as a preempted one is recomputed, and its next token is its second."""
        seq = self._new_seq(req_id, prompt_ids, params or SamplingParams())
        if first_token is not None:
            seq.output_ids.append(first_token)
        self.seqs[req_id] = seq
        self.scheduler.add(seq)

    def abort(self, req_id: str) -> bool:
        seq = self.seqs.get(req_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def sequence(self, req_id: str) -> Optional[Sequence]:
        return self.seqs.get(req_id)

    # ---- hooks ----
    @property
    def layer_hook(self) -> Optional[Callable[[int], None]]:
        return self.runner.layer_hook

    @layer_hook.setter
    def layer_hook(self, fn: Optional[Callable[[int], None]]) -> None:
        self.runner.layer_hook = fn

    def step_requests(self) -> list[tuple[str, int, int]]:
        """(req_id, first token, end token) computed by the step now running (for layer hooks)."""
        return self._current

    # ---- the step ----
    def step(self) -> StepOutput:
        start = self.now()
        cpu0 = time.thread_time() if self._cpu_timed else None
        batch = self.scheduler.schedule()
        outs: list[TokenOut] = []
        for seq in batch.failed:
            outs.append(self._fail(seq, f"request needs {self.blocks.blocks_needed(seq, seq.num_tokens)} KV "
                                        f"blocks; the pool has {self.blocks.num_blocks}"))
        if not batch.seqs:
            rec = None
            if batch.preempted or batch.failed:
                rec = self._record(start, self.now(), StepCounts(), len(batch.preempted), 0.0)
            return StepOutput(rec, outs)
        trio = list(zip(batch.seqs, batch.num_tokens, batch.decode))
        counts = count_step(trio)
        for s, n, d in trio:
            if s.t_first_scheduled is None:
                s.t_first_scheduled = start
        if self.runner.layer_hook is not None:
            self._current = [(s.req_id, s.num_computed, s.num_computed + n) for s, n, _ in trio]
        if self.step_timing is not None:
            t0 = self.now()
            logits = None
            forward_s = self.runner.run(trio, start) - t0  # the modelled forward: the wait
        else:
            if self.tp_channel is not None:
                self.tp_channel.send(OP_STEP, describe_step(batch.seqs, batch.num_tokens, batch.decode,
                                                            self.config.block_size))
            ids, pos, ctx, rows = self.runner.prepare(batch.seqs, batch.num_tokens, batch.decode)
            t0 = self.now()
            logits = self.runner.forward(ids, pos, ctx, rows)
            self.runner.sync()  # CUDA: the step's kernels have run before any time below is read
            forward_s = self.now() - t0
        self._current = []
        sampling = []
        bs, caching = self.config.block_size, self.config.prefix_caching
        for s, n, d in trio:
            s.num_computed += n
            if not d and s.t_prefill_end is None and s.num_computed >= s.prompt_len:
                s.t_prefill_end = self.now()
            if caching and s.num_computed // bs > len(s.block_hashes):
                self.blocks.register_full_blocks(s)
            if d or s.num_computed == s.num_tokens:
                sampling.append(s)
        if sampling:
            tokens = ([self.runner.token(s) for s in sampling] if logits is None else
                      sample(logits, [s.params for s in sampling], [s.generator for s in sampling]))
            for s, tok in zip(sampling, tokens):
                outs.append(self._append(s, tok))
        cpu_s = time.thread_time() - cpu0 if cpu0 is not None else None  # read within [start, end]: at most its wall
        end = self.now()
        return StepOutput(self._record(start, end, counts, len(batch.preempted), forward_s, cpu_s), outs)

    def _record(self, start: float, end: float, c: StepCounts, preempted: int, forward_s: float,
                cpu_s: Optional[float] = None) -> StepRecord:
        return StepRecord(start, end, c.prefill_tokens, c.decode_seqs, self.blocks.num_used, self.blocks.num_blocks,
                          len(self.scheduler.waiting), len(self.scheduler.running), preempted, forward_s,
                          c.context_tokens, c.prefill_pairs, c.chunks, c.fresh_pairs, c.resumed_pairs,
                          c.resumed_context, cpu_s)

    def _append(self, seq: Sequence, tok: int) -> TokenOut:
        seq.output_ids.append(tok)
        p = seq.params
        reason = None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        elif self.role == "prefill":
            reason = "handoff"
        out = TokenOut(seq.req_id, tok, reason is not None, reason, None, seq.num_cached, len(seq.output_ids))
        if reason == "handoff":
            self.scheduler.finish(seq)
            seq.status = Status.HANDOFF  # blocks held until release()
        elif reason is not None:
            self._finish(seq, reason)
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.step_timing is not None:
            self.runner.forget(seq.req_id)
        self.scheduler.finish(seq)
        self.blocks.release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.seqs.pop(seq.req_id, None)

    def _fail(self, seq: Sequence, error: str) -> TokenOut:
        self._finish(seq, "error")
        return TokenOut(seq.req_id, None, True, "error", f"request {seq.req_id!r}: {error}", seq.num_cached,
                        len(seq.output_ids))

    # ---- prefill role: hand the KV off ----
    def handoff(self, req_id: str) -> HandoffInfo:
        seq = self.seqs[req_id]
        assert seq.status == Status.HANDOFF, f"{req_id} is {seq.status.value}, not handed off"
        n = cdiv(seq.prompt_len, self.config.block_size)
        return HandoffInfo(req_id, seq.prompt_ids, seq.output_ids[0], seq.block_table[:n], list(seq.block_hashes))

    def release(self, req_id: str) -> None:
        """The decode side has the KV: free the blocks (they stay in the prefix cache)."""
        self._finish(self.seqs[req_id], "handoff")

    # ---- decode role: take KV in ----
    def reserve(self, req_id: str, prompt_ids: list[int], first_token: Optional[int] = None,
                params: Optional[SamplingParams] = None) -> Optional[Reservation]:
        """Hold blocks for a prompt whose KV will be written from outside; None if there is no room now.
        Blocks of a prefix this engine already holds are reused and need no transfer. The first token
        may be given here or, when the reservation precedes prefill (push mode), at admit()."""
        seq = self._new_seq(req_id, prompt_ids, params or SamplingParams())
        if first_token is not None:
            seq.output_ids.append(first_token)
        hits = self.blocks.match_prefix(seq.prompt_ids, seq.prompt_len)
        # Headroom: after this reservation every sequence held here (this one included) must still find a
        # block to grow into. A reservation's blocks cannot be preempted while its KV is in transit, so
        # reservations that took the last blocks could leave the running requests nowhere to go.
        reusable = sum(1 for b in hits if self.blocks.ref[b] == 0)  # cached, unreferenced: counted as free now
        free_after = self.blocks.num_free - reusable - (self.blocks.blocks_needed(seq, seq.prompt_len) - len(hits))
        if not self.blocks.can_allocate(seq, seq.prompt_len, hits) or free_after < len(self.seqs) + 1:
            return None
        self.blocks.take_prefix(seq, hits)
        self.blocks.allocate(seq, seq.prompt_len)
        seq.num_cached = len(hits) * self.config.block_size
        seq.status = Status.RESERVED
        self.seqs[req_id] = seq
        return Reservation(req_id, list(seq.block_table), len(hits))

    def admit(self, req_id: str, first_token: Optional[int] = None) -> None:
        """The reserved blocks now hold the prompt's KV: start decoding."""
        seq = self.seqs[req_id]
        assert seq.status == Status.RESERVED, f"{req_id} is {seq.status.value}, not reserved"
        if first_token is not None:
            seq.output_ids[:] = [first_token]
        assert seq.output_ids, f"{req_id}: admitted without its first token"
        seq.num_computed = seq.prompt_len
        seq.t_prefill_end = self.now()
        self.blocks.register_full_blocks(seq)
        self.scheduler.add(seq)

    def cancel_reservation(self, req_id: str) -> None:
        # Blocks that never received KV do not stay in the prefix cache: they have no key yet,
        # because keys are only set by register_full_blocks() at admit().
        self._finish(self.seqs[req_id], "abort")

    # ---- housekeeping ----
    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def check_idle(self) -> None:
        """Assert that no request is left and no block is held (leak check for tests and workers)."""
        assert not self.seqs, f"requests left: {list(self.seqs)[:8]}"
        self.blocks.check_idle()
