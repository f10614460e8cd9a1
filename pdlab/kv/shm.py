"""KV pools in POSIX shared memory, exposed as torch tensors.

A segment is a file in /dev/shm named `pdlab-...`, mapped with mmap and wrapped by `torch.frombuffer`,
so two processes see the same bytes: the decode worker's pool lives here and the prefill worker
attaches to it by name (and the other way round for pull mode).

Why not `multiprocessing.shared_memory`: on Python < 3.13 every *attaching* process registers the
segment with its resource tracker, which unlinks it when that process exits - a reader would destroy the
owner's pool. Plain /dev/shm + mmap keeps ownership explicit: the creator unlinks.

Cleanup: every segment this process created is in a registry, unlinked at interpreter exit and by
`unlink_all()`, which workers call from their SIGTERM/SIGINT handlers. A SIGKILLed owner cannot clean
up, so names carry a per-run prefix and the launcher sweeps `sweep(prefix)` when it stops.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch

from pdlab.constants import SHM_DIR

PREFIX = "pdlab-"

_created: set[str] = set()
_lock = threading.Lock()


def _path(name: str) -> str:
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"shared-memory name {name!r} must start with {PREFIX!r} and contain no '/'")
    return os.path.join(SHM_DIR, name)


def new_name(tag: str = "") -> str:
    """A fresh segment name: `pdlab-<tag>-<random>`."""
    tag = tag.strip("-")
    return f"{PREFIX}{tag + '-' if tag else ''}{secrets.token_hex(6)}"


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class ShmTensor:
    """A tensor backed by a named shared-memory segment. `owner` segments are unlinked by `unlink()`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor
    owner: bool
    _mm: mmap.mmap

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * dtype_size(self.dtype)

    def unlink(self) -> None:
        """Remove the name (the owner's job); mappings stay valid until every process drops them."""
        unlink(self.name)

    def close(self) -> None:
        """Drop this process's mapping, if no tensor view of it is still alive (else the GC will)."""
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes when that view does


def create(shape: Sequence[int], dtype: torch.dtype, name: str | None = None, tag: str = "") -> ShmTensor:
    """Create a zero-filled segment of `shape`/`dtype` and register it for cleanup."""
    shape = tuple(int(s) for s in shape)
    name = name or new_name(tag)
    nbytes = max(1, prod(shape) * dtype_size(dtype))
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    with _lock:
        _created.add(name)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return ShmTensor(name, shape, dtype, _view(mm, shape, dtype), True, mm)


def attach(name: str, shape: Sequence[int], dtype: torch.dtype) -> ShmTensor:
    """Map an existing segment created by another process. Raises FileNotFoundError if it is gone."""
    shape = tuple(int(s) for s in shape)
    nbytes = max(1, prod(shape) * dtype_size(dtype))
    fd = os.open(_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"segment {name} holds {size} bytes, {shape} {dtype} needs {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return ShmTensor(name, shape, dtype, _view(mm, shape, dtype), False, mm)


def _view(mm: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=count).view(shape)


def unlink(name: str) -> bool:
    """Remove a segment name; True if it existed. Safe to call twice."""
    with _lock:
        _created.discard(name)
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def unlink_all() -> None:
    """Unlink every segment this process created and has not unlinked yet (exit / signal path)."""
    with _lock:
        names = list(_created)
    for n in names:
        unlink(n)


def _run_prefix(prefix: str) -> None:
    """A sweep's prefix names one run: it starts with PREFIX and has more after it (the bare PREFIX would take
    every run's segments and folders on this machine)."""
    if not prefix.startswith(PREFIX) or len(prefix) <= len(PREFIX):
        raise ValueError(f"sweep prefix must start with {PREFIX!r} and name one run")


def sweep(prefix: str) -> list[str]:
    """Unlink every /dev/shm segment whose name starts with `prefix` (a run's own prefix). Returns them."""
    _run_prefix(prefix)
    gone = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return gone
    for n in entries:
        if n.startswith(prefix) and unlink(n):
            gone.append(n)
    return gone


def sweep_tmp(prefix: str) -> list[str]:
    """Remove every folder in the temporary directory whose name starts with `prefix` (a run's own prefix): what
    its workers made there (a UCX log folder, a tensor group's store) and left when killed. Returns them."""
    _run_prefix(prefix)
    root = tempfile.gettempdir()
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    gone = []
    for n in entries:
        path = os.path.join(root, n)
        if n.startswith(prefix) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(n)
    return gone


def created_names() -> list[str]:
    with _lock:
        return sorted(_created)


class ShmAllocator:
    """`kv_alloc(shape, dtype) -> Tensor` for the engine: the pool is placed in a named segment.

    The segment's name, shape and dtype are kept so the worker can tell peers how to attach.
    """

    def __init__(self, name: str):
        self.name = name
        self.segment: ShmTensor | None = None

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, device: object = None) -> torch.Tensor:
        if self.segment is not None:
            raise RuntimeError("ShmAllocator places one pool; it was already called")
        self.segment = create(shape, dtype, name=self.name)
        return self.segment.tensor


atexit.register(unlink_all)
