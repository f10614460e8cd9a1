"""The timed runner: what a step does when the model's timing is modelled instead of computed.

It replaces the model forward (pdlab.engine.runner.ModelRunner) for an engine built with a timing model:
the step waits until its modelled time has passed since it began, and each sampling request gets a
deterministic token id. The scheduler, block manager, prefix cache and roles are the engine's own, so a
timed run exercises exactly the real engine's decisions at the modelled device's speed, with almost no CPU.

- Layer hooks (push-mode KV copies) fire as the modelled step progresses, layer l at fraction (l + 1) / L
  of the step, so a push copy overlaps the rest of the step as it would on the device.
- A step writes KV as a forward would: each token it computes gets deterministic values (a function of
  the token id, its position, the layer and K|V: `kv_values`) in its slot of the request's blocks, layer
  by layer before each layer hook. A sampled token is a function of a digest of the prompt's KV as this
  engine's pool holds it (`kv_digest`) and of the output position. So a prefill worker and a decode worker
  agree, and disaggregated output equals unified output, only when the hand-over moved the right bytes
  into the right blocks: a hand-over that moved nothing, or the wrong blocks, or garbled one, changes the
  tokens, as it would with a real model. Prefix-cache hits hold what an earlier request wrote for the same
  tokens at the same positions, so they give the same digest.
- A model stand-in (no weights) gives the engine the model's dimensions: the KV pool has the real number
  of blocks (sized from the modelled device's memory) but one element per head slot, and KV bytes in
  records are the real model's.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

SPIN_S = 0.0005  # sleep until this close to a deadline, then spin (sleep overshoots on a loaded box)
TOKEN_LOW = 10  # deterministic tokens avoid the low ids, where special tokens live
# KV slot values are integers 1..KV_VALUES (never 0, a fresh pool's value): exact in every float dtype a
# pool may have (bfloat16 holds the integers up to 256)
KV_VALUES = 251
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StepTimeModel(Protocol):
    """A modelled step time (pdlab.recipe.TimingProfile is one; the engine does not import the recipe)."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: int = 0,
               chunks: int = 0, fresh_pairs: int = 0, resumed_pairs: int = 0, resumed_context: int = 0) -> float:
        ...


@dataclass(frozen=True)
class StepCounts:
    """What one step computes, counted before it advances its sequences: the step model's variables.

    A prefill chunk of n tokens starting at position `start` is *fresh* when start is 0 (it attends only to
    itself: causal, n (n + 1) / 2 pairs) and *resumed* otherwise (a later chunk of a chunked prompt, or a
    prompt after a prefix-cache hit). The two take different code paths on a CPU: a fresh chunk runs causal
    attention over its own K/V (pdlab's prefill kernel or SDPA), a resumed one gathers its whole context
    from the pool's blocks and runs SDPA with an explicit mask over the full n x (start + n) rectangle
    (pdlab.engine.attention). Hence `fresh_pairs` (the fresh chunks' causal pairs), `resumed_pairs` (the
    resumed chunks' rectangles) and `resumed_context` (their gathered tokens) beside the causal
    `prefill_pairs` every chunk has: a profile can then give each path its own cost per pair (on an AVX2
    EPYC a fresh chunk's pair cost more than a resumed one's, the kernel losing to SDPA at long chunks)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0  # tokens attended by the decode sequences (each its context + its new token)
    prefill_pairs: int = 0  # sum over prefill chunks of n x start + n (n + 1) / 2: causal attention pairs
    chunks: int = 0  # prefill chunks in the step
    fresh_pairs: int = 0  # sum over fresh chunks of n (n + 1) / 2
    resumed_pairs: int = 0  # sum over resumed chunks of n x (start + n)
    resumed_context: int = 0  # sum over resumed chunks of start + n

    @property
    def kind(self) -> str:
        """prefill (no decode), decode (no prefill) or mixed."""
        if self.decode_seqs == 0:
            return "prefill"
        return "decode" if self.prefill_tokens == 0 else "mixed"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def wait_until(deadline: float, spin_s: float = SPIN_S) -> float:
    """Return at time.monotonic() >= deadline: sleep most of the way, spin the last `spin_s`. Returns the
    time it saw last."""
    now = time.monotonic()
    if deadline - now > spin_s:
        time.sleep(deadline - now - spin_s)
        now = time.monotonic()
    while now < deadline:
        now = time.monotonic()
    return now


def count_step(trio: list[tuple[Any, int, bool]]) -> StepCounts:
    """The StepCounts of a step's (sequence, new tokens, is decode) triples, before it advances them."""
    prefill = decode = context = pairs = chunks = fresh = resumed_pairs = resumed_context = 0
    for s, n, d in trio:
        start = s.num_computed
        if d:
            decode += 1
            context += start + n
            continue
        prefill += n
        pairs += n * start + n * (n + 1) // 2
        chunks += 1
        if start:
            resumed_pairs += n * (start + n)
            resumed_context += start + n
        else:
            fresh += n * (n + 1) // 2
    return StepCounts(prefill, decode, context, pairs, chunks, fresh, resumed_pairs, resumed_context)


def modelled_s(timing: StepTimeModel, c: StepCounts) -> float:
    """The modelled time of a step of counts `c`, in seconds."""
    return timing.step_s(c.prefill_tokens, c.decode_seqs, c.context_tokens, c.prefill_pairs, c.chunks,
                         c.fresh_pairs, c.resumed_pairs, c.resumed_context)


def step_counts(trio: list[tuple[Any, int, bool]]) -> tuple[int, int, int, int]:
    """(prefill tokens, decode sequences, context tokens of the decodes, prefill token x context pairs) of a
    step's (sequence, new tokens, is decode) triples, counted before the step advances the sequences."""
    c = count_step(trio)
    return c.prefill_tokens, c.decode_seqs, c.context_tokens, c.prefill_pairs


def kv_values(token_ids: np.ndarray, positions: np.ndarray, layers: int) -> np.ndarray:
    """The KV a timed step writes for tokens `token_ids` at `positions` (int64, n each): [layers, 2, n]
    integers in 1..KV_VALUES, a mix of token and position shifted per layer and K|V (so that a copy into the
    wrong layer shows too)."""
    return _shifted(token_residues(token_ids, positions), layers)


def token_residues(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each token's value before the shift per layer and K|V: 0..KV_VALUES-1."""
    x = (token_ids * 1_000_003 + positions * 7919) % 2_147_483_647
    return (x ^ (x >> 11)) * 48_271 % KV_VALUES  # mixed, so neighbouring tokens differ in every value


def _shifted(residues: np.ndarray, layers: int) -> np.ndarray:
    planes = np.arange(layers * 2, dtype=np.int64).reshape(layers, 2, 1) * 97  # 97: coprime with KV_VALUES
    return (residues.reshape(1, 1, -1) + planes) % KV_VALUES + 1


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Pool slots (block * block_size + offset) of positions start..end-1 of a sequence."""
    first = start // block_size
    blocks = np.asarray(block_table[first:-(-end // block_size)], dtype=np.int64)
    slots = (blocks.reshape(-1, 1) * block_size + np.arange(block_size)).reshape(-1)
    return slots[start - first * block_size:end - first * block_size]


class TimedPool:
    """A timed engine's pool ([layers, 2, blocks, block_size, 1, 1]) as the step writes and the sampler reads
    it: each value stored as its bit pattern in the pool's dtype, through numpy on CPU (a step's writes cost
    microseconds, which keeps the simulator fast), through torch on a device."""

    def __init__(self, kv: torch.Tensor):
        self.layers, self.block_size = kv.shape[0], kv.shape[3]
        itype = _BITS[kv.element_size()]
        bits = kv.view(self.layers, 2, -1).view(itype)  # [layers, 2, slots]
        self.on_cpu = kv.device.type == "cpu"
        self.bits: Any = bits.numpy() if self.on_cpu else bits
        # [layers, 2, residue] -> the bit pattern of kv_values: a step's values are then one lookup
        values = torch.from_numpy(_shifted(np.arange(KV_VALUES, dtype=np.int64), self.layers))
        self.table = values.to(kv.dtype).view(itype).numpy()

    def values(self, token_ids: list[int], positions: np.ndarray) -> Any:
        """kv_values as the pool's bit patterns."""
        v = self.table[:, :, token_residues(np.asarray(token_ids, np.int64), positions)]
        return v if self.on_cpu else torch.from_numpy(v).to(self.bits.device)

    def write(self, slots: np.ndarray, values: Any, layer: Optional[int] = None) -> None:
        idx = slots if self.on_cpu else torch.from_numpy(slots).to(self.bits.device)
        if layer is None:
            self.bits[:, :, idx] = values
        else:
            self.bits[layer][:, idx] = values[layer]

    def digest(self, block_table: list[int], length: int) -> int:
        """CRC32 of the bytes held for positions 0..length-1 of a block table, every layer, K and V."""
        held = self.bits[:, :, slots_of(block_table, 0, length, self.block_size)]
        return zlib.crc32((held if self.on_cpu else held.cpu().numpy()).tobytes())


class TimedRunner:
    def __init__(self, timing: StepTimeModel, layers: int, vocab_size: int, eos_ids: set[int], kv: torch.Tensor,
                 wait: Optional[Callable[[float], float]] = None):
        """`wait(deadline) -> now`: how to let time pass (default: sleep until then; a simulator's virtual
        clock jumps there). `kv`: the engine's pool ([layers, 2, blocks, block_size, 1, 1]), which steps
        write and tokens read."""
        if not callable(getattr(timing, "step_s", None)):
            raise TypeError(f"a timing must have a step_s(prefill_tokens, decode_seqs, context_tokens, "
                            f"prefill_pairs) method, got {type(timing).__name__}")
        self.timing, self.layers, self.vocab, self.eos = timing, layers, vocab_size, eos_ids
        # no spin: timed workers share a few cores, where spinning steals the time of the others
        self.wait = wait or (lambda deadline: wait_until(deadline, spin_s=0.0))
        self.layer_hook: Optional[Callable[[int], None]] = None
        self.pool = TimedPool(kv)
        self._hash: dict[str, int] = {}

    def run(self, trio: list[tuple[Any, int, bool]], start: float) -> float:
        """Wait out the modelled step that began at `start`, writing the KV of the tokens it computes (all
        layers at once, or each layer before its hook); returns its end."""
        step = modelled_s(self.timing, count_step(trio))
        # What the step computes into the pool: each prefill chunk's tokens (a prompt's, or a recomputed
        # sequence's). A decode step's KV is not written: the digest reads the prompt's slots only, and only
        # a later prompt holding generated tokens could meet those slots through the prefix cache.
        chunks = [(s, s.num_computed, s.num_computed + n) for s, n, d in trio if not d]
        if chunks:
            bs = self.pool.block_size
            slots = np.concatenate([slots_of(s.block_table, a, b, bs) for s, a, b in chunks])
            values = self.pool.values([t for s, a, b in chunks for t in s.tokens(a, b)],
                                      np.concatenate([np.arange(a, b) for _, a, b in chunks]))
        if self.layer_hook is None:
            if chunks:
                self.pool.write(slots, values)
            return self.wait(start + step)
        end = start
        for layer in range(self.layers):
            if chunks:
                self.pool.write(slots, values, layer)
            end = self.wait(start + step * (layer + 1) / self.layers)
            self.layer_hook(layer)
        return end

    def token(self, seq: Any) -> int:
        """The next token of `seq`: a function of the digest of its prompt's KV in this engine's pool (taken
        at its first token here) and of how many tokens it has produced."""
        h = self._hash.get(seq.req_id)
        if h is None:
            h = self._hash[seq.req_id] = self.pool.digest(seq.block_table, seq.prompt_len)
        span = self.vocab - TOKEN_LOW
        tok = TOKEN_LOW + (h + 7919 * len(seq.output_ids)) % span
        while tok in self.eos:
            tok = TOKEN_LOW + (tok - TOKEN_LOW + 1) % span
        return tok

    def forget(self, req_id: str) -> None:
        self._hash.pop(req_id, None)
