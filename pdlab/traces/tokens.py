"""Token ids for a replayed trace: traces carry lengths, not text, so prompts are made of seeded random tokens.

Mooncake's hash_ids say which blocks of two prompts are equal. Each id becomes one block of `size` token
ids drawn from a generator seeded by (the recipe's seed, the id) alone, so equal ids give identical blocks
wherever they appear (and prefix-cache hits come from the trace), different ids give different blocks,
and the same id gives the same block at every rate, in every variant and every process. A prompt is its
blocks in order, cut to its length (the last block partial); tokens past its last id are its own.
Prompts with no ids are their own tokens throughout, seeded by (seed, a key of the request).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

_BLOCK = zlib.crc32(b"trace-block")
_OWN = zlib.crc32(b"trace-own")


def _u64(x: int) -> int:
    return x % (1 << 64)  # SeedSequence takes non-negative integers; any int id maps to one


class TokenBlocks:
    """Token blocks of one seed and token range [low, high); each block drawn once and kept."""

    def __init__(self, seed: int, size: int, low: int, high: int):
        if size < 1 or low >= high:
            raise ValueError(f"token blocks need size >= 1 and low < high, got {size}, [{low}, {high})")
        self.seed, self.size, self.low, self.high = seed, size, low, high
        self._blocks: dict[int, list[int]] = {}

    def block(self, hid: int) -> list[int]:
        """The `size` token ids of hash id `hid` (the same list object every time: prompts share its ints)."""
        b = self._blocks.get(hid)
        if b is None:
            rng = np.random.default_rng([self.seed, _BLOCK, _u64(hid)])
            b = self._blocks[hid] = rng.integers(self.low, self.high, self.size).tolist()
        return b

    def own(self, key: Sequence[int], n: int) -> list[int]:
        """`n` token ids that belong to one request alone (`key`: integers naming it)."""
        if n <= 0:
            return []
        rng = np.random.default_rng([self.seed, _OWN, *(_u64(k) for k in key)])
        return rng.integers(self.low, self.high, n).tolist()

    def prompt(self, ids: Sequence[int], length: int, key: Sequence[int]) -> list[int]:
        """`length` tokens: the blocks of `ids` in order, cut to `length`; past the last id, the request's own."""
        out: list[int] = []
        for hid in ids:
            if len(out) >= length:
                break
            out += self.block(hid)
        del out[length:]
        out += self.own(key, length - len(out))
        return out
