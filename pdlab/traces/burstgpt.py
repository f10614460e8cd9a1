"""BurstGPT (HPMLL/BurstGPT; ChatGPT and GPT-4 requests through Azure OpenAI, over months): CSV with

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type

(BurstGPT_3.csv adds Session ID and Elapsed time; columns are found by name). `Timestamp` is in seconds.
A failed request is logged with 0 response tokens: such rows are dropped and counted as failed (the
BurstGPT_without_fails files have none). The trace says nothing about which prompts share a prefix.
"""

from __future__ import annotations

from pdlab.traces.textrows import csv_rows
from pdlab.traces.trace import Rows, Trace, as_count, as_seconds

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
FAILED = "failed (0 response tokens)"


def read(path: str) -> Trace:
    rows = Rows(path, "burstgpt")
    for n, r in csv_rows(path, COLUMNS, "a BurstGPT trace"):
        out = as_count(r["Response tokens"], path, n, "Response tokens")
        rows.add(n, as_seconds(r["Timestamp"], path, n, "Timestamp"),
                 as_count(r["Request tokens"], path, n, "Request tokens"), out, drop=FAILED if out == 0 else None)
    return rows.trace()
