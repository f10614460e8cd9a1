"""pdlab's plain trace: JSON lines of

    {"timestamp": 1.25, "input_len": 1800, "output_len": 128}

`timestamp` in seconds from the trace's start. For a trace written by hand or converted from a format pdlab
does not read; it carries no prefix information (the Mooncake format, with hash_ids, does).
"""

from __future__ import annotations

from pdlab.traces.textrows import json_lines
from pdlab.traces.trace import Rows, Trace, as_count, as_seconds

KEYS = ("timestamp", "input_len", "output_len")


def read(path: str) -> Trace:
    rows = Rows(path, "jsonl")
    for n, obj in json_lines(path, KEYS, "a jsonl trace"):
        rows.add(n, as_seconds(obj["timestamp"], path, n, "timestamp"),
                 as_count(obj["input_len"], path, n, "input_len"), as_count(obj["output_len"], path, n, "output_len"))
    return rows.trace()
