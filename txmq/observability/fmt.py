"""Plain-text presentation shared by the command line and the reconciliation summary.

Times: a table or a text view shows epoch milliseconds as local time with milliseconds
(:func:`ms_time`, like the log lines); ``--json`` keeps the numbers and adds an ISO 8601
UTC string beside each (:func:`with_times`, :func:`iso_ms`). Spans: :func:`span`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

__all__ = ["cell", "format_table", "iso_ms", "ms_time", "short_body", "span", "with_times"]

#: names of epoch-millisecond fields and the name of the readable field beside them
_MS_SUFFIXES = ("_timestamp", "_ts")


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
    if value is None or value == [] or value == {}:
        return "-"
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def ms_time(ms: int | None) -> str:
    """Epoch milliseconds as local time with milliseconds; 0 or None (no time) as '-'."""
    if not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms // 1000)) + f".{ms % 1000:03d}"


def iso_ms(ms: int | None) -> str | None:
    """Epoch milliseconds as ISO 8601 UTC with milliseconds (``2026-11-25T02:45:36.464Z``);
    0 or None (no time) as None."""
    if not ms:
        return None
    when = datetime.fromtimestamp(ms // 1000, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def with_times(
    row: Mapping[str, Any],
    *,
    readable: Callable[[int | None], str | None] = iso_ms,
    keep_ms: bool = True,
) -> dict[str, Any]:
    """``row`` with a readable ``<name>_time`` beside each epoch-ms ``<name>_timestamp`` or
    ``<name>_ts`` field (``keep_ms=False``: in its place)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        suffix = next((s for s in _MS_SUFFIXES if key.endswith(s)), None)
        if suffix is None or not (value is None or isinstance(value, int)):
            out[key] = value
            continue
        if keep_ms:
            out[key] = value
        out[key[: -len(suffix)] + "_time"] = readable(value)
    return out


def span(age: timedelta) -> str:
    """A span in the largest unit it fills: ``7 days``, ``12 h``, ``1.5 h``, ``5 min``,
    ``0.25 s`` (never ``str(timedelta)``'s ``7 days, 0:00:00``)."""
    seconds = age.total_seconds()
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if abs(seconds) >= size:
            value = _number(seconds / size)
            if unit == "day":
                return f"{value} day" if value == "1" else f"{value} days"
            return f"{value} {unit}"
    return f"{_number(seconds)} s"


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def short_body(body: bytes, limit: int = 40) -> str:
    """A message body as one short line (text, else hex)."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.hex()
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
