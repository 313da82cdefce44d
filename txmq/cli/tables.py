"""Tables that fit the terminal: :func:`table` is :func:`txmq.observability.fmt.format_table`
(the one table printer) given only the columns and the cell text that fit.

The width: when standard output is a terminal, ``$COLUMNS`` if set, else the terminal's
(:func:`shutil.get_terminal_size`); when it is not (a pipe, a file), none: a table keeps
every column and every character — what scripts and ``| grep`` read stays as it was.
``--wide`` keeps every column in a terminal too.  To fit, a table first leaves out its
columns that say nothing (every cell empty), then its low-value columns in the order it
names them, then shortens the widest cells with an ellipsis."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from typing import Any

from txmq.observability.fmt import cell, format_table

__all__ = ["fit_table", "table", "width"]

GAP = 2
#: the narrowest a shortened column gets
MIN_WIDTH = 4


def width(wide: bool = False) -> int | None:
    """How wide a table may be (None: as wide as it is)."""
    if wide:
        return None
    try:
        terminal = sys.stdout.isatty()
    except (AttributeError, ValueError):
        terminal = False
    # shutil reads $COLUMNS first, then asks the terminal
    return shutil.get_terminal_size().columns if terminal else None


def table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    drop: Sequence[str] = (),
    wide: bool = False,
) -> str:
    """``rows`` as a table that fits :func:`width` (``drop``: the table's low-value
    columns, the first left out first)."""
    return fit_table(rows, columns, drop=drop, limit=width(wide))


def fit_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    drop: Sequence[str] = (),
    limit: int | None = None,
) -> str:
    """``rows`` as a table at most ``limit`` characters wide (None: no limit)."""
    if not rows or limit is None:
        return format_table(rows, columns)
    cols = list(columns or rows[0].keys())
    texts = {c: [cell(r.get(c)) for r in rows] for c in cols}

    def needed(c: str) -> int:
        return max(len(c), *(len(t) for t in texts[c]))

    def total(cs: list[str]) -> int:
        return sum(needed(c) for c in cs) + GAP * (len(cs) - 1)

    empty = [c for c in cols[1:] if all(t == "-" for t in texts[c])]
    for c in [*empty, *(c for c in drop if c not in empty)]:
        if total(cols) <= limit:
            break
        if c in cols and len(cols) > 1:
            cols.remove(c)
    sizes = _shorten(rows, cols, texts, limit) if total(cols) > limit else {}
    numeric = {c for c in cols if all(isinstance(r.get(c), int | float) for r in rows)}
    titles: dict[str, str] = {}
    for c in cols:
        title = _cut(c, sizes[c]) if c in sizes else c
        titles[c] = c if title in titles.values() else title
    fitted = [
        {
            titles[c]: r.get(c) if c in numeric and texts[c][i] == cell(r.get(c)) else texts[c][i]
            for c in cols
        }
        for i, r in enumerate(rows)
    ]
    return format_table(fitted, [titles[c] for c in cols])


def _shorten(
    rows: Sequence[dict[str, Any]], cols: list[str], texts: dict[str, list[str]], limit: int
) -> dict[str, int]:
    """Cut the widest cells (text before numbers, headers last) until the table fits;
    each column's width."""
    widths = {c: max(len(c), *(len(t) for t in texts[c])) for c in cols}
    numbers = {c for c in cols if all(isinstance(r.get(c), int | float) for r in rows)}
    excess = sum(widths.values()) + GAP * (len(cols) - 1) - limit
    # text cells (headers whole), then text headers too, then numbers: better cut than
    # wider than the screen
    for stage in range(3):
        floors = {
            c: min(widths[c], max(_floor(stage, c, c in numbers, widths[c]), MIN_WIDTH))
            for c in cols
        }
        while excess > 0:
            room = [c for c in cols if widths[c] > floors[c]]
            if not room:
                break
            widest = max(room, key=lambda c: widths[c])
            widths[widest] -= 1
            excess -= 1
        if excess <= 0:
            break
    for c in cols:
        texts[c] = [_cut(t, widths[c]) for t in texts[c]]
    return widths


def _floor(stage: int, column: str, number: bool, now: int) -> int:
    """How narrow a column may get at a stage of :func:`_shorten`."""
    if stage == 2:
        return MIN_WIDTH
    if number:
        return now
    return len(column) if stage == 0 else MIN_WIDTH


def _cut(text: str, size: int) -> str:
    if len(text) <= size:
        return text
    mark = _ellipsis()
    return text[: max(size - len(mark), 0)] + mark


def _ellipsis() -> str:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "…".encode(encoding)
    except (LookupError, UnicodeEncodeError):
        return "."
    return "…"
