"""What the router reports to the harness: tokens, finished requests, engine steps, transfers, failed workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TokenEvent:
    req_id: str
    token_id: int
    t: float  # when the worker sampled it (its step's end), time.monotonic(): system-wide, one clock
    index: int
    finished: bool
    worker: str
    received: float = 0.0  # when the router read it; received - t is the delivery lag (a health figure)


@dataclass
class RequestDone:
    req_id: str
    ok: bool
    error: str
    output_ids: list[int]
    cached_tokens: int
    prefill_worker: Optional[str]
    decode_worker: Optional[str]
    phases: dict  # queued, prefill_start, prefill_end, transfer_start, transfer_end, admitted, sent
    route: str = "unified"  # where its prompt was prefilled: one of constants.PREFILL_ROUTES
    # what an HTTP client of an external server saw (pdlab.external.client): `chunks` (tokens per streamed
    # chunk: ITL per chunk), `usage` (the server's token counts), `prompt_as`; None for pdlab's own engine
    client: Optional[dict] = None


@dataclass
class StepEvent:
    worker: str
    role: str
    record: dict


@dataclass
class TransferEvent:
    record: dict


@dataclass
class WorkerFailed:
    worker: str
    reason: str
