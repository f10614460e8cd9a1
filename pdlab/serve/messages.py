"""Control messages between the router (main process) and workers.

Every message is a typed dataclass, sent as msgpack `[type_name, {field: value}]` of plain data
(ints, floats, strings, lists, dicts). Never pickle: decoding a frame can only build one of the
dataclasses registered here, and it rejects unknown types, missing or extra fields.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Optional

import msgpack

MESSAGES: dict[str, type] = {}


def message(cls: type) -> type:
    cls = dataclass(cls)
    MESSAGES[cls.__name__] = cls
    return cls


class MessageError(ValueError):
    """A frame that is not a valid pdlab message."""


def digest(classes: Any) -> str:
    """A short digest of the messages `classes` define (each one's name and field names, in order): two
    processes speak the same messages when their digests agree (pdlab.serve.node_messages.PROTOCOL)."""
    shape = sorted([c.__name__, [f.name for f in fields(c)]] for c in classes)
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:12]


# ---- router -> worker ---------------------------------------------------------------------------


@message
class Submit:
    """A new request for a unified or prefill worker. In push mode `push` names the decode blocks
    reserved for it: {"dst": worker, "pool": its pool handle, "blocks": [...], "skip": cached blocks}."""

    req_id: str
    prompt_ids: list
    params: dict
    push: Optional[dict] = None


@message
class Reserve:
    """Push mode: a decode worker reserves blocks for a request before its prefill runs."""

    req_id: str
    prompt_ids: list
    params: dict


@message
class Pull:
    """Pull mode: reserve, read the KV from the prefill worker's pool `src_pool`, then admit."""

    req_id: str
    prompt_ids: list
    params: dict
    first_token: int
    src: str
    src_pool: dict  # the prefill worker's exported pool handle
    src_blocks: list


@message
class Admit:
    """Push mode: the KV is in the reserved blocks; start decoding with `first_token`. `written`: the decode
    blocks the prefill worker wrote (checked against the reservation before anything is read from them)."""

    req_id: str
    first_token: int
    written: list = field(default_factory=list)


@message
class Renew:
    """Decode worker, push mode: these requests' prefill workers are alive and still computing them: their
    leases start over (the queue before a prefill is not a transfer that failed)."""

    req_ids: list


@message
class Recompute:
    """Decode worker: the request's KV hand-over failed; let go of its reservation (once nothing writes into
    it any more) and prefill the request here. `first_token`, when the prefill worker sampled it, is kept."""

    req_id: str
    prompt_ids: list
    params: dict
    first_token: Optional[int] = None


@message
class Release:
    """Prefill worker: the decode side has the KV, free the request's blocks."""

    req_id: str


@message
class Abort:
    """Drop a request wherever it is (running, handed off, reserved)."""

    req_id: str


@message
class Query:
    """Ask for a `Stats` reply (free blocks etc.)."""

    token: int = 0


@message
class ResetPrefixCache:
    token: int = 0


@message
class Stop:
    pass


# ---- worker -> router ---------------------------------------------------------------------------


@message
class Ready:
    worker: str
    pid: int
    pool: Optional[dict]  # {"name", "shape", "dtype"} when the pool is attachable, else None
    kv_blocks: int
    block_size: int
    fingerprint: dict = field(default_factory=dict)  # disaggregated roles: pdlab.kv.fingerprint, checked at pairing
    # which CPU kernels its engine runs and why (pdlab.engine.kernel_check.Choice.to_dict by kernel; {} when no
    # model runs: a timed engine)
    kernels: dict = field(default_factory=dict)
    # the box's pace at its start (pdlab.timing.pace.Pace.to_raw: its two halves and the read it timed): CPU
    # workers running a model; None for the rest
    pace: Optional[dict] = None


@message
class Tokens:
    """Tokens sampled in one step: items are [req_id, token_id, index, finished]."""

    worker: str
    items: list
    t: float = 0.0  # when the worker sampled them (its step's end): the token times of every metric


@message
class Step:
    worker: str
    record: dict


@message
class PrefillDone:
    """A prefill worker sampled the first token; its blocks stay held until `Release`.
    `transfer` is the push record when the KV was already written to the decode pool."""

    worker: str
    req_id: str
    first_token: int
    blocks: list
    cached_tokens: int
    prefill_start: float
    prefill_end: float
    transfer: Optional[dict] = None
    written: list = field(default_factory=list)  # push: the decode blocks written (for Admit)


@message
class Reserved:
    worker: str
    req_id: str
    blocks: list  # blocks to fill, in order
    skip: int  # leading blocks the decode side already holds (prefix cache)


@message
class Transferred:
    """Decode worker: the KV arrived (pull: it read it; push: it admitted) and decoding started."""

    worker: str
    req_id: str
    admitted: float
    record: Optional[dict] = None


@message
class TransferFailed:
    """A KV hand-over failed or timed out (decode: lease ran out, copy failed, a bad notice; prefill: the push
    failed). The decode side keeps a push reservation's blocks until told what to do: the prefill worker may
    still be writing into them."""

    worker: str
    req_id: str
    reason: str
    first_token: Optional[int] = None  # a prefill worker's: the token it sampled


@message
class Aborted:
    """Prefill worker, push mode: it let go of a request whose push had not ended; it writes no more into the
    decode blocks reserved for it (the fence the decode side waits for before reusing them)."""

    worker: str
    req_id: str


@message
class CacheEvents:
    """Decode worker, selective routing: prefix-cache keys it stored and dropped since the last report, so
    the router can mirror what it holds (llm-d's KV events)."""

    worker: str
    stored: list
    removed: list


@message
class Finished:
    worker: str
    req_id: str
    ok: bool
    error: str = ""
    output_ids: list = field(default_factory=list)
    cached_tokens: int = 0
    phases: dict = field(default_factory=dict)  # worker-side timestamps (prefill_start, prefill_end)


@message
class Stats:
    worker: str
    token: int
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    requests: int  # requests the engine still knows (running, waiting, handed off, reserved)
    leak: str = ""  # why the engine is not idle, when it has no requests but holds blocks


@message
class Heartbeat:
    worker: str
    t: float
    loop_t: float  # last time the main loop went round (a stale one means a hung step)


@message
class Fatal:
    worker: str
    reason: str


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise MessageError(f"not a pdlab message: {type(msg)!r}")
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}  # not asdict: it copies a prompt token by token
    return msgpack.packb([name, body], use_bin_type=True, default=_plain)


def _plain(obj: Any) -> Any:
    """A value msgpack cannot pack by itself: a dataclass nested in a field goes as its dict; anything else
    is an error, as it was."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    raise TypeError(f"cannot send {type(obj).__name__} in a message")


def decode(frame: bytes) -> Any:
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad input
        raise MessageError(f"undecodable frame: {e}") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
        raise MessageError("frame is not [type, fields]")
    name, body = obj
    cls = MESSAGES.get(name)
    if cls is None:
        raise MessageError(f"unknown message type {name!r}")
    names = {f.name for f in fields(cls)}
    extra = set(body) - names
    if extra:
        raise MessageError(f"{name}: unknown fields {sorted(extra)}")
    try:
        return cls(**body)
    except TypeError as e:
        raise MessageError(f"{name}: {e}") from None
