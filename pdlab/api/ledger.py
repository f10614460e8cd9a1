"""Server-side truth of pdlab serve, written as a run writes it (docs/design.md, section 4).

Every engine request the server submits is followed from its arrival (when its HTTP request came in) to
the record of what was served: the tokens its client got and the times the workers stamped them, so the
record reads like any run's (`requests.jsonl`: TTFT, ITL, phases, workers, route). A request is recorded
once both sides are done with it: the engine (its RequestDone) and the HTTP side (its `release`, which says
how many tokens were served, the finish reason and any error); a stop string cuts a record where the text
was cut. Engine steps and KV transfers go to `steps.jsonl` and `transfers.jsonl` as they come; `trace.json`
is written from the files at the end.

A served request has no nominal rate: records carry `rate: 0` (no rate: served) and the variant's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pdlab.measure.metrics import build_request_record
from pdlab.measure.records import RunDir, load_run
from pdlab.measure.trace import build_trace
from pdlab.recipe.slo import SLO

SERVED_RATE = 0.0  # `rate` of a served request's records: it arrived when its client sent it, at no set rate
SLO_KEYS = ("slo_ttft_ok", "slo_itl_ok", "slo_ok", "slo_itl_value", "slo_tpot_ok")


@dataclass(frozen=True)
class Submission:
    """One engine request: what the engine is asked, and where its events go (`deliver`, thread-safe)."""

    req_id: str
    prompt_ids: list
    params: dict  # pdlab.engine.SamplingParams' fields
    arrival: float  # time.monotonic() when its HTTP request came in
    deliver: Callable[[Any], None]


@dataclass(frozen=True)
class Release:
    """The HTTP side is done with a request: `served` tokens went to its client."""

    served: int
    finish_reason: Optional[str]
    error: Optional[str]


@dataclass
class Live:
    """A request the bridge follows: its token stamps as they come, and how each side ended it."""

    sub: Submission
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)
    done: Any = None  # its RequestDone
    release: Optional[Release] = None

    @property
    def settled(self) -> bool:
        return self.done is not None and self.release is not None


class Ledger:
    def __init__(self, rd: RunDir, variant: str, slo: SLO):
        """`slo`: the recipe's; a relative one (`ttft: 5x`) has no targets without a run's calibration, so
        then the records carry no SLO verdict (null)."""
        self.rd, self.variant = rd, variant
        self.slo = slo if not slo.relative else slo.resolved(1.0, 1.0)
        self.judge = not slo.relative

    def request(self, live: Live, why: Optional[str] = None) -> dict:
        """The record of a settled request, or, with `why` (the server stopped), of one that is not."""
        d, r, sub = live.done, live.release, live.sub
        n = r.served if r is not None else len(live.output_ids)
        error = r.error if r is not None else (why or "not released")
        workers = None
        if d is not None:
            workers = ({"prefill": d.prefill_worker, "decode": d.decode_worker} if d.decode_worker
                       else {"unified": d.prefill_worker})
        rec = build_request_record(
            variant=self.variant, rate=SERVED_RATE, id=sub.req_id, prompt_ids=sub.prompt_ids,
            output_ids=live.output_ids[:n], arrival=sub.arrival, token_times=live.token_times[:n], slo=self.slo,
            error=error, phases=d.phases if d is not None else None, workers=workers,
            cached_tokens=d.cached_tokens if d is not None else 0,
            delivery_lag=[b - a for a, b in zip(live.token_times[:n], live.received[:n])],
            route=d.route if d is not None else None)
        if not self.judge:
            rec.update({k: None for k in SLO_KEYS})
        rec["finish_reason"] = r.finish_reason if r is not None else None
        if d is not None and len(live.output_ids) > n:
            rec["engine_output_len"] = len(live.output_ids)  # generated past what was served (a stop string)
        self.rd.append("requests", [rec])
        return rec

    def steps(self, records: list[dict]) -> None:
        self.rd.append("steps", [{"variant": self.variant, "rate": SERVED_RATE, "repeat": 0, **r} for r in records])

    def transfers(self, records: list[dict]) -> None:
        self.rd.append("transfers", [{"variant": self.variant, "rate": SERVED_RATE, "repeat": 0, **r}
                                     for r in records])

    def close(self) -> None:
        """Flush the record files and write trace.json from them."""
        self.rd.close()
        run = load_run(self.rd.path)
        self.rd.write_trace(build_trace(run.requests, run.steps, run.transfers))
