"""How the command line shows times and spans (txmq.observability.fmt)."""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta

import pytest

from txmq.observability.fmt import iso_ms, ms_time, span, with_times


@pytest.mark.parametrize(
    ("age", "text"),
    [
        (timedelta(days=7), "7 days"),
        (timedelta(days=1), "1 day"),
        (timedelta(days=1.5), "1.5 days"),
        (timedelta(hours=24), "1 day"),
        (timedelta(hours=12), "12 h"),
        (timedelta(hours=1), "1 h"),
        (timedelta(minutes=90), "1.5 h"),
        (timedelta(minutes=5), "5 min"),
        (timedelta(seconds=30), "30 s"),
        (timedelta(seconds=0.25), "0.25 s"),
        (timedelta(0), "0 s"),
        (timedelta(days=1234), "1234 days"),
        (timedelta(days=0.01), "14.4 min"),
    ],
)
def test_span_reads_like_the_option_it_came_from(age: timedelta, text: str) -> None:
    assert span(age) == text
    assert ":" not in span(age)  # never str(timedelta)'s "7 days, 0:00:00"


def test_ms_time_is_local_time_with_milliseconds() -> None:
    ms = 1_795_574_736_464
    text = ms_time(ms)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.464", text), text
    assert time.mktime(time.strptime(text[:19], "%Y-%m-%d %H:%M:%S")) == ms // 1000
    assert ms_time(0) == ms_time(None) == "-"  # "no time" (an empty queue), not 1970


def test_iso_ms_is_utc_and_round_trips() -> None:
    ms = 1_795_574_736_464
    text = iso_ms(ms)
    assert text == "2026-11-25T02:45:36.464Z"
    parsed = datetime.fromisoformat(text)
    assert parsed.tzinfo is not None and parsed.utcoffset() == timedelta(0)
    assert round(parsed.timestamp() * 1000) == ms
    assert iso_ms(0) is None and iso_ms(None) is None


def test_with_times_adds_a_readable_field_beside_each_epoch_ms_field() -> None:
    row = {"msg_id": "A", "born_timestamp": 1_795_574_736_464, "last_store_ts": 0, "n": 3}
    out = with_times(row)
    assert list(out) == ["msg_id", "born_timestamp", "born_time", "last_store_ts",
                         "last_store_time", "n"]  # fmt: skip
    assert out["born_timestamp"] == 1_795_574_736_464  # the number stays, for scripts
    assert out["born_time"] == "2026-11-25T02:45:36.464Z" and out["last_store_time"] is None
    text = with_times(row, readable=ms_time, keep_ms=False)
    assert list(text) == ["msg_id", "born_time", "last_store_time", "n"]
    assert text["born_time"] == ms_time(1_795_574_736_464) and text["last_store_time"] == "-"
