"""Paged KV block manager with a prefix cache.

Blocks are reference counted. A full block gets a key: a hash chain over the token ids of every block
up to and including it, so equal keys mean equal prefixes. With prefix caching on, a freed block keeps
its key and goes to an LRU list; it is reused by a later request with the same prefix, or evicted
(oldest first) when a fresh block is needed and the free list is empty.

Placement: a request's next block is, when possible, the one right after its last, so most block tables
are one contiguous run and decode attention can read a long context in place instead of gathering it.
To leave room for that growth, the blocks just after a new request's run go to the back of the free list.
Which blocks are chosen never changes how many are free: capacity, preemption and caching are unaffected.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Collection, Optional

from pdlab.constants import cdiv
from pdlab.engine.sequence import Sequence


def padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """Block tables of unequal length as one row-major list padded with block 0, and its width (the kernels
    read a table only up to its own context length)."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return flat, width


def block_key(parent: Optional[int], tokens: list[int]) -> int:
    """Stable across processes (unlike hash() of some types), so prefill and decode workers agree."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return int.from_bytes(h.digest(), "little")


def prefix_keys(tokens: list[int], block_size: int, max_blocks: Optional[int] = None) -> list[int]:
    """Chain keys of the full blocks of `tokens` (at most `max_blocks`)."""
    keys: list[int] = []
    n = len(tokens) // block_size if max_blocks is None else min(max_blocks, len(tokens) // block_size)
    parent: Optional[int] = None
    for i in range(n):
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.key: list[Optional[int]] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # never cached or invalidated
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, still cached, LRU first
        self.cached: dict[int, int] = {}  # key -> block
        # when a list: (True, key) for every key cached, (False, key) for every key dropped, for a worker to
        # report (pdlab.serve: selective routing mirrors a decode worker's prefix cache)
        self.events: Optional[list[tuple[bool, int]]] = None

    # ---- capacity ----
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        need = cdiv(num_tokens, self.block_size)
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: Collection[int] = ()) -> bool:
        """Whether `seq` can hold `num_tokens` tokens, after first taking the cached blocks `hits` (those
        unreferenced now are counted in num_free until taken, so they do not count twice)."""
        reusable = sum(1 for b in hits if self.ref[b] == 0)
        return self.blocks_needed(seq, num_tokens) - len(hits) <= self.num_free - reusable

    # ---- prefix cache ----
    def match_prefix(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Cached blocks holding a prefix of `tokens`, covering at most `max_tokens` tokens."""
        if not self.prefix_caching:
            return []
        hits = []
        for k in prefix_keys(tokens, self.block_size, max_tokens // self.block_size):
            b = self.cached.get(k)
            if b is None:
                break
            hits.append(b)
        return hits

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` the cached `blocks` as the start of its block table (its KV is already there)."""
        assert not seq.block_table
        for b in blocks:
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1
            self._append(seq, b)
            seq.block_hashes.append(self.key[b])  # type: ignore[arg-type]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks of `seq` that are now full of computed tokens, so others can reuse them."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            k = block_key(parent, seq.tokens(i * self.block_size, (i + 1) * self.block_size))
            seq.block_hashes.append(k)
            b = seq.block_table[i]
            if k not in self.cached and self.key[b] is None:
                self.cached[k] = b
                self.key[b] = k
                if self.events is not None:
                    self.events.append((True, k))

    # ---- allocation ----
    def allocate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Extend `seq`'s block table to hold `num_tokens` tokens; returns the new blocks."""
        new = []
        starting = not seq.block_table
        for _ in range(self.blocks_needed(seq, num_tokens)):
            prev = seq.block_table[-1] if seq.block_table else None
            b = self._fresh_block(None if prev is None else prev + 1)
            self.ref[b] = 1
            self._append(seq, b)
            new.append(b)
        if starting and new:
            # Keep the blocks the request may still grow into (rest of its prompt and its outputs) at the
            # back of the free list, for as long as others can do without them.
            headroom = min(256, cdiv(seq.prompt_len + seq.params.max_tokens, self.block_size))
            last = new[-1]
            for b in range(last + 1, min(last + 1 + headroom, self.num_blocks)):
                if b in self.free:
                    self.free.move_to_end(b)
        return new

    @staticmethod
    def _append(seq: Sequence, b: int) -> None:
        seq.contiguous = seq.contiguous and (not seq.block_table or b == seq.block_table[-1] + 1)
        seq.block_table.append(b)

    def _fresh_block(self, prefer: Optional[int] = None) -> int:
        # The preferred block is taken only from the free list: taking it from the evictable ones would
        # throw away a cached prefix out of LRU order while other blocks were free.
        if prefer is not None and prefer in self.free:
            del self.free[prefer]
            return prefer
        if self.free:
            return self.free.popitem(last=False)[0]
        if not self.evictable:
            raise RuntimeError("KV pool exhausted (the scheduler should have checked)")
        b, _ = self.evictable.popitem(last=False)
        self._uncache(b)
        return b

    def _uncache(self, b: int) -> None:
        k = self.key[b]
        if k is not None and self.cached.get(k) == b:
            del self.cached[k]
            if self.events is not None:
                self.events.append((False, k))
        self.key[b] = None

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks first so that shared prefixes are evicted last."""
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released twice"
            if self.ref[b] == 0:
                if self.prefix_caching and self.key[b] is not None:
                    self.evictable[b] = None
                else:
                    self.key[b] = None
                    self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.contiguous = True

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (held blocks keep their keys)."""
        for b in list(self.evictable):
            self._uncache(b)
            self.free[b] = None
        self.evictable.clear()

    def check_idle(self) -> None:
        """Assert nothing is held: every block free or evictable, no dangling references."""
        held = [b for b in range(self.num_blocks) if self.ref[b] != 0]
        assert not held, f"{len(held)} blocks still referenced: {held[:8]}"
        assert self.num_free == self.num_blocks, f"{self.num_blocks - self.num_free} blocks leaked"
