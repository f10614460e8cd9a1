"""The router's record of one request: where it is (an explicit state), which workers have it, what it produced.

    QUEUED ──► PREFILLING ──► TRANSFERRING ──► DECODING ──► DONE
     (push:      │  ▲   │         │                           FAILED (from any state)
     reserving)  │  │   └─► FENCED ◄┘ (push: the hand-over failed or the client gave up while the prefill
                 │  └── recompute ─┘  worker may still write into the decode blocks; it ends once it stopped)
                 └──────────────────► DECODING (unified, local and recompute routes: their first token came)

`phases` keeps the timestamps the records carry (queued, prefill_start, prefill_end, transfer_start,
transfer_end, admitted, recompute, sent); the state, not the presence of a timestamp, says where it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class ReqState(enum.Enum):
    QUEUED = "queued"  # push: its decode blocks are being reserved; no prefill worker has it yet
    PREFILLING = "prefilling"  # a worker has it to prefill (unified, prefill, or its decode worker)
    TRANSFERRING = "transferring"  # prefilled remotely; its KV is on the way to its decode worker
    DECODING = "decoding"  # admitted by its decode worker, or (not remote) its first token came
    FENCED = "fenced"  # push: ending or recomputing once its prefill worker stopped writing (`reason`)
    DONE = "done"
    FAILED = "failed"


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: dict
    phases: dict  # timestamps for the records (see the module docstring)
    state: ReqState = ReqState.QUEUED
    route: str = "remote"  # where its prompt is prefilled (constants.PREFILL_ROUTES)
    prefill: Optional[str] = None
    decode: Optional[str] = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token: Optional[int] = None
    handoff_t: float = 0.0  # when the KV hand-over began (its timeout's clock)
    reason: Optional[str] = None  # FENCED: why its hand-over failed (or the client's reason)
    cancelled: Optional[str] = None  # Router.abort: why the client gave it up; it ends once nothing writes for it

    @property
    def awaits_kv(self) -> bool:
        """Prefilled remotely and not admitted yet: its decode worker has blocks promised to it."""
        return self.route == "remote" and self.state in (ReqState.QUEUED, ReqState.PREFILLING,
                                                         ReqState.TRANSFERRING, ReqState.FENCED)

    @property
    def remote_prefilling(self) -> bool:
        """A prefill worker has it and has not reported its prefill done (push: it may be writing into the
        decode blocks)."""
        return self.route == "remote" and self.state is ReqState.PREFILLING
