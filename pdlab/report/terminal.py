"""compare in the terminal: the header, tables, M/D/1 lines, verdicts and warnings of pdlab.report.tables,
with rich, reading at 100 columns (a terminal's own width when stdout is one)."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

from pdlab.report.tables import header, mdl1_lines, routes, tables

WIDTH = 100
STYLE = {"partial": "bold red", "box": "bold yellow", "modelled": "bold", "info": ""}


def _wrapped(console: Any, text: str, indent: str = "  ", style: str = "", rest: str = "") -> None:
    """`text` wrapped to the console, its first line after `indent`, the others after `rest` (indent + 2)."""
    # deferred: rich
    from rich.markup import escape

    width = (console.width or WIDTH) - 1
    rest = rest or indent + "  "
    for line in textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=rest) or [""]:
        console.print(f"[{style}]{escape(line)}[/{style}]" if style else escape(line), soft_wrap=True)


def render(result: dict, console: Any = None) -> None:
    """Print the comparison (pdlab.report.compare.compare's result)."""
    # deferred: rich
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else WIDTH)
    for line in header(result):
        _wrapped(console, line.text, "", STYLE[line.kind])
    for t in tables(result):
        _wrapped(console, t.title, "", "bold")  # above the table, not its title: rich wraps a title to its width
        rt = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for i, name in enumerate(t.columns):
            rt.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in t.rows:
            rt.add_row(*row)
        console.print(rt)
        for note in t.notes:
            _wrapped(console, note, "  ", "dim")
    where = routes(result)
    if where:
        console.print("where prompts were prefilled (finite rates; local: on the decode worker by choice, "
                      "recompute: there again after a failed hand-over):")
        for line in where:
            _wrapped(console, line)
    if result["rows"]:
        console.print("M/D/1 at each row's lowest rate (first repeat; D: one request alone on that deployment):")
    for line in mdl1_lines(result):
        _wrapped(console, line)
    for line in result["verdict"]:
        _wrapped(console, line, "• ", rest="  ")
    for w in result["warnings"]:
        _wrapped(console, f"warning: {w}", "", "dim")
