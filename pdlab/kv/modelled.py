"""KV hand-overs of a timed engine (pdlab.engine.timed): the pools hold one element per head slot, so the
real copy is tiny; the hand-over then takes the modelled time of the real model's bytes over the modelled
transport (pdlab.recipe.TransferTiming: latency + bytes / bandwidth). Without transfer figures for the
transport the copy takes what the tiny copy takes (next to nothing), and the profile says so by omission.

Pull copies a request's blocks at once; push copies them layer by layer as the modelled step reaches each
layer, each layer's share of the time in the copier's thread, so a push overlaps the rest of the step.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from pdlab.kv.copy import copy_blocks


def modelled_copy(block_bytes: int, layers: int, timing: Any) -> Callable[..., int]:
    """A copy function for PullCopier and PushCopier: (src, src_blocks, dst, dst_blocks, layer=None,
    non_blocking=False) -> the modelled bytes moved. `block_bytes`: the real model's bytes per block,
    all layers; `timing`: a TransferTiming or None."""

    def copy(src: Any, src_blocks: Sequence[int], dst: Any, dst_blocks: Sequence[int], layer: Optional[int] = None,
             non_blocking: bool = False) -> int:
        t0 = time.monotonic()
        copy_blocks(src, src_blocks, dst, dst_blocks, layer=layer)
        nbytes = len(src_blocks) * block_bytes // (1 if layer is None else layers)
        if timing is not None and src_blocks:
            share = 1.0 if layer is None else 1.0 / layers
            left = t0 + timing.latency_ms / 1000.0 * share + nbytes / (timing.gbps * 1e9) - time.monotonic()
            if left > 0:
                time.sleep(left)
        return nbytes

    return copy
