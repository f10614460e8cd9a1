"""The timed runner: what a step does when the model's timing is modelled instead of computed.

It replaces the model forward (pdlab.engine.runner.ModelRunner) for an engine built with a timing model:
the step waits until its modelled time has passed since it began, and each sampling request gets a
deterministic token id. The scheduler, block manager, prefix cache and roles are the engine's own, so a
timed run exercises exactly the real engine's decisions at the modelled device's speed, with almost no CPU.

- Layer hooks (push-mode KV copies) fire as the modelled step progresses, layer l at fraction (l + 1) / L
  of the step, so a push copy overlaps the rest of the step as it would on the device.
- Tokens depend only on the prompt and the output position, so a prefill worker and a decode worker
  agree, and disaggregated output equals unified output under a timing as it does with a real model.
- A model stand-in (no weights) gives the engine the model's dimensions: the KV pool has the real number
  of blocks (sized from the modelled device's memory) but one element per head slot, and KV bytes in
  records are the real model's.
"""

from __future__ import annotations

import time
import zlib
from array import array
from typing import Any, Callable, Optional, Protocol

SPIN_S = 0.0005  # sleep until this close to a deadline, then spin (sleep overshoots on a loaded box)
TOKEN_LOW = 10  # deterministic tokens avoid the low ids, where special tokens live


class StepTimeModel(Protocol):
    """A modelled step time (pdlab.recipe.TimingProfile is one; the engine does not import the recipe)."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: int = 0) -> float:
        ...


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


def step_counts(trio: list[tuple[Any, int, bool]]) -> tuple[int, int, int, int]:
    """(prefill tokens, decode sequences, context tokens of the decodes, prefill token x context pairs) of a
    step's (sequence, new tokens, is decode) triples, counted before the step advances the sequences."""
    prefill = decode = context = pairs = 0
    for s, n, d in trio:
        if d:
            decode += 1
            context += s.num_computed + n
        else:
            prefill += n
            pairs += n * s.num_computed + n * (n + 1) // 2
    return prefill, decode, context, pairs


class TimedRunner:
    def __init__(self, timing: StepTimeModel, layers: int, vocab_size: int, eos_ids: set[int],
                 wait: Optional[Callable[[float], float]] = None):
        """`wait(deadline) -> now`: how to let time pass (default: sleep until then; a simulator's virtual
        clock jumps there)."""
        if not callable(getattr(timing, "step_s", None)):
            raise TypeError(f"a timing must have a step_s(prefill_tokens, decode_seqs, context_tokens, "
                            f"prefill_pairs) method, got {type(timing).__name__}")
        self.timing, self.layers, self.vocab, self.eos = timing, layers, vocab_size, eos_ids
        # no spin: timed workers share a few cores, where spinning steals the time of the others
        self.wait = wait or (lambda deadline: wait_until(deadline, spin_s=0.0))
        self.layer_hook: Optional[Callable[[int], None]] = None
        self._hash: dict[str, int] = {}

    def run(self, trio: list[tuple[Any, int, bool]], start: float) -> float:
        """Wait out the modelled step that began at `start`; returns its end."""
        step = self.timing.step_s(*step_counts(trio))
        if self.layer_hook is None:
            return self.wait(start + step)
        end = start
        for layer in range(self.layers):
            end = self.wait(start + step * (layer + 1) / self.layers)
            self.layer_hook(layer)
        return end

    def token(self, seq: Any) -> int:
        """The next token of `seq`: a function of its prompt and how many tokens it has produced."""
        h = self._hash.get(seq.req_id)
        if h is None:
            h = self._hash[seq.req_id] = zlib.crc32(array("q", seq.prompt_ids).tobytes())
        span = self.vocab - TOKEN_LOW
        tok = TOKEN_LOW + (h + 7919 * len(seq.output_ids)) % span
        while tok in self.eos:
            tok = TOKEN_LOW + (tok - TOKEN_LOW + 1) % span
        return tok

    def forget(self, req_id: str) -> None:
        self._hash.pop(req_id, None)
