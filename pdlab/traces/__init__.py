"""Production traces: read Mooncake, Azure, BurstGPT and pdlab's plain jsonl traces, replay them as a
workload (pdlab.traces.replay), describe them (pdlab.traces.stats).

`read_trace(path, format)` is the one entry point: one reader per name in pdlab.constants.TRACE_FORMATS.
A file is read once per process while it is unchanged (a recipe resolves `rates: [trace]`, then every
variant builds its workload from the same file).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, Optional

from pdlab.constants import TRACE_FORMATS
from pdlab.traces import azure, burstgpt, jsonl, mooncake
from pdlab.traces.trace import Trace, TraceError

# one reader per name in TRACE_FORMATS (tests/test_traces.py checks that the two lists agree)
READERS: dict[str, Callable[[str], Trace]] = {"mooncake": mooncake.read, "azure": azure.read,
                                              "burstgpt": burstgpt.read, "jsonl": jsonl.read}

__all__ = ["READERS", "Trace", "TraceError", "read_trace", "sniff_format"]


def read_trace(path: str, fmt: str) -> Trace:
    """The trace at `path` in format `fmt`; TraceError (FILE:LINE: ...) when it is malformed."""
    if fmt not in READERS:
        raise TraceError(f"{path}: unknown trace format {fmt!r}; expected one of {', '.join(TRACE_FORMATS)}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: trace file not found") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot be read ({e.strerror})") from None
    return _read(path, fmt, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _read(path: str, fmt: str, _mtime: int, _size: int) -> Trace:
    try:
        return READERS[fmt](path)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text (a {fmt} trace is CSV or JSON lines)") from None


def sniff_format(path: str) -> Optional[str]:
    """The format a file's first line says it is in, or None: a JSON object with hash_ids is Mooncake, with
    input_len jsonl; a CSV header with ContextTokens is Azure, with Response tokens BurstGPT."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
    except OSError:
        return None
    if first.lstrip().startswith("{"):
        if '"hash_ids"' in first or '"input_length"' in first:
            return "mooncake"
        return "jsonl" if '"input_len"' in first else None
    if "ContextTokens" in first:
        return "azure"
    return "burstgpt" if "Response tokens" in first else None
