"""A production trace as read from its file: one row per request, in arrival order, before any window,
scaling or clipping (pdlab.traces.replay does those).

Every reader checks its rows the same way (`Rows`): a negative length or a timestamp earlier than the row
before it is a TraceError naming the file and line, raised while reading, so a bad trace stops a run before
anything starts. Replay keeps the file's order (requests that arrive together keep their order), so a file
out of order is an error rather than something sorted silently. Rows that are well formed but cannot be
replayed (no prompt or no output token: BurstGPT's failed requests, for one) are dropped and counted by
reason, never silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


class TraceError(ValueError):
    """A malformed trace file: one line naming the file and the line (FILE:LINE: what is wrong)."""


@dataclass(frozen=True, eq=False)
class Trace:
    path: str
    format: str
    t: np.ndarray  # float64 seconds from the first replayable row, non-decreasing
    input_len: np.ndarray  # int64 prompt tokens, >= 1
    output_len: np.ndarray  # int64 output tokens, >= 1
    line: np.ndarray  # int64 file line of each row, for messages
    rows: int  # data rows read (replayable and dropped)
    dropped: tuple[tuple[str, int], ...] = ()  # (reason, rows), rows read but not replayable
    hash_ids: Optional[tuple[tuple[int, ...], ...]] = None  # per row, one id per block (Mooncake); None: no
    #                                                          prefix information in this format
    block_size: Optional[int] = None  # tokens per hash id

    def __len__(self) -> int:
        return len(self.t)

    @property
    def prefix_info(self) -> bool:
        """Whether the trace says which prompts share blocks (Mooncake's hash_ids); Azure and BurstGPT do not."""
        return self.hash_ids is not None

    @property
    def dropped_counts(self) -> dict[str, int]:
        return dict(self.dropped)


def where(path: str, line: int) -> str:
    return f"{path}:{line}"


def as_count(v: object, path: str, line: int, name: str) -> int:
    """A token count from a trace: an integer (or an integral float, as CSV and JSON writers produce)."""
    if isinstance(v, bool):
        raise TraceError(f"{where(path, line)}: {name} must be an integer, got {v!r}")
    if isinstance(v, str):
        try:
            v = float(v.strip()) if any(c in v for c in ".eE") else int(v.strip())
        except ValueError:
            raise TraceError(f"{where(path, line)}: {name} must be an integer, got {v!r}") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise TraceError(f"{where(path, line)}: {name} must be an integer, got {v!r}")
    if v < 0:
        raise TraceError(f"{where(path, line)}: negative {name} ({v})")
    return v


def as_seconds(v: object, path: str, line: int, name: str, scale: float = 1.0) -> float:
    """A numeric timestamp (seconds, or milliseconds with scale 1e-3)."""
    try:
        if isinstance(v, bool):
            raise ValueError
        x = float(v.strip()) if isinstance(v, str) else float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{where(path, line)}: {name} must be a number, got {v!r}") from None
    if not np.isfinite(x) or x < 0:
        raise TraceError(f"{where(path, line)}: {name} must be a finite number >= 0, got {v!r}")
    return x * scale


class Rows:
    """Collects a reader's rows, checking order as they come; `trace()` builds the Trace."""

    def __init__(self, path: str, fmt: str, block_size: Optional[int] = None, has_ids: bool = False):
        self.path, self.fmt, self.block_size = path, fmt, block_size
        self.t: list[float] = []
        self.inp: list[int] = []
        self.out: list[int] = []
        self.line: list[int] = []
        self.ids: Optional[list[tuple[int, ...]]] = [] if has_ids else None
        self.dropped: dict[str, int] = {}
        self.rows = 0
        self._last: Optional[tuple[float, int]] = None  # (timestamp, line) of the row before

    def add(self, line: int, t: float, inp: int, out: int, ids: tuple[int, ...] = (),
            drop: Optional[str] = None) -> None:
        """One data row. `drop`: the reason a well-formed row is not replayed (else zero lengths drop it)."""
        self.rows += 1
        if self._last is not None and t < self._last[0]:
            raise TraceError(f"{where(self.path, line)}: timestamp goes back in time ({t:.6g} s after "
                             f"{self._last[0]:.6g} s on line {self._last[1]}); a trace is replayed in file "
                             "order, so it must be sorted by arrival")
        self._last = (t, line)
        if drop is None and inp == 0:
            drop = "no input tokens"
        if drop is None and out == 0:
            drop = "no output tokens"
        if drop is not None:
            self.dropped[drop] = self.dropped.get(drop, 0) + 1
            return
        self.t.append(t)
        self.inp.append(inp)
        self.out.append(out)
        self.line.append(line)
        if self.ids is not None:
            self.ids.append(ids)

    def trace(self) -> Trace:
        if not self.t:
            dropped = "; ".join(f"{n} dropped: {r}" for r, n in self.dropped.items())
            raise TraceError(f"{self.path}: no replayable request in {self.rows} rows" +
                             (f" ({dropped})" if dropped else ""))
        t = np.asarray(self.t, dtype=np.float64)
        return Trace(path=self.path, format=self.fmt, t=t - t[0], input_len=np.asarray(self.inp, dtype=np.int64),
                     output_len=np.asarray(self.out, dtype=np.int64), line=np.asarray(self.line, dtype=np.int64),
                     rows=self.rows, dropped=tuple(self.dropped.items()),
                     hash_ids=None if self.ids is None else tuple(self.ids), block_size=self.block_size)


def open_text(path: str):  # noqa: ANN201 - a text file object
    """Open a trace for reading; a missing or unreadable file is a TraceError."""
    try:
        return open(path, newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: trace file not found") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot be read ({e.strerror})") from None
