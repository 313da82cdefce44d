"""What ``txmq reconcile`` writes, without Spark running: the phase records and the live line
(:mod:`txmq.spark.progress`), the summary's spans and times (:mod:`txmq.spark.result`), and
the filter the JVM's standard error goes through (:mod:`txmq.spark.launch`)."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from txmq.observability.fmt import ms_time
from txmq.spark.classify import CLASSES
from txmq.spark.common import ms
from txmq.spark.launch import filter_lines
from txmq.spark.progress import Progress, bar, echo, record, seconds
from txmq.spark.result import Result, age_span, when

#: a phase record: ``txmq reconcile: doing .... 1.34 s``
RECORD = re.compile(r"^txmq reconcile: \S.* \.{3,} \d+(\.\d{1,2})? (s|min|h)$")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("took", "text"),
    [
        (0, "0 s"),
        (0.85, "0.85 s"),
        (0.004, "0 s"),
        (1.344, "1.34 s"),
        (10, "10 s"),
        (59.999, "60 s"),
        (125, "2.08 min"),
        (3600, "1 h"),
        (5400, "1.5 h"),
    ],
)
def test_durations_are_spans_as_the_command_line_writes_them(took: float, text: str) -> None:
    assert seconds(took) == text


def test_a_phase_record_is_one_line_with_dot_leaders_and_its_duration() -> None:
    line = record("txmq reconcile", "reading 1 store (3 segments)", 1.344)
    assert line.startswith("txmq reconcile: reading 1 store (3 segments) ...")
    assert line.endswith("... 1.34 s")
    assert RECORD.match(line), line
    long = record("txmq reconcile", "x" * 100, 125)
    assert long.endswith(" ... 2.08 min") and RECORD.match(long), long
    assert record("txmq reconcile", "starting Spark", 3, failed=True).endswith(" failed after 3 s")


def test_the_bar_fills_with_the_count() -> None:
    assert bar(0, 4, width=8) == "[        ]"
    assert bar(1, 4, width=8) == "[==>     ]"
    assert bar(4, 4, width=8) == "[========]"
    assert bar(9, 4, width=8) == "[========]"


def test_off_a_terminal_each_phase_is_one_plain_line() -> None:
    out = io.StringIO()
    with Progress(out) as progress:
        assert not progress.live
        with progress.phase("reading 1 database", total=3, unit="tables") as p:
            p.advance(3)
        with progress.phase("starting Spark") as p:
            p.note = "local[*]"
        with pytest.raises(RuntimeError), progress.phase("classifying the messages"):
            raise RuntimeError("boom")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert len(lines) == 3, lines
    assert lines[0].startswith("txmq reconcile: reading 1 database (3/3 tables) ...")
    assert lines[1].startswith("txmq reconcile: starting Spark (local[*]) ...")
    assert re.search(r"classifying the messages \.+ failed after \d", lines[2]), lines[2]
    assert all(RECORD.match(x) for x in lines[:2]), lines


def test_a_library_run_says_nothing() -> None:
    out = io.StringIO()
    progress = Progress(out, enabled=False)
    with progress.phase("reading 1 store") as p:
        p.advance()
    assert out.getvalue() == "" and Progress.off().live is False


def test_on_a_terminal_a_live_line_is_redrawn_then_replaced_by_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a StringIO has no size: $COLUMNS, else 80
    out = Terminal()
    with Progress(out) as progress:
        assert progress.live
        progress.tasks(lambda: (3, 8))
        with progress.phase("classifying the transactions"):
            pass
        with progress.phase("writing the Parquet tables", total=10, unit="tables") as p:
            p.advance(4)
            # another's line (the JVM's) comes out above the live line, which is drawn again
            echo("26/11/28 10:00:00 ERROR Executor: Exception in task 0.0", out)
            p.advance(6)
    text = out.getvalue()
    assert "\r\x1b[Ktxmq reconcile: classifying the transactions [" in text
    assert "3/8 Spark tasks" in text  # a phase without a count of its own: Spark's tasks
    assert "0/10 tables" in text
    # what stays on the screen: each line as the terminal shows it after the carriage returns
    screen = [line.split("\r")[-1].replace("\x1b[K", "") for line in text.split("\n")]
    assert screen[0].startswith("txmq reconcile: classifying the transactions ...")
    assert screen[1] == "26/11/28 10:00:00 ERROR Executor: Exception in task 0.0"
    assert screen[2].startswith("txmq reconcile: writing the Parquet tables (10/10 tables) ...")
    assert screen[3] == ""  # the live line is gone
    # a terminal narrower than the live line: the line is cut to fit, not wrapped
    monkeypatch.setenv("COLUMNS", "30")
    narrow = Terminal()
    with Progress(narrow) as progress, progress.phase("classifying the transactions"):
        pass
    drawn = narrow.getvalue().split("\n")[0].split("\r\x1b[K")[1]
    assert drawn == "txmq reconcile: classifying t", drawn


def test_the_jvm_filter_drops_only_the_launchers_notice() -> None:
    lines = [
        b"WARNING: Using incubator modules: jdk.incubator.vector\n",
        b"26/11/28 10:00:00 ERROR Executor: Exception in task 0.0 in stage 3.0 (TID 3)\n",
        b"org.apache.spark.SparkRuntimeException: [USER_RAISED_EXCEPTION] boom\n",
        b"\tat org.apache.spark.executor.Executor$TaskRunner.run(Executor.scala:906)\n",
        b"WARNING: something else the JVM says\n",
        b'Exception in thread "main" java.lang.OutOfMemoryError: Java heap space\n',
    ]
    shown: list[str] = []
    filter_lines(iter(lines), shown.append)
    assert shown == [line.decode() for line in lines[1:]]


def test_when_is_the_tables_time_to_the_millisecond() -> None:
    at = datetime(2026, 11, 23, 9, 58, 1, 250_999)  # naive: UTC
    assert when(at) == ms_time(ms(at))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.250", when(at)), when(at)
    assert when(at.replace(tzinfo=UTC)) == when(at)
    assert when(None) == "-"


@pytest.mark.parametrize(
    ("age", "text"),
    [
        ("0:00:10", "10 s"),
        ("0:05:00", "5 min"),
        ("1:01:00", "1.02 h"),
        ("2 days, 1:00:00", "2.04 days"),
        ("1 day, 0:00:00", "1 day"),
        (None, None),
        ("soon", "soon"),
    ],
)
def test_a_rows_age_is_shown_as_a_span(age: str | None, text: str | None) -> None:
    assert age_span(age) == text


def test_the_summary_writes_spans_and_times_not_timedeltas() -> None:
    now = datetime(2026, 11, 23, 10, 0, 0, 123_000, tzinfo=UTC)
    since = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
    at = datetime(2026, 11, 23, 8, 58, 59, 7_000)
    facts = {
        "transactions": 2,
        "outbox_rows": 0,
        "messages": 30,
        "expected": [],
        "retrying": 0,
        "window": "machine text",
        "sla": str(timedelta(minutes=10)),
        "now": now.isoformat(timespec="seconds"),
    }
    lost = {
        "group": "shop",
        "transaction_id": "old",
        "msg_id": None,
        "detail": "the broker never got the half message",
        "at": at,
    }
    stuck = {"saga_id": "s1", "saga": "order", "state": "PARKED", "at": at, "age": "1:01:00"}
    examples: dict[str, list[dict[str, Any]]] = {c: [] for c in CLASSES}
    examples |= {"lost": [lost], "saga_stuck": [stuck]}
    counts = {c: len(examples[c]) for c in CLASSES}
    result = Result(
        counts,
        examples,
        facts,
        "out",
        125.4,
        now=now,
        since=since,
        sla=timedelta(minutes=10),
    )
    text = result.summary()
    assert "and 30 committed messages in 2.09 min\n" in text, text
    assert f"window: {when(since)} .. end; SLA 10 min; as of {when(now)}\n" in text, text
    assert when(now).endswith(".123")
    assert when(at) in text and str(at) not in text, text
    assert "1.02 h" in text and "1:01:00" not in text, text
    assert "0:10:00" not in text and "+00:00" not in text, text
    # a Result made without the run's times (as the web console's tests make one) prints
    # the facts' text
    bare = Result(counts, examples, facts, "out", 0.25)
    assert "in 0.25 s\n" in bare.summary()
    assert "window: machine text; SLA 0:10:00; as of 2026-11-23T10:00:00+00:00" in bare.summary()
