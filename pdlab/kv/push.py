"""Push mode: write each layer's KV into the decode pool while the prefill step computes later layers.

The engine calls `layer_hook(layer)` after every layer has written its KV. For the requests whose
prefill completes in this step, `on_layer` hands that layer to a copier thread, so the copy of layer l
overlaps the compute of layers l+1.. (on GPU on a side stream, ordered after the layer by an event).
`finish` waits for the last layer and returns, per request, the bytes copied and when.

On a CPU worker pinned to one core the copier shares that core with the compute, so the overlap is
only as good as the core's spare cycles (memory stalls of the compute); on GPU the copy runs on the
copy engines.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pdlab.kv.copy import copy_blocks


@dataclass
class PushJob:
    req_id: str
    src_blocks: list[int]
    dst: torch.Tensor  # the decode worker's exchange tensor (pool or host mirror)
    dst_blocks: list[int]
    bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    busy: float = 0.0  # seconds spent in the copies themselves (start..end also spans the compute between)
    error: Optional[str] = None


@dataclass
class _Layer:
    layer: int
    jobs: list[PushJob]
    event: Optional[object] = None
    last: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class PushCopier:
    def __init__(self, pool: torch.Tensor, copy_fn: Callable[..., int] = copy_blocks):
        self.pool = pool
        self.copy_fn = copy_fn  # (src, src_blocks, dst, dst_blocks, layer=, non_blocking=) -> bytes
        self.layers = pool.shape[0]
        self.cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self.jobs: list[PushJob] = []
        self._q: queue.Queue[Optional[_Layer]] = queue.Queue()
        self._last: Optional[_Layer] = None
        self._thread = threading.Thread(target=self._run, name="pdlab-push", daemon=True)
        self._thread.start()

    def begin(self, jobs: list[PushJob]) -> None:
        """Start a step whose layers go to `jobs` (an empty list: nothing to push this step)."""
        self.jobs = jobs
        self._last = None
        now = time.monotonic()
        for j in jobs:
            j.start = now

    def on_layer(self, layer: int) -> None:
        if not self.jobs:
            return
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        item = _Layer(layer, self.jobs, ev, last=layer == self.layers - 1)
        self._last = item
        self._q.put(item)

    def finish(self, timeout: float) -> list[PushJob]:
        """Wait for the step's copies; the jobs carry bytes, start, end (error on failure/timeout)."""
        jobs, self.jobs = self.jobs, []
        if not jobs:
            return []
        last = self._last
        if last is None or not last.done.wait(timeout):
            for j in jobs:
                j.error = j.error or f"push copy did not finish within {timeout:.0f}s"
        return jobs

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(item.event)
                        self._copy(item)
                    if item.last:
                        self.stream.synchronize()
                else:
                    self._copy(item)
            except Exception as e:  # noqa: BLE001 - reported on the request, never kills the worker
                for j in item.jobs:
                    j.error = f"push copy failed: {e}"
            if item.last:
                end = time.monotonic()
                for j in item.jobs:
                    j.end = end
            item.done.set()

    @torch.inference_mode()  # the engine's step runs in inference mode; peers' pools may be opened there
    def _copy(self, item: _Layer) -> None:
        for j in item.jobs:
            if j.error is None:
                t0 = time.monotonic()
                j.bytes += self.copy_fn(self.pool, j.src_blocks, j.dst, j.dst_blocks, layer=item.layer,
                                        non_blocking=self.cuda)
                j.busy += time.monotonic() - t0

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
