"""Plain-text presentation shared by the command line and the reconciliation summary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["cell", "format_table", "ms_time", "short_body"]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table with a header row; numbers right-aligned."""
    if not rows:
        return "(none)"
    cols = list(columns or rows[0].keys())
    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), int | float) for r in rows) for c in cols]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line([c.upper() for c in cols]), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def cell(value: Any) -> str:
    """One value as table text: None as '-', lists and maps comma-separated."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def ms_time(ms: int) -> str:
    """Epoch milliseconds as local time with milliseconds."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def short_body(body: bytes, limit: int = 40) -> str:
    """A message body as one short line (text, else hex)."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.hex()
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
