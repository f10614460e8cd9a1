"""Where a request goes: the one home of the placement rules that the router (pdlab.serve.router) follows with
worker processes and the simulator (pdlab.sim.simulator) follows in virtual time.

The rules are pure functions over a small typed view of each live worker (`WorkerView`): its name and role,
its load (requests it holds), its room (free KV blocks less those promised to hand-overs heading there), its
block size, and how much of a prompt its prefix cache holds. Each caller builds the views from what it knows:
the router from the workers' reports (step records, cache events: they lag by the messages in flight), the
simulator from its engines directly.

- Unified replicas, and in pull mode prefill workers: the least loaded (ties: the first name).
- Decode workers (`choose_decode`): the one holding the most of the prompt in its prefix cache among those
  with room for the rest (a remote hand-over then moves fewer blocks, a local prefill computes fewer tokens;
  as llm-d scores KV-cache events), else the one with the most room, then the least loaded.
- Selective disaggregation (`route.remote_prefill_min_tokens`): a request whose prompt, less what its decode
  worker holds, is shorter than the threshold is prefilled by that decode worker (route `local`).
- A failed KV hand-over (`on_transfer_failure`): fail the request, or prefill it again on its decode worker
  (route `recompute`) while that worker lives (`after_failed_handover`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pdlab.constants import cdiv


def _nothing_cached(prompt: list[int]) -> int:
    return 0


@dataclass(frozen=True)
class WorkerView:
    name: str
    role: str  # unified, prefill or decode
    load: int  # requests it holds
    room: int  # free KV blocks less those promised to hand-overs not yet admitted there
    block_size: int
    cached: Callable[[list[int]], int] = _nothing_cached  # leading prompt tokens its prefix cache holds


@dataclass(frozen=True)
class DecodeChoice:
    worker: WorkerView
    cached: int  # prompt tokens it holds and need not receive or compute (0 when it has no room for the rest)


@dataclass(frozen=True)
class Arrival:
    """Where a new request goes first: `role` names what `worker` does with it (unified: prefill and decode;
    prefill: pull mode's prefill; decode: push mode's reservation before prefill, or a `local` prefill)."""

    route: str  # unified, remote or local (constants.PREFILL_ROUTES)
    role: str
    worker: Optional[WorkerView]  # None: no live worker of `role`


def least_loaded(workers: Sequence[WorkerView]) -> Optional[WorkerView]:
    return min(workers, key=lambda w: (w.load, w.name)) if workers else None


def choose_decode(workers: Sequence[WorkerView], prompt: list[int]) -> Optional[DecodeChoice]:
    """The decode worker for `prompt` among `workers` (decode views), and the prompt tokens it holds. Without
    cache reports every `cached` is 0 and this is the one with the most room."""
    best: Optional[tuple] = None
    for w in workers:
        cached = w.cached(prompt)
        fits = w.room >= cdiv(len(prompt) - cached, max(1, w.block_size))
        key = (fits, cached if fits else 0, w.room, -w.load, w.name)
        if best is None or key > best[0]:
            best = (key, DecodeChoice(w, cached if fits else 0))
    return None if best is None else best[1]


def prefill_locally(choice: Optional[DecodeChoice], prompt_len: int, remote_min_tokens: int) -> bool:
    """Selective routing: whether the chosen decode worker prefills the prompt itself (fewer uncached tokens
    than the threshold; a threshold of 0 sends every prompt to a prefill worker)."""
    return choice is not None and remote_min_tokens > 0 and prompt_len - choice.cached < remote_min_tokens


def place_arrival(workers: Sequence[WorkerView], prompt: list[int], mode: str,
                  remote_min_tokens: int = 0) -> Arrival:
    """Where a request goes when it arrives, from the views of the live workers."""
    unified = [w for w in workers if w.role == "unified"]
    if unified:
        return Arrival("unified", "unified", least_loaded(unified))
    decoders = [w for w in workers if w.role == "decode"]
    if remote_min_tokens:
        choice = choose_decode(decoders, prompt)
        if prefill_locally(choice, len(prompt), remote_min_tokens):
            return Arrival("local", "decode", choice.worker)
    if mode == "pull":  # the decode worker is chosen once the prefill is done (choose_decode)
        return Arrival("remote", "prefill", least_loaded([w for w in workers if w.role == "prefill"]))
    choice = choose_decode(decoders, prompt)  # push: the decode blocks are reserved before the prefill starts
    return Arrival("remote", "decode", choice.worker if choice else None)


def after_failed_handover(policy: str, decode_alive: bool) -> str:
    """What becomes of a request whose KV hand-over failed (once nothing writes into its decode blocks any
    more): `recompute` on its decode worker when the policy says so and that worker lives, else `fail`."""
    return "recompute" if policy == "recompute" and decode_alive else "fail"


def mirrors_caches(disaggregated: bool, decode_workers: int, selective: bool, prefix_caching: bool) -> bool:
    """Whether the decode workers' prefix caches inform the choice of decode worker (the router mirrors them
    from cache events, pdlab.serve.mirror): with selective routing, or with several decode workers and the
    prefix cache on. Otherwise every view's `cached` is 0."""
    return disaggregated and (selective or (decode_workers > 1 and prefix_caching))
