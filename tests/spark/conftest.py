"""One Spark session (local[*], UTC, the JDBC driver) shared by every Spark test, and small
worlds: a broker of the test's own beside a SQLite file with txmq's tables, on which the
job is run as ``txmq reconcile`` would run it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Table, create_engine, insert

import txmq.sqla
from txmq.broker.server import EmbeddedBroker
from txmq.spark.classify import CLASSES
from txmq.spark.job import JDBC_JAR, main, session


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    s = session("local[*]", JDBC_JAR)
    yield s
    s.stop()


@dataclass
class Small:
    """A broker and a database of one test; :meth:`reconcile` runs the job on them."""

    broker: EmbeddedBroker
    db: str
    engine: Engine
    spark: Any
    tmp_path: Path

    @property
    def address(self) -> str:
        return self.broker.address

    def insert(self, table: Table, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(table).values(**values))

    def reconcile(self, *args: str, now: datetime | None = None) -> Result:
        """The job's anomalies as of ``now`` (default: a minute from now), SLA 10 minutes
        unless ``args`` say otherwise."""
        out = self.tmp_path / f"out{len(list(self.tmp_path.glob('out*')))}"
        as_of = now or datetime.now(UTC) + timedelta(minutes=1)
        argv = [
            *("--store", str(self.broker.config.store), "--db", self.db, "--out", str(out)),
            *("--sla", "10m", "--now", as_of.isoformat(), *args),
        ]
        rc = main(argv, spark=self.spark)
        rows = {
            c: [r.asDict() for r in self.spark.read.parquet(str(out / c)).collect()]
            for c in CLASSES
        }
        return Result(rc, rows, json.loads((out / "summary.json").read_text()))


@dataclass
class Result:
    rc: int
    rows: dict[str, list[dict[str, Any]]]
    summary: dict[str, Any]

    def ids(self, anomaly: str) -> set[str]:
        """The transaction ids (else message ids) of the rows of one class."""
        return {r["transaction_id"] or r["msg_id"] for r in self.rows[anomaly]}

    def pairs(self, anomaly: str) -> set[tuple[str, str]]:
        """(group, message id) of the rows of one class."""
        return {(r["group"], r["msg_id"]) for r in self.rows[anomaly]}


@pytest.fixture
def small(
    spark: Any, tmp_path: Path, embedded_broker: Callable[..., EmbeddedBroker]
) -> Iterator[Small]:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(url)
    with engine.connect() as conn:
        txmq.sqla.upgrade(conn)
    try:
        yield Small(embedded_broker(), url, engine, spark, tmp_path)
    finally:
        engine.dispose()
