"""A trace made ready to replay: the window, sample and limit cut, lengths scaled and clipped, arrivals scaled.

In this order, from the trace as read:
1. window: rows with start_s <= t < start_s + duration_s, t in the trace's own seconds from its first row;
2. sample: a fraction of those, chosen without replacement by a generator seeded by the recipe's seed (the
   same requests for every variant and repeat), kept in trace order;
3. limit: the first `limit` of those;
4. time_scale multiplies the gaps between arrivals (0.5: the trace twice as fast): the trace's own pace,
   and its nominal rate (n - 1 requests over the span from first to last) is the rate of that pace;
5. length_scale shrinks input and output lengths (rounding up, never to 0) and the trace's block size with
   them (512 x 1/8 = 64 tokens per hash id), so the blocks of a scaled prompt still line up with its ids;
6. lengths over the model's context are clipped, and counted: a prompt to context - 1 tokens, its output to
   what then fits (prompt + output <= context, where the engine stops a request anyway).

At a rate r the arrivals are the trace's offsets times nominal / r: the trace's pattern of gaps and bursts at
the mean rate asked for (r = the nominal rate replays the trace at its own pace); at r = inf all arrive at 0.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import Any, Optional

import numpy as np

from pdlab.traces import read_trace
from pdlab.traces.tokens import TokenBlocks
from pdlab.traces.trace import Trace, TraceError

_SAMPLE = 0x5A4D  # key of the sample's generator, beside the recipe's seed


def select(trace: Trace, start_s: float = 0.0, duration_s: Optional[float] = None, sample: float = 1.0,
           limit: Optional[int] = None, seed: int = 0) -> np.ndarray:
    """Row indices of `trace` in the window, sampled and limited (steps 1-3), in trace order."""
    end = math.inf if duration_s is None else start_s + duration_s
    idx = np.flatnonzero((trace.t >= start_s) & (trace.t < end))
    if sample < 1.0 and len(idx):
        k = max(1, round(sample * len(idx)))
        idx = np.sort(np.random.default_rng([seed, _SAMPLE]).choice(idx, k, replace=False))
    if limit is not None:
        idx = idx[:limit]
    if not len(idx):
        raise TraceError(f"{trace.path}: no request in the window (start_s {start_s:g}, duration_s "
                         f"{duration_s}, sample {sample:g}, limit {limit}); the trace spans {trace.t[-1]:.6g} s")
    return idx


def scaled_lengths(trace: Trace, idx: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, Optional[int]]:
    """Input and output lengths of rows `idx` times `scale` (step 5), and the scaled block size."""
    out = np.maximum(1, np.ceil(trace.output_len[idx] * scale)).astype(np.int64)
    if trace.block_size is None or trace.hash_ids is None:
        return np.maximum(1, np.ceil(trace.input_len[idx] * scale)).astype(np.int64), out, None
    b, b2 = trace.block_size, max(1, round(trace.block_size * scale))
    inp = np.empty(len(idx), dtype=np.int64)
    for j, i in enumerate(idx):
        n, k = int(trace.input_len[i]), len(trace.hash_ids[i])
        if k and (k - 1) * b < n <= k * b:  # as Mooncake writes them: k ids for k blocks, the last partial
            inp[j] = (k - 1) * b2 + min(b2, max(1, math.ceil((n - (k - 1) * b) * scale)))
        else:
            inp[j] = max(1, math.ceil(n * scale))
    return inp, out, b2


class Replay:
    """The requests one trace workload replays (steps 1-6), with what was cut, scaled and clipped."""

    def __init__(self, trace: Trace, spec: Any, seed: int, context: Optional[int] = None):
        """`spec`: the recipe's workload.trace (time_scale, start_s, duration_s, limit, sample, length_scale);
        `seed`: the recipe's seed (the sample); `context`: the model's limit in tokens (None: no clipping)."""
        self.trace, self.spec, self.context = trace, spec, context
        self.index = select(trace, spec.start_s, spec.duration_s, spec.sample, spec.limit, seed)
        t = trace.t[self.index]
        self.offsets = (t - t[0]) * spec.time_scale
        inp, out, self.block_size = scaled_lengths(trace, self.index, spec.length_scale)
        self.clipped_input = self.clipped_output = 0
        if context is not None:
            over_in = inp > context - 1
            inp = np.minimum(inp, context - 1)
            over_out = out > context - inp
            out = np.minimum(out, context - inp)
            self.clipped_input, self.clipped_output = int(over_in.sum()), int(over_out.sum())
        self.input_len, self.output_len = inp, out
        self.ids: Optional[list[tuple[int, ...]]] = (None if trace.hash_ids is None else
                                                     [trace.hash_ids[i] for i in self.index])
        self._blocks: dict[tuple[int, int, int], TokenBlocks] = {}
        self._prompts: dict[tuple[int, int, int], list[list[int]]] = {}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def span_s(self) -> float:
        return float(self.offsets[-1])

    @property
    def nominal_rate(self) -> Optional[float]:
        """Requests per second at the trace's own pace (time_scale applied): None for a single request, inf
        when every request arrives at the same time."""
        if len(self) < 2:
            return None
        return math.inf if self.span_s <= 0 else (len(self) - 1) / self.span_s

    def arrivals(self, rate: float) -> list[float]:
        """Offsets (s) of every request at `rate` req/s: the trace's gaps times nominal / rate."""
        if math.isinf(rate) or len(self) < 2:
            return [0.0] * len(self)
        if self.span_s <= 0:
            raise TraceError(f"{self.trace.path}: the {len(self)} requests replayed all arrive at the same time; "
                             f"there is no pace to scale to {rate:g} req/s (rates: [inf] replays them)")
        return (self.offsets * (self.nominal_rate / rate)).tolist()

    def blocks(self, seed: int, low: int, high: int) -> TokenBlocks:
        key = (seed, low, high)
        if key not in self._blocks:
            self._blocks[key] = TokenBlocks(seed, self.block_size or 1, low, high)
        return self._blocks[key]

    def prompts(self, seed: int, low: int, high: int) -> list[list[int]]:
        """Every replayed prompt for repeat seed `seed`: hash-id blocks where the trace has them, else the
        request's own tokens (keyed by its file line). Built once per seed; the same lists at every rate."""
        key = (seed, low, high)
        if key not in self._prompts:
            tb = self.blocks(seed, low, high)
            lines = self.trace.line[self.index]
            self._prompts[key] = [tb.prompt(self.ids[j] if self.ids else (), int(n), (int(lines[j]),))
                                  for j, n in enumerate(self.input_len)]
        return self._prompts[key]

    def requests(self, rate: float, seed: int, low: int, high: int, n: Optional[int] = None,
                 own: Optional[str] = None) -> list[tuple[list[int], int, float]]:
        """(prompt, output length, arrival) of each request at `rate` for repeat seed `seed`. Measured requests
        (`own` None) replay the trace in order, the first `n` (default: all). With `own` (a stream's name:
        warm-up, calibration) `n` requests take the lengths of rows drawn by (seed, own) and tokens of their
        own, so they never warm the cache for the measured prompts; they arrive together at rate inf."""
        if own is None:
            n = len(self) if n is None else min(n, len(self))
            prompts, arrivals = self.prompts(seed, low, high), self.arrivals(rate)
            return [(prompts[i], int(self.output_len[i]), arrivals[i]) for i in range(n)]
        n = n or 0
        tag = zlib.crc32(own.encode())
        pick = np.random.default_rng([seed, tag]).choice(len(self), n, replace=n > len(self)).tolist()
        tb = self.blocks(seed, low, high)
        return [(tb.own((tag, i), int(self.input_len[j])), int(self.output_len[j]),
                 0.0 if math.isinf(rate) else i / rate) for i, j in enumerate(pick)]

    def reuse_ratio(self) -> Optional[float]:
        """The trace's own prefix reuse over the replayed requests, in order, with an unbounded cache: the
        fraction of prompt tokens in leading blocks whose chain of ids came before (a block counts up to the
        tokens of it seen before). None when the trace has no prefix information."""
        if self.ids is None:
            return None
        seen: dict[int, int] = {}
        hit = 0
        b = self.block_size or 1
        for ids, n in zip(self.ids, self.input_len.tolist()):
            chain, prefix = 0, True
            for j, hid in enumerate(ids[: math.ceil(n / b)]):
                chain = hash((chain, hid))
                size = min(b, n - j * b)
                if prefix and chain in seen:
                    hit += min(size, seen[chain])
                    prefix = seen[chain] >= size
                else:
                    prefix = False
                seen[chain] = max(seen.get(chain, 0), size)
        return hit / int(self.input_len.sum())

    def facts(self) -> dict:
        """What the run's summary says about the trace (pdlab.traces.report): what was read, dropped, cut,
        scaled and clipped, the nominal rate and the trace's own reuse."""
        tr, sp = self.trace, self.spec
        return {"format": tr.format, "path": tr.path, "rows": tr.rows, "replayable": len(tr),
                "dropped": tr.dropped_counts, "requests": len(self),
                "window": {"start_s": sp.start_s, "duration_s": sp.duration_s, "sample": sp.sample,
                           "limit": sp.limit},
                "time_scale": sp.time_scale, "span_s": self.span_s, "nominal_rate": self.nominal_rate,
                "length_scale": sp.length_scale, "block_size": self.block_size,
                "input_len_mean": float(self.input_len.mean()), "output_len_mean": float(self.output_len.mean()),
                "clipped": {"context": self.context, "input": self.clipped_input, "output": self.clipped_output},
                "prefix_info": tr.prefix_info, "reuse_ratio": self.reuse_ratio()}


@lru_cache(maxsize=8)
def replay_for(spec: Any, seed: int, context: Optional[int] = None) -> Replay:
    """The Replay of a recipe's (hashable) workload.trace section; one per process for equal arguments, so
    every variant of a recipe shares its prompts."""
    return Replay(read_trace(spec.path, spec.format), spec, seed, context)
