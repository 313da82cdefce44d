"""``txmq reconcile`` as a user runs it, in a process of its own on a tiny store (a few
segments the broker's own MessageStore wrote) and a SQLite database: standard error holds
the job's phase records and none of Spark's start-up chatter, unless
``--spark-log`` asks for it; an error the JVM logs still gets through.  Each test starts a
JVM of its own, one at a time (none beside the shared session of the other Spark tests:
these tests do not use it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert

import txmq.sqla
from txmq.broker.store import MessageStore, StoreConfig
from txmq.protocol.message import Prop
from txmq.sqla.tables import transaction_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: a run of its own: ~20 s alone on 2 cores (most of it the JVM and Spark starting), past
#: 60 s beside a loaded suite
RUN_TIMEOUT = 400
TXMQ = str(Path(sys.executable).parent / "txmq")

#: what Spark and the JVM print on their own when nothing quiets them (the issue's list)
NOISE = (
    "WARNING: Using incubator modules",
    "resolves to a loopback address",
    "Set SPARK_LOCAL_IP",
    "NativeCodeLoader",
    "Using Spark's default log4j profile",
    'Setting default log level to "WARN"',
    "To adjust logging level use sc.setLogLevel",
    "[Stage ",
    "py4j.clientserver",
)
#: a phase record (txmq.spark.progress.record)
RECORD = re.compile(r"^txmq reconcile: (?P<doing>\S.*?) \.{3,} \d+(\.\d{1,2})? (s|min|h)$")


def tiny(tmp_path: Path) -> tuple[Path, str]:
    """A store of three 4 KiB segments (30 plain messages) and a database whose transaction
    log has one transaction committed an hour ago that the broker never got (lost)."""
    store = tmp_path / "store"
    with MessageStore(StoreConfig(store, segment_size=4096, export_segments=False)) as s:
        for i in range(30):
            props = {Prop.UNIQ_KEY: f"P{i}", Prop.KEYS: f"k{i}"}
            r = s.put(
                topic="orders", queue_id=0, body=b"x" * 200, properties=props, born_timestamp=1
            )
            assert r.ok
    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            txmq.sqla.upgrade(conn)
            conn.execute(
                insert(transaction_log).values(
                    transaction_id="old",
                    producer_group="shop",
                    state="COMMITTED",
                    created_at=datetime.now(UTC) - timedelta(hours=1),
                )
            )
    finally:
        engine.dispose()
    return store, url


def reconcile(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    store, url = tiny(tmp_path)
    return subprocess.run(
        [
            *(TXMQ, "reconcile", "--store", str(store), "--db", url),
            *("--out", str(tmp_path / "out"), "--conf", "spark.driver.memory=1g", *args),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env={k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"},
    )


def test_a_run_shows_its_phases_and_none_of_sparks_noise(tmp_path: Path) -> None:
    r = reconcile(tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-4000:]
    for noise in NOISE:
        assert noise not in r.stderr, r.stderr
    # not a terminal: plain lines, each a phase record, and nothing else
    assert "\r" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert all(RECORD.match(line) for line in lines), r.stderr
    doing = [m["doing"] for m in map(RECORD.match, lines) if m]
    assert doing == [
        "checking 1 store and 1 database",
        "starting Spark (local[*])",
        "reading 1 store (3 segments)",
        "reading 1 database (3/3 tables)",
        "classifying the transactions",
        "finding what each group consumes",
        "classifying the messages",
        "putting the anomalies' rows together",
        "writing the Parquet tables (10/10 tables)",
    ], r.stderr
    # the summary: spans and times as the command line writes them
    assert re.search(r"committed messages in \d+(\.\d+)? s\n", r.stdout), r.stdout
    assert re.search(r"; SLA 10 min; as of \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\n", r.stdout)
    assert "0:10:00" not in r.stdout, r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("shop "))
    assert re.search(r"  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}  ", row), row
    # summary.json keeps its machine values
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["lost"] == 1 and summary["facts"]["sla"] == "0:10:00"


def test_spark_log_shows_sparks_own_output(tmp_path: Path) -> None:
    r = reconcile(tmp_path, "--spark-log")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Using Spark's default log4j profile" in r.stderr, r.stderr
    assert "WARNING: Using incubator modules" in r.stderr, r.stderr
    assert "txmq reconcile: writing the Parquet tables (10/10 tables) ..." in r.stderr


def test_an_error_the_jvm_logs_still_shows(tmp_path: Path) -> None:
    """A quiet session's JVM logs a task's exception: it reaches standard error, stack and
    all, before the process ends (it goes on right after the error)."""
    script = textwrap.dedent(
        """
        from txmq.spark.launch import session

        spark = session("local[1]", **{"spark.driver.memory": "1g"})
        try:
            spark.sql("SELECT raise_error('kaputt-42')").collect()
        except Exception as exc:
            print("caught", type(exc).__name__, flush=True)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "caught" in r.stdout, r.stdout + r.stderr[-4000:]
    assert "ERROR Executor: Exception in task" in r.stderr, r.stderr
    assert "kaputt-42" in r.stderr and "\tat org.apache.spark" in r.stderr, r.stderr
    assert "Using incubator modules" not in r.stderr, r.stderr
