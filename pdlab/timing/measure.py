"""Measuring the real engine's steps in this process, for the step model, and the KV transports.

A designed set of *cases*, each a fresh engine (prefix cache off) given some work and stepped:

- prefill: one prompt chunked on a token budget (chunks of that size at starting contexts 0, B, 2B, ...),
  or several short prompts in one step; max_tokens 1, so every step is prefill-only;
- decode: N requests already decoding at contexts around C (their KV placed as a decode worker's is after
  a hand-over: `Engine.reserve` + `admit`, the blocks filled with random values), stepped DECODE_LEAD times
  unrecorded, then a few times recorded;
- mixed: decoders as above plus a prompt prefilled on a token budget next to them, until its prefill ends.

Every step is recorded with the counts `pdlab.engine.timed.step_counts` gives for its scheduled batch
(observed by wrapping the engine's `scheduler.schedule` on the instance: the batch is read, not changed)
and its time, StepRecord end - start. On CUDA the device is synchronised before each step and after it,
and the step's time runs to that second synchronisation: a step that samples nothing would otherwise
return before its kernels finish. Cases run in a shuffled order, after a warm-up of each kind.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pdlab.constants import cdiv
from pdlab.engine.timed import StepCounts
from pdlab.timing.fit import StepSample, fit_transfer

BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Decode steps a decode case takes before it records any. The first steps of a new batch ran 10-16% slower
# than the same batch's later ones (cpu-demo on an AVX-512 Xeon, batches of 1-8, primer or not: settling
# after about 8), while a run's decode steps are mostly a batch's later ones; recording the first few biased
# the profile's decode figures that much high (runs' decode steps at x0.82-0.95 of the model).
DECODE_LEAD = 8


@dataclass(frozen=True)
class Limits:
    """The space the design covers on this device."""

    max_context: int  # longest prompt / decode context
    max_batch: int  # most decode sequences in a step
    max_decode_tokens: int  # most context tokens over a decode case's sequences (pool size, fill time)
    budgets: tuple[int, ...]  # token budgets (chunk sizes) tried

    @classmethod
    def for_device(cls, device_type: str, max_model_len: int) -> "Limits":
        if device_type == "cuda":
            return cls(max(64, min(max_model_len - 64, 16384)), 256, 1 << 19,
                       (64, 128, 256, 512, 1024, 2048, 4096, 8192))
        return cls(max(64, min(max_model_len - 64, 3072)), 64, 1 << 15, (32, 64, 128, 256, 512, 1024, 2048))


@dataclass(frozen=True)
class Case:
    kind: str  # prefill | decode | mixed: what the case is designed to produce
    budget: int
    chunked: bool
    prompts: tuple[int, ...]  # lengths of prompts to prefill
    decoders: tuple[int, ...]  # contexts of requests decoding from the start
    steps: int  # most steps to record

    @property
    def lead(self) -> int:
        """Steps taken before the first recorded one (DECODE_LEAD for a decode case)."""
        return DECODE_LEAD if self.kind == "decode" else 0

    def blocks(self, block_size: int = 16) -> int:
        """KV blocks the case's requests hold at most."""
        return sum(cdiv(c + self.lead + self.steps + 4, block_size) for c in self.decoders) + \
            sum(cdiv(n + 4, block_size) for n in self.prompts)

    @property
    def expected_steps(self) -> int:
        if self.kind == "decode":
            return self.steps
        return min(self.steps, cdiv(sum(self.prompts), max(1, self.budget - len(self.decoders))))


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> int:
    lo, hi = max(1.0, lo), max(1.0, lo, hi)
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _decoders(rng: np.random.Generator, lim: Limits, most: int) -> tuple[int, ...]:
    n = int(rng.choice([b for b in BATCHES if b <= max(1, most)]))
    c = min(_loguniform(rng, 16, lim.max_context), lim.max_decode_tokens // n)
    ctx = np.clip(np.round(c * rng.uniform(0.5, 1.5, size=n)), 8, lim.max_context)
    return tuple(int(x) for x in ctx)


def design(n_steps: int, lim: Limits, rng: np.random.Generator) -> list[Case]:
    """Cases until about `n_steps` steps are expected, about 35% prefill, 30% decode, 35% mixed by steps,
    and at least two cases of each kind (one to train on, one held out); in a shuffled order."""
    cases: list[Case] = []
    share = {"prefill": 0.35, "decode": 0.30, "mixed": 0.35}
    got = {k: 0 for k in share}
    while sum(got.values()) < n_steps or min(sum(c.kind == k for c in cases) for k in share) < 2:
        kind = min(share, key=lambda k: (sum(c.kind == k for c in cases) >= 2, got[k] / share[k]))
        if kind == "prefill":
            b = int(rng.choice(lim.budgets))
            if rng.random() < 0.3:  # several prompts in one step
                k = int(rng.integers(2, 5))
                prompts = tuple(min(lim.max_context, _loguniform(rng, 8, max(16, b // k))) for _ in range(k))
                case = Case(kind, b, bool(rng.random() < 0.5), prompts, (), 16)
            else:
                prompt = min(lim.max_context, _loguniform(rng, min(16, b), min(lim.max_context, 8 * b)))
                case = Case(kind, b, True, (prompt,), (), 16)
        elif kind == "decode":
            dec = _decoders(rng, lim, lim.max_batch)
            case = Case(kind, max(64, len(dec)), True, (), dec, int(rng.integers(3, 8)))
        else:
            b = int(rng.choice([x for x in lim.budgets if x >= 128] or [max(lim.budgets)]))
            dec = _decoders(rng, lim, min(lim.max_batch, b // 2))
            chunked = bool(rng.random() < 0.8)
            top = min(lim.max_context, 6 * b) if chunked else min(lim.max_context, b - len(dec))
            case = Case(kind, b, chunked, (_loguniform(rng, 16, top),), dec, 10)
        cases.append(case)
        got[kind] += case.expected_steps
    order = rng.permutation(len(cases))
    return [cases[i] for i in order]


WARMUP = (Case("prefill", 256, True, (1024,), (), 16), Case("prefill", 2048, True, (300, 200), (), 16),
          Case("decode", 64, True, (), (600,) * 8 + (200,) * 8, 4),
          Case("mixed", 512, True, (700,), (300,) * 4, 10))


def warmup_cases(lim: Limits) -> list[Case]:
    def clip(xs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(min(x, lim.max_context) for x in xs)

    return [Case(c.kind, c.budget, c.chunked, clip(c.prompts), clip(c.decoders), c.steps) for c in WARMUP]


def _observe(eng: Any) -> Callable[[], Optional[StepCounts]]:
    """Wrap this engine's scheduler.schedule (on the instance) to read each batch's step counts before the
    step advances its sequences. Returns a function giving the last step's counts (None: nothing scheduled)."""
    from pdlab.engine.timed import count_step

    inner = eng.scheduler.schedule
    last: list[Optional[StepCounts]] = [None]

    def schedule() -> Any:
        batch = inner()
        last[0] = count_step(list(zip(batch.seqs, batch.num_tokens, batch.decode))) if batch.seqs else None
        return batch

    eng.scheduler.schedule = schedule

    def take() -> Optional[StepCounts]:
        c, last[0] = last[0], None
        return c

    return take


class PoolSlices:
    """Case engines' pools as slices of one pool of a worker's size, allocated once the way a worker allocates
    its own (pdlab.timing.process): steps read and write KV where a serving worker's would, in the same kind
    of memory, without allocating and zeroing a worker-sized pool per case. Cases take the first blocks, the
    primer the last `reserve` (PRIMER_BLOCKS)."""

    def __init__(self, pool: Any, reserve: int = 0):
        self.pool, self.reserve = pool, reserve or PRIMER_BLOCKS

    def head(self, shape: tuple, dtype: Any, device: Any = None) -> Any:
        return self._take(shape, dtype, 0, self.pool.shape[2] - self.reserve)

    def tail(self, shape: tuple, dtype: Any, device: Any = None) -> Any:
        return self._take(shape, dtype, self.pool.shape[2] - shape[2], self.reserve)

    def _take(self, shape: tuple, dtype: Any, first: int, most: int) -> Any:
        p = self.pool
        if tuple(shape[:2]) != tuple(p.shape[:2]) or tuple(shape[3:]) != tuple(p.shape[3:]) or dtype != p.dtype:
            raise ValueError(f"a pool of {tuple(shape)} {dtype} is not a slice of {tuple(p.shape)} {p.dtype}")
        if shape[2] > most:
            raise ValueError(f"{shape[2]} blocks asked of a pool of {p.shape[2]}: at most {most} are this side's")
        return p[:, :, first:first + shape[2]]


PRIMER_SEQS, PRIMER_CONTEXT = 4, 100
PRIMER_BLOCKS = PRIMER_SEQS * cdiv(PRIMER_CONTEXT + 64, 16) + 16  # the primer's pool (block size 16)


class Primer:
    """A small engine kept for warming up: a few decode steps on it just before a case's first measured step
    bring the process back to the steady state of a serving worker. Without them the first three or four
    steps after setting a case up (a new pool, random KV, a garbage collection) ran up to 2x slower on the
    CPU box: caches and allocator, not the step's work."""

    def __init__(self, model: Any, rng: np.random.Generator, pool: Optional[PoolSlices] = None):
        from pdlab.engine import Engine, EngineConfig

        self.rng, self.seqs, self.context = rng, PRIMER_SEQS, PRIMER_CONTEXT
        self.vocab = model.config.vocab_size
        self.eng = Engine(model, EngineConfig(block_size=16, kv_blocks=PRIMER_BLOCKS, prefix_caching=False,
                                              max_running=self.seqs), kv_alloc=pool.tail if pool else None)

    def __call__(self, steps: int = 4) -> None:
        from pdlab.engine import SamplingParams

        for i in range(self.seqs):
            self.eng.reserve(f"w{i}", self.rng.integers(3, self.vocab, size=self.context).tolist(), first_token=3,
                             params=SamplingParams(max_tokens=steps + 1, ignore_eos=True))
            self.eng.admit(f"w{i}")
        for _ in range(steps):
            self.eng.step()
        for rid in list(self.eng.seqs):
            self.eng.abort(rid)


def case_engine(model: Any, case: Case, rng: np.random.Generator, block_size: int = 16,
                pool: Optional[PoolSlices] = None, room: int = 0) -> Any:
    """A fresh engine (prefix cache off) holding `case`'s decoders, admitted with random KV, and its prompts;
    its pool a slice of `pool` when given; `room`: requests it may hold beyond the case's."""
    import torch

    from pdlab.engine import Engine, EngineConfig, SamplingParams

    vocab = model.config.vocab_size
    lead, need = case.lead, case.blocks(block_size)
    cfg = EngineConfig(block_size=block_size, kv_blocks=2 * need + 16, token_budget=case.budget,
                       chunked_prefill=case.chunked, prefix_caching=False,
                       max_running=max(1, len(case.decoders) + len(case.prompts) + room))
    eng = Engine(model, cfg, kv_alloc=pool.head if pool else None)
    for i, ctx in enumerate(case.decoders):
        rid = f"d{i}"
        res = eng.reserve(rid, rng.integers(3, vocab, size=ctx).tolist(), first_token=int(rng.integers(3, vocab)),
                          params=SamplingParams(max_tokens=lead + case.steps + 8, ignore_eos=True))
        assert res is not None, "the case's pool is sized to hold every decoder"
        idx = torch.tensor(res.block_ids, device=eng.device)
        shape = list(eng.kv.shape)
        shape[2] = len(res.block_ids)
        eng.kv.index_copy_(2, idx, torch.randn(shape, device=eng.device).to(eng.dtype))
        eng.admit(rid)
    for i, n in enumerate(case.prompts):
        eng.add(f"p{i}", rng.integers(3, vocab, size=n).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
    return eng


def run_case(model: Any, case: Case, rng: np.random.Generator, case_id: int = 0, block_size: int = 16,
             primer: Optional[Primer] = None, pool: Optional[PoolSlices] = None) -> list[StepSample]:
    """Run one case on a fresh engine (after `primer`'s warm-up steps), its pool a slice of `pool` when
    given; the steps it recorded."""
    import torch

    eng = case_engine(model, case, rng, block_size, pool)
    lead = case.lead
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    take = _observe(eng)
    out: list[StepSample] = []
    gc.collect()
    if primer is not None:
        primer()
    for _ in range(lead):
        eng.step()
    for _ in range(case.steps):
        if not eng.has_work():
            break
        sync()
        cpu = time.process_time()
        step = eng.step()
        sync()
        t_end, cpu = time.monotonic(), time.process_time() - cpu
        counts = take()
        rec = step.record
        if rec is not None and counts is not None and not rec.preempted:
            end = t_end if cuda else rec.end
            out.append(StepSample(counts, (end - rec.start) * 1000.0, case_id, None if cuda else cpu * 1000.0))
        if case.prompts and all(s.is_decode for s in eng.seqs.values()):
            break  # every prompt is prefilled (a prefill case's requests have finished)
    for rid in list(eng.seqs):
        eng.abort(rid)
    del eng
    return out


def measure_steps(model: Any, cases: list[Case], lim: Limits, rng: np.random.Generator,
                  progress: Optional[Callable[[int, int], None]] = None,
                  pool: Optional[PoolSlices] = None) -> list[StepSample]:
    """Warm up (each kind, unrecorded), then run `cases`; every recorded step, tagged with its case index."""
    primer = Primer(model, rng, pool=pool)
    for c in warmup_cases(lim):
        run_case(model, c, rng, -1, primer=primer, pool=pool)
    samples: list[StepSample] = []
    for i, c in enumerate(cases):
        samples.extend(run_case(model, c, rng, i, primer=primer, pool=pool))
        if progress:
            progress(i + 1, len(samples))
    return samples


# ---- transfers ----

def probe_transfers(dims: dict, device_type: str, dtype: Any, block_size: int = 16,
                    tokens: tuple[int, ...] = (512, 2048, 8192), repeats: int = 10) -> dict[str, dict]:
    """Latency and bandwidth per transport usable with this device (shm on CPU; cuda-ipc and host on CUDA),
    fitted to pdlab.kv.probe hand-overs of KV-shaped pools at several sizes (best of `repeats` each)."""
    from pdlab.kv.probe import probe_cuda, probe_shm

    per: dict[str, list] = {}
    notes: dict[str, str] = {}
    for n in tokens:
        shape = (dims["layers"], 2, cdiv(n, block_size), block_size, dims["kv_heads"], dims["head_dim"])
        if device_type == "cuda":
            results = probe_cuda(shape, repeats, dtype=dtype)
            if any(r.transport == "cuda-ipc (peer)" and r.available for r in results):
                results = [r for r in results if r.transport != "cuda-ipc"]  # across GPUs is the PD case
        else:
            results = [probe_shm(shape, repeats)]
        for r in results:
            if not r.available or r.handover_gbps <= 0:
                continue
            name = "cuda-ipc" if r.transport.startswith("cuda-ipc") else r.transport
            notes[name] = f"{r.note}; " if r.note else ""
            notes[name] += f"baseline: {r.baseline}"
            per.setdefault(name, []).append((r.bytes, r.bytes / (r.handover_gbps * 1e9), r.baseline_gbps))
    out = {}
    for name, pts in per.items():
        sizes, secs = [p[0] for p in pts], [p[1] for p in pts]
        gbps, latency_ms = fit_transfer(sizes, secs)
        out[name] = {"gbps": gbps, "latency_ms": latency_ms, "bytes": sizes, "ms": [s * 1000.0 for s in secs],
                     "baseline_gbps": [p[2] for p in pts], "note": notes[name]}
    return out


# ---- the device ----

def describe_device(device: str, threads: int) -> str:
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name} {props.total_memory / 1e9:.0f}GB"
    from pdlab.measure.records import cpu_model

    return f"{cpu_model() or 'CPU'} ({os.cpu_count()} cores), {threads} thread{'s' if threads != 1 else ''}"


def kv_memory_gb(device: str) -> float:
    """The memory a timed engine's "auto" KV sizing should start from to size its pool as the real engine
    does here. The timed engine takes kv_memory_fraction of kv_memory_gb (pdlab.engine.Engine._auto_blocks),
    as the real engine does of free device memory: on CUDA this is the free memory now (model loaded); on
    CPU the real engine takes min(available x fraction, 1 GiB), so this is min(available, 1 GiB / fraction)
    at the default fraction."""
    import torch

    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free / 1e9
    from pdlab.engine.config import EngineConfig
    from pdlab.engine.engine import CPU_AUTO_KV_BYTES

    frac = EngineConfig().kv_memory_fraction
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(avail, CPU_AUTO_KV_BYTES / frac) / 1e9
