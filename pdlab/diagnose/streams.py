"""What the analysis reads of a request: a Stream (send time, delivery times, prompt tokens), made from a
diagnosis' own records or from any pdlab run's `requests.jsonl`.

A record's `token_times` has a time per token; tokens that came in one streamed chunk share its time, and
`chunks` (an HTTP client's record) says how many each chunk carried. Gaps are between deliveries (chunks),
as `vllm bench serve` computes ITL (pdlab.measure.metrics.chunk_times). A run's own records are the client's
view too: `arrival` is the send, the first token ends the prefill window.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from pdlab.measure.metrics import chunk_times

PHASES = ("background", "probe", "mixed")
OFFLINE_PHASE = "request"  # a request of another run: each is both a stream and a possible interrupter


@dataclass(frozen=True)
class Stream:
    id: str
    phase: str  # one of PHASES, or OFFLINE_PHASE
    send: float  # time.monotonic() when it was sent (a run's `arrival`)
    times: tuple[float, ...]  # one per delivery (chunk)
    prompt_tokens: int
    worker: Optional[str] = None  # the server's decode worker, where the record knows it
    response_id: Optional[str] = None  # the id the server gave the response (its SSE `id`)

    @property
    def first(self) -> Optional[float]:
        return self.times[0] if self.times else None

    @property
    def end(self) -> Optional[float]:
        return self.times[-1] if self.times else None

    @property
    def background(self) -> bool:
        """Its gaps are tagged: a diagnosis' background streams, or every request of another run."""
        return self.phase in ("background", OFFLINE_PHASE)


def prompt_tokens(rec: dict) -> int:
    """The server's count where it reported one (text prompts are counted by it), else what was sent."""
    usage = rec.get("usage") or {}
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return int(n) if isinstance(n, (int, float)) and n > 0 else int(rec.get("prompt_len") or 0)


def from_record(rec: dict) -> Stream:
    times = chunk_times(list(rec.get("token_times") or []), rec.get("chunks"))
    return Stream(str(rec.get("id")), rec.get("phase") or OFFLINE_PHASE, float(rec["arrival"]), tuple(times),
                  prompt_tokens(rec), rec.get("decode_worker"), rec.get("response_id"))


def group_records(records: list[dict]) -> dict[str, list[Stream]]:
    """Streams per variant (a diagnosis' records are one group, `diagnose`); records without an arrival or a
    token are left out: they have no window and no gap."""
    out: dict[str, list[Stream]] = defaultdict(list)
    for rec in records:
        if rec.get("arrival") is None or not rec.get("token_times"):
            continue
        out[str(rec.get("variant") or "diagnose")].append(from_record(rec))
    return {v: sorted(s, key=lambda x: x.send) for v, s in out.items()}
