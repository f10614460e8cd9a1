"""Rows of the two text layouts traces come in. CSV (Azure, BurstGPT): a header row naming the columns, found
by name in any order (extra columns are ignored). JSON lines (Mooncake, jsonl): one object per line with
the format's keys (extra keys are ignored). Blank lines are skipped; a missing column or key is a
TraceError naming the file and line."""

from __future__ import annotations

import csv
import json
from typing import Iterator

from pdlab.traces.trace import TraceError, open_text, where


def csv_rows(path: str, need: tuple[str, ...], what: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, {column: text}) for every non-empty data row; the header must name every column in `need`.
    `what` names the format in the error for a missing column."""
    with open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{where(path, 1)}: empty file; expected a header with {', '.join(need)}")
        names = [h.strip().lstrip("\ufeff") for h in header]
        missing = [c for c in need if c not in names]
        if missing:
            raise TraceError(f"{where(path, 1)}: missing column {missing[0]!r} ({what} has {', '.join(need)}; "
                             f"the header has {', '.join(names) or 'nothing'})")
        index = {c: names.index(c) for c in need}
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < len(names):
                raise TraceError(f"{where(path, line)}: {len(row)} fields, the header has {len(names)}")
            yield line, {c: row[i] for c, i in index.items()}


def json_lines(path: str, need: tuple[str, ...], what: str) -> Iterator[tuple[int, dict]]:
    """(line, object) for every non-blank line; each object must have every key in `need`."""
    with open_text(path) as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where(path, n)}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where(path, n)}: expected an object with {', '.join(need)}")
            for k in need:
                if k not in obj:
                    raise TraceError(f"{where(path, n)}: missing key {k!r} ({what} line has {', '.join(need)})")
            yield n, obj
