"""``txmq.cli.tables``: a table fits the width it is given — empty columns first, then
the table's low-value columns in its order, then the widest cells cut with an ellipsis;
no width (not a terminal, no $COLUMNS, or --wide) keeps every column and character."""

from __future__ import annotations

import sys

import pytest

from txmq.cli.tables import fit_table, width
from txmq.observability.fmt import format_table

ROWS = [
    {
        "broker": "broker-a",
        "role": "SYNC_MASTER",
        "epoch": None,
        "version": "0.1.0",
        "max_offset": 123456,
        "lag": 4,
        "reason": "r" * 70,
    },
    {
        "broker": "broker-b",
        "role": "SLAVE",
        "epoch": None,
        "version": "0.1.0",
        "max_offset": 99,
        "lag": 12,
        "reason": "short",
    },
]


def test_no_limit_is_format_table() -> None:
    assert fit_table(ROWS, limit=None) == format_table(ROWS)
    assert fit_table([], limit=20) == "(none)"


def test_empty_then_low_value_columns_go_first_then_cells_are_cut() -> None:
    text = fit_table(ROWS, drop=["max_offset", "version"], limit=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split()[:3] == ["BROKER", "ROLE", "LAG"]
    assert "EPOCH" not in lines[0] and "MAX_OFFSET" not in lines[0]
    assert "VERSION" not in lines[0]
    assert lines[2].endswith("…") and lines[3].endswith("short")
    # numbers stay right-aligned
    assert lines[2].split()[2] == "4" and lines[3].split()[2] == "12"


def test_a_roomy_width_changes_nothing() -> None:
    assert fit_table(ROWS, drop=["version"], limit=500) == format_table(ROWS)


def test_very_narrow_still_fits_what_it_can() -> None:
    text = fit_table(ROWS, drop=["max_offset", "version"], limit=30)
    assert all(len(line) <= 30 for line in text.splitlines()), text


def test_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "72")
    # pytest captures stdout: not a terminal, so no limit, whatever $COLUMNS says
    assert width() is None
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert width() == 72
    assert width(wide=True) is None
