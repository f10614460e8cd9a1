"""The GPUs this process may hand to workers, named as CUDA_VISIBLE_DEVICES names them.

A recipe's `cuda:N` is the N-th GPU *this process* sees. A worker is started with CUDA_VISIBLE_DEVICES set to
the entries of its own GPUs (then its peers'), so each entry must be passed on exactly as the parent got it:
an index (`3`), a GPU UUID (`GPU-8f3c...`) or a MIG instance (`MIG-1b2a...` or `MIG-GPU-<uuid>/<gi>/<ci>`).
Reading only the integer entries, as pdlab once did, silently drops UUID and MIG entries.

CUDA's own rule is followed: the list ends at the first entry that is not valid (an out-of-range index, an
unknown form). An empty CUDA_VISIBLE_DEVICES hides every GPU. Nothing here creates a CUDA context: the count
and the peer-access matrix come from NVML (pynvml), which tests replace with a fake.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

_UUID_PREFIXES = ("GPU-", "MIG-")


def visible_entries(env: Optional[str], count: int) -> list[str]:
    """The GPU entries a process sees: CUDA_VISIBLE_DEVICES (`env`, None when unset) against `count` GPUs.

    Indices must be below `count`; UUID and MIG entries are kept as they are (NVML counts physical GPUs,
    so a UUID cannot be checked against the count). The first invalid entry ends the list, as in CUDA.
    """
    if env is None:
        return [str(i) for i in range(count)]
    out: list[str] = []
    for raw in env.split(","):
        entry = raw.strip()
        if entry.isdigit():
            if int(entry) >= count:
                break
            entry = str(int(entry))
        elif not entry.startswith(_UUID_PREFIXES):
            break
        if entry in out:  # CUDA rejects a repeated device: the list ends there
            break
        out.append(entry)
    return out


def nvml_count() -> int:
    """Physical GPUs on this machine per NVML; 0 without a driver or without pynvml."""
    try:
        # deferred: pynvml
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


def gpu_entries() -> list[str]:
    """The GPUs this process may use, by visible index (no CUDA context is created)."""
    return visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"), nvml_count())


def nvml_peer_access(a: str, b: str) -> Optional[bool]:
    """Whether GPU entries `a` and `b` can read and write each other's memory (NVML's P2P status); None when
    NVML cannot say (no pynvml, a MIG entry, an old driver): the caller decides what unknown means."""
    try:
        # deferred: pynvml
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [_nvml_handle(pynvml, e) for e in (a, b)]
            ok = True
            for index in (pynvml.NVML_P2P_CAPS_INDEX_READ, pynvml.NVML_P2P_CAPS_INDEX_WRITE):
                status = pynvml.nvmlDeviceGetP2PStatus(handles[0], handles[1], index)
                ok = ok and status == pynvml.NVML_P2P_STATUS_OK
            return ok
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML could not answer
        return None


def _nvml_handle(pynvml: object, entry: str) -> object:
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))  # type: ignore[attr-defined]
    if entry.startswith("GPU-"):
        return pynvml.nvmlDeviceGetHandleByUUID(entry)  # type: ignore[attr-defined]
    raise ValueError(f"NVML peer access is not defined for {entry!r}")


PeerAccess = Callable[[str, str], Optional[bool]]


def no_peer_pairs(pairs: list[tuple[str, str]], peer_access: PeerAccess = nvml_peer_access) -> list[tuple[str, str]]:
    """The pairs of distinct GPU entries between which a cuda-ipc copy would not be a peer copy.
    Unknown (None) counts as no peer access: the host transport is the safe choice there."""
    bad = []
    for a, b in dict.fromkeys(pairs):
        if a != b and not peer_access(a, b):
            bad.append((a, b))
    return bad


def rank_device(visible: tuple[str, ...] | list[str], rank: int) -> str:
    """The torch device of tensor-parallel rank `rank` of a worker started with CUDA_VISIBLE_DEVICES=`visible`
    (the launcher lists a worker's own GPUs first, in rank order, then its peers'): `cuda:<rank>`, or `cpu`
    for a CPU worker. Never a hard-coded cuda:0 (and never the recipe's index, which names the parent's view)."""
    if not visible:
        return "cpu"
    if not 0 <= rank < len(visible):
        raise ValueError(f"rank {rank} has no GPU among the {len(visible)} visible ({','.join(visible)})")
    return f"cuda:{rank}"
