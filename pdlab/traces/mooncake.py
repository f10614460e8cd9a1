"""Mooncake's trace format (FAST'25, kvcache-ai/Mooncake FAST25-release): JSON lines of

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` in milliseconds from the trace's start; `hash_ids` one id per 512-token block of the prompt
(the last block partial), equal ids for equal blocks, so two prompts with the same first k ids share
their first k blocks. vLLM's and AIPerf's Mooncake replay read the same layout.
"""

from __future__ import annotations

from pdlab.traces.textrows import json_lines
from pdlab.traces.trace import Rows, Trace, TraceError, as_count, as_seconds, where

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def read(path: str) -> Trace:
    rows = Rows(path, "mooncake", block_size=BLOCK_TOKENS, has_ids=True)
    for n, obj in json_lines(path, KEYS, "a Mooncake trace"):
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceError(f"{where(path, n)}: hash_ids must be a list of integers")
        rows.add(n, as_seconds(obj["timestamp"], path, n, "timestamp", 1e-3),
                 as_count(obj["input_length"], path, n, "input_length"),
                 as_count(obj["output_length"], path, n, "output_length"), tuple(ids))
    return rows.trace()
