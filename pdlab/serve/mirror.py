"""The router's mirror of a decode worker's prefix cache, for selective disaggregation.

The decode worker reports the keys its block manager caches and drops (`CacheEvents`, after each step);
the mirror applies them, so the router can tell how much of a new prompt that worker would not have to
compute, without asking it (a question would wait for the worker's step to end). The mirror lags the
worker by the messages in flight: a prefix admitted a moment ago may not be known yet, one evicted a moment
ago may still be. Keys are pdlab.engine.blocks' hash chain, the same on every worker.
"""

from __future__ import annotations

from typing import Iterable

from pdlab.engine.blocks import block_key


class PrefixMirror:
    def __init__(self) -> None:
        self.keys: set[int] = set()

    def apply(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        self.keys.difference_update(removed)
        self.keys.update(stored)

    def clear(self) -> None:
        self.keys.clear()

    def cached_tokens(self, prompt: list[int], block_size: int) -> int:
        """Leading prompt tokens whose blocks the worker holds. At least the last token is always computed,
        so at most len(prompt) - 1 tokens count, as in the engine's own prefix match."""
        parent = None
        n = 0
        for i in range((len(prompt) - 1) // block_size):
            parent = block_key(parent, prompt[i * block_size:(i + 1) * block_size])
            if parent not in self.keys:
                break
            n += 1
        return n * block_size
