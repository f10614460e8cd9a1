"""One HTTP request in flight: its engine requests (one per choice; a batch of prompts is several) and the
events the bridge delivers for them, turned into what each choice adds to the response.

Every choice is released to the bridge exactly once, when it is done (finished, cut by a stop string, or
failed) or when the handler ends without it (the client went away, the server shut down): the bridge then
records what was served and aborts in the engine what is still running there.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from pdlab.api.bridge import Bridge
from pdlab.api.ledger import Release, Submission
from pdlab.api.model import ServedModel
from pdlab.api.output import Choice, Piece
from pdlab.api.protocol import ApiError, Sampling
from pdlab.serve.events import RequestDone, TokenEvent

CANCEL = -1  # queue item index: the server cancels the job (the item's event is the reason)


class Job:
    def __init__(self, bridge: Bridge, served: ServedModel, rid: str, prompts: list[list[int]], budgets: list[int],
                 sampling: Sampling, arrival: float):
        self.bridge, self.rid, self.sampling, self.arrival = bridge, rid, sampling, arrival
        self.budgets = budgets
        self.choices = [Choice(i, ids, sampling, served.eos_ids, served.text.detokenizer(ids))
                        for i, ids in enumerate(prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.released: set[int] = set()
        self.cancelled: Optional[str] = None

    def req_id(self, i: int) -> str:
        return f"{self.rid}-{i}"

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def deliver_to(i: int) -> Any:
            def deliver(event: Any) -> None:  # on the bridge's thread
                try:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))
                except RuntimeError:
                    pass  # the event loop is closed: nobody waits for it any more
            return deliver

        for c, budget in zip(self.choices, self.budgets):
            self.bridge.submit(Submission(self.req_id(c.index), list(c.prompt_ids),
                                          self.sampling.engine_params(budget), self.arrival, deliver_to(c.index)))

    def cancel(self, reason: str) -> None:
        """End the job now (on the event loop's thread): its handler answers with `reason`."""
        self.queue.put_nowait((CANCEL, reason))

    async def next(self) -> list[tuple[Choice, Piece]]:
        """Wait for the engine, then take everything it has sent: what it adds to each choice."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        news: dict[int, tuple[list[int], bool, Optional[tuple[bool, str]]]] = {}
        for i, ev in items:
            if i == CANCEL:
                self.cancelled = self.cancelled or str(ev)
                continue
            ids, last, end = news.get(i, ([], False, None))
            if isinstance(ev, TokenEvent):
                ids.append(ev.token_id)
                last = last or ev.finished
            elif isinstance(ev, RequestDone):
                end = (ev.ok, ev.error)
            news[i] = (ids, last, end)
        out = []
        for i, (ids, last, end) in sorted(news.items()):
            out.append((self.choices[i], self.choices[i].update(ids, last, end)))
        if self.cancelled:
            out += [(c, c.fail(self.cancelled)) for c in self.choices if not c.done]
        for c, _ in out:
            if c.done:
                self.release(c.index)
        return out

    def release(self, i: int, error: Optional[str] = None) -> None:
        if i in self.released:
            return
        self.released.add(i)
        c = self.choices[i]
        self.bridge.release(self.req_id(i), Release(len(c.token_ids), c.finish_reason, error or c.error))

    def release_all(self, error: str) -> None:
        """The handler is ending: every choice not yet released goes now, with `error` (it was cut short)."""
        for c in self.choices:
            self.release(c.index, None if c.done and c.error is None else error)

    def error(self) -> ApiError:
        """Why the response failed: cancelled at shutdown (503), or the engine's error (500)."""
        if self.cancelled:
            return ApiError(503, self.cancelled, type="server_error", code="cancelled")
        c = next(c for c in self.choices if c.error)
        return ApiError(500, f"the engine failed the request: {c.error}", type="server_error", code="engine_error")
