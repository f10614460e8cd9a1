"""Azure's LLM inference traces (Azure/AzurePublicDataset): CSV with the columns

    TIMESTAMP,ContextTokens,GeneratedTokens

2023 (AzureLLMInferenceTrace_code.csv, _conv.csv; one hour): naive wall-clock times with 100 ns digits,
`2023-11-16 18:15:46.6805900`. 2024 (AzureLLMInferenceTrace_code_1week.csv, _conv_1week.csv; a week): with
a UTC offset, `2024-05-10 00:00:00.009930+00:00`. Both read the same way: the times become seconds from the
first row. The traces say nothing about which prompts share a prefix.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from pdlab.traces.textrows import csv_rows
from pdlab.traces.trace import Rows, Trace, TraceError, as_count, where

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIME = re.compile(r"^(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*"
                   r"(Z|[+-]\d{2}:?\d{2})?$")


def parse_time(text: str) -> float:
    """Seconds since the epoch of `YYYY-MM-DD HH:MM:SS[.fraction][Z|+HH:MM]` (naive: UTC); every digit of the
    fraction is kept (datetime itself stops at microseconds). ValueError when malformed."""
    m = _TIME.match(text.strip())
    if m is None:
        raise ValueError(text)
    y, mo, d, h, mi, s = (int(x) for x in m.groups()[:6])
    frac, tz = m.group(7), m.group(8)
    offset = timedelta(0)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    t = datetime(y, mo, d, h, mi, s, tzinfo=timezone(offset)).timestamp()
    return t + (int(frac) / 10 ** len(frac) if frac else 0.0)


def read(path: str) -> Trace:
    rows = Rows(path, "azure")
    for n, r in csv_rows(path, COLUMNS, "an Azure LLM inference trace"):
        try:
            t = parse_time(r["TIMESTAMP"])
        except ValueError:
            raise TraceError(f"{where(path, n)}: TIMESTAMP {r['TIMESTAMP']!r} is not a time like "
                             "2023-11-16 18:15:46.6805900 or 2024-05-10 00:00:00.009930+00:00") from None
        rows.add(n, t, as_count(r["ContextTokens"], path, n, "ContextTokens"),
                 as_count(r["GeneratedTokens"], path, n, "GeneratedTokens"))
    return rows.trace()
