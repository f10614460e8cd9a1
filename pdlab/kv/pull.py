"""Pull mode: read a request's KV from the prefill worker's pool while this decode worker keeps decoding.

Copying inside the worker's loop stalls every running decode for the length of the copy, which inflates
the disaggregated ITL (vLLM's connectors load KV asynchronously for the same reason). So a pull is
submitted here and the loop polls for it: the request is admitted once its KV has landed.

- CPU: one copy thread per worker takes jobs from a queue (torch and numpy copies release the GIL). On a
  worker pinned to one core the copy shares that core with the decode steps: they interleave, neither
  waits for the other to finish.
- CUDA: the copy is issued on a side stream, ordered after the work already queued on the current stream,
  and an event recorded after it is polled with `query()`; `start` is when it was issued, `end` when the
  loop saw the event done (precise to one loop iteration), `busy` the copy's own time on the device.

A job's destination blocks must stay reserved until the job is reported done, also when the request
was aborted or timed out meanwhile: a copy still writing into blocks that another request got would
corrupt that request's KV. `cancel` only skips a copy that has not started.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pdlab.kv.copy import copy_blocks


@dataclass
class PullJob:
    req_id: str
    src: torch.Tensor  # the prefill worker's exchange tensor (pool or host mirror)
    src_blocks: list[int]
    dst_blocks: list[int]  # blocks of this worker's pool, reserved for the request
    submitted: float = 0.0
    bytes: int = 0
    start: float = 0.0  # time.monotonic(): the copy itself, not the wait in the queue
    end: float = 0.0
    busy: float = 0.0
    error: Optional[str] = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)  # CPU: set by the copy thread
    event: Any = None  # CUDA: the completion event
    timing: Any = None  # CUDA: (start event, end event) for `busy`


class PullCopier:
    def __init__(self, pool: torch.Tensor, copy_fn: Callable[..., int] = copy_blocks):
        self.pool = pool
        self.copy_fn = copy_fn  # (src, src_blocks, dst, dst_blocks, non_blocking=) -> bytes; tests slow it down
        # a host-driven copy (nixl: blocks until the transfer is done) runs on the copy thread, also on CUDA
        self.cuda = pool.device.type == "cuda" and not getattr(copy_fn, "host_driven", False)
        self.jobs: list[PullJob] = []  # submitted, not yet returned by poll(), oldest first
        self._wake = threading.Event()
        self._q: queue.Queue[Optional[PullJob]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None
        if not self.cuda:
            self._thread = threading.Thread(target=self._run, name="pdlab-pull", daemon=True)
            self._thread.start()

    def submit(self, req_id: str, src: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> PullJob:
        job = PullJob(req_id, src, list(src_blocks), list(dst_blocks), submitted=time.monotonic())
        if self.cuda:
            self._issue(job)  # raises only if nothing was issued
        else:
            self._q.put(job)
        self.jobs.append(job)
        return job

    def cancel(self, job: PullJob) -> None:
        """Skip the copy if it has not started (the job is still reported by poll)."""
        job.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def poll(self) -> list[PullJob]:
        """The jobs that ended since the last call (error set on failure), in submission order."""
        ended, still = [], []
        for j in self.jobs:
            (ended if self._ended(j) else still).append(j)
        self.jobs = still
        return ended

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some job ends (for a loop that has nothing else to do)."""
        if self.cuda:
            if not any(self._ended(j) for j in self.jobs):
                time.sleep(min(timeout, 5e-4))
            return
        self._wake.clear()
        if self.jobs and not any(j.done.is_set() for j in self.jobs):
            self._wake.wait(timeout)

    def _ended(self, job: PullJob) -> bool:
        if not self.cuda:
            return job.done.is_set()
        if job.done.is_set():
            return True
        try:
            if not job.event.query():
                return False
            if job.timing is not None:
                job.busy = job.timing[0].elapsed_time(job.timing[1]) / 1e3
        except Exception as e:  # noqa: BLE001 - a device error fails this request only
            job.error = job.error or _describe(e)
        job.end = time.monotonic()
        job.done.set()
        return True

    # ---- CUDA: a side stream ----
    @torch.inference_mode()
    def _issue(self, job: PullJob) -> None:
        job.start = time.monotonic()
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # after what the pool already awaits
        with torch.cuda.stream(stream):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(stream)
            try:
                job.bytes = self.copy_fn(job.src, job.src_blocks, self.pool, job.dst_blocks, non_blocking=True)
                t1.record(stream)
                job.timing = (t0, t1)
            except Exception as e:  # noqa: BLE001 - copies issued before the error may still be running
                job.error = _describe(e)
            job.event = torch.cuda.Event()
            job.event.record(stream)  # the blocks are free to reuse only once this has passed

    # ---- CPU: a copy thread ----
    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if not job.cancelled:
                job.start = time.monotonic()
                try:
                    with torch.inference_mode():  # as PushCopier: no autograd bookkeeping on the pools
                        job.bytes = self.copy_fn(job.src, job.src_blocks, self.pool, job.dst_blocks,
                                                 non_blocking=False)
                except Exception as e:  # noqa: BLE001 - reported on the request, never kills the worker
                    job.error = _describe(e)
                job.end = time.monotonic()
                job.busy = job.end - job.start
            else:
                job.error = "cancelled before it started"
            job.done.set()
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop: copies not started are skipped, a running one is waited for (up to `timeout`)."""
        for j in self.jobs:
            j.cancelled = True
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
        elif self.stream is not None:
            self.stream.synchronize()


def _describe(e: Exception) -> str:
    return str(e) or type(e).__name__  # never empty: an empty error would read as success
