"""The measurement of `pdlab diagnose URL`: its phases, on one event loop (pdlab.external.loop), every send
through the plan's gate (pdlab.diagnose.budget).

- steady: `concurrency` background streams, short prompts and long outputs, each renewed when it ends; they
  run alone for `steady_s` once all of them stream, and go on through the other phases;
- probes: prompts of growing length, one at a time: the next is sent only when the previous has its first
  token and `probe_gap_s` more have passed, so each prefill window (send to first token) is alone;
- mixed (optional): the user's prompt lengths with Poisson arrivals, windows that may overlap.

Tokens are stamped as pdlab's endpoint client stamps them (pdlab.external.stream: time.monotonic() when the
SSE line was read; a chunk's tokens share its time). A failed request stops the diagnosis, except a
probe the server refuses as too long (HTTP 400/413/422): longer probes are then skipped. Ctrl-C or the
duration cap (`stop`) cuts every stream at once and keeps what was measured.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from pdlab.diagnose.budget import Budget, Exhausted
from pdlab.diagnose.connect import Target
from pdlab.diagnose.plan import Plan
from pdlab.diagnose.prompts import prompt
from pdlab.diagnose.server_load import ServerLoad
from pdlab.external.probe import redact
from pdlab.external.stream import StreamError, chunk_text, chunk_tokens, completion_body, stream_completion

TOO_LONG_CODES = (400, 413, 422)  # how servers refuse a prompt over their context
START_POLL_S = 0.05


@dataclass
class Sent:
    """One request as it goes: what was asked, and what came back when."""

    id: str
    phase: str
    prompt_len: int
    max_tokens: int
    body: dict = field(repr=False)
    probe: Optional[int] = None
    arrival: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    response_id: Optional[str] = None
    usage: Optional[dict] = None
    error: Optional[str] = None
    status: Optional[int] = None
    cancelled: bool = False

    def record(self) -> dict:
        """Its requests.jsonl line (the fields pdlab.diagnose.streams reads, as a run's records have them)."""
        return {"variant": "diagnose", "id": self.id, "phase": self.phase, "probe": self.probe,
                "prompt_len": self.prompt_len, "max_tokens": self.max_tokens, "arrival": self.arrival,
                "token_times": list(self.token_times), "chunks": list(self.chunks), "output_len": len(self.token_times),
                "usage": self.usage, "response_id": self.response_id, "prompt_as": "text" if isinstance(
                    self.body.get("prompt"), str) else "token_ids",
                "ok": self.error is None and not self.cancelled and bool(self.token_times), "error": self.error,
                "cancelled": self.cancelled}


class Runner:
    def __init__(self, plan: Plan, target: Target, session: aiohttp.ClientSession):
        """Build every probe and mixed prompt now, off the loop: drawing thousands of ids there would delay the
        stamps of the streams."""
        self.plan, self.target, self.session, self.o = plan, target, session, plan.options
        self.budget = Budget(plan)
        self.sent: list[Sent] = []
        self.phases: dict[str, list[float]] = {}
        self.skipped: Optional[str] = None  # why longer probes were skipped
        self.partial: Optional[str] = None  # why the diagnosis was cut short
        self.load = ServerLoad(session, target.url, target.headers, plan.metrics_polls) if plan.metrics_polls else None
        self._n = 0
        # every run draws other prompts: a prefix cache must never hold a probe, not even from an earlier diagnosis
        # (the same --seed gives the same mixed phase, not the same prompts)
        self.nonce = int.from_bytes(os.urandom(8), "little")
        self._tasks: set[asyncio.Task] = set()
        self._main: Optional[asyncio.Task] = None
        self._stop: Optional[asyncio.Event] = None
        self._probes = [self._new("probe", p.prompt_len, p.max_tokens, probe=p.index) for p in plan.probes]
        self._mixed = [self._new("mixed", n, self.o.mixed_output) for n in plan.mixed]

    def _new(self, phase: str, n: int, max_tokens: int, probe: Optional[int] = None) -> Sent:
        self._n += 1
        body = completion_body(prompt(n, (self.nonce, self._n), self.target.prompt_as == "text"),
                               max_tokens, stream=True, model=self.target.model)
        return Sent(f"{phase}-{self._n}", phase, n, max_tokens, body, probe)

    # ---- the phases ----
    async def run(self) -> None:
        self._main, self._stop = asyncio.current_task(), asyncio.Event()
        try:
            if self.load is not None:
                self._spawn(self.load.run())
            self._spawn(self._watch_deadline())
            slots = [self._spawn(self._slot()) for _ in range(self.o.concurrency)]
            await self._until_streaming(slots)
            self.phases["steady"] = [time.monotonic()]
            await self._pause(self.o.steady_s)
            self.phases["steady"].append(time.monotonic())
            self.phases["probes"] = [time.monotonic()]
            for s in self._probes:
                if self.budget.stopped or self.skipped:
                    break
                await self._send(s)
                await self._pause(self.o.probe_gap_s)
            self.phases["probes"].append(time.monotonic())
            if self._mixed and not self.budget.stopped:
                await self._mixed_phase()
        except Exhausted as e:
            self.partial = self.partial or str(e)  # a cap: what was measured is kept
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # stopped (Ctrl-C, the duration cap, an error): the end still runs
        finally:
            await self._end()

    async def _mixed_phase(self) -> None:
        rng = random.Random(self.o.seed)
        self.phases["mixed"] = [time.monotonic()]
        sends = []
        for s in self._mixed:
            await self._pause(rng.expovariate(self.o.mixed_rate))
            if self.budget.stopped:
                break
            sends.append(self._spawn(self._send(s)))
        await asyncio.gather(*sends, return_exceptions=True)
        self.phases["mixed"].append(time.monotonic())

    async def _slot(self) -> None:
        """One background stream, renewed whenever it ends, until the diagnosis stops. A renewal the plan does not
        allow ends the diagnosis: without its background streams, probes measure nothing."""
        while not self.budget.stopped:
            s = self._new("background", self.o.background_prompt, self.o.background_output)
            try:
                await self._send(s)
            except Exhausted as e:
                if not self.budget.stopped:
                    self._request_stop(f"{e}, so the diagnosis stopped")
                return

    async def _until_streaming(self, slots: list[asyncio.Task]) -> None:
        """Wait until every background stream has its first token (or its slot has ended)."""
        while not self.budget.stopped:
            streaming = [s for s in self.sent if s.phase == "background" and s.token_times]
            if len(streaming) >= self.o.concurrency or all(t.done() for t in slots):
                return
            await asyncio.sleep(START_POLL_S)

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless the diagnosis stops first."""
        assert self._stop is not None
        try:
            await asyncio.wait_for(self._stop.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    async def _watch_deadline(self) -> None:
        while True:
            left = self.budget.deadline - time.monotonic()
            if self.budget.started is not None and left <= 0:
                self._request_stop(f"the duration cap ({self.plan.caps.duration_s:g} s) was reached")
                return
            await asyncio.sleep(min(max(left, 0.01), 0.5))

    # ---- one request ----
    async def _send(self, s: Sent) -> None:
        s.arrival = await self.budget.take(s.phase, s.prompt_len + s.max_tokens)
        self.sent.append(s)
        as_ids = self.target.output_as == "token_ids"

        def on_chunk(event: dict, t: float) -> None:
            n = len(chunk_tokens(event)) if as_ids else int(bool(chunk_text(event)))
            if n:
                s.response_id = s.response_id or (str(event["id"]) if event.get("id") is not None else None)
                s.token_times.extend([t] * n)
                s.chunks.append(n)

        try:
            final = await stream_completion(self.session, f"{self.target.url}/completions", s.body, on_chunk,
                                            headers=self.target.headers)
            s.usage = final.get("usage")
        except StreamError as e:
            s.error, s.status = redact(str(e), self._key()), e.status
            if s.phase == "probe" and e.status in TOO_LONG_CODES:
                self.skipped = f"the server refused a {s.prompt_len}-token probe: {s.error}"
            else:
                self._request_stop(f"a request failed, so nothing more was sent: {s.error}")
        except asyncio.CancelledError:
            s.cancelled = True
            raise
        finally:
            await self.budget.release()

    def _key(self) -> Optional[str]:
        auth = self.target.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    # ---- stopping ----
    def _spawn(self, coro: Any) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _request_stop(self, why: Optional[str]) -> None:
        """Nothing more is sent; every stream is cut (from the loop's thread)."""
        if why is not None and self.partial is None:
            self.partial = why
        self.budget.stop(why or "the plan was done")
        if self._stop is not None:
            self._stop.set()
        for t in list(self._tasks):
            t.cancel()
        if why is not None and self._main is not None and self._main is not asyncio.current_task():
            self._main.cancel()

    async def stop(self, why: str) -> None:
        """Ctrl-C: stop at once (called on the loop from the main thread)."""
        self._request_stop(why)
        await self.budget.wake()

    async def _end(self) -> None:
        self._request_stop(None)
        await self.budget.wake()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for phase in self.phases.values():
            if len(phase) == 1:
                phase.append(time.monotonic())
