"""Reading txmq's tables: SQLite on the driver, PostgreSQL through JDBC in ranges."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert

from tests.sqla_support import pg_schema
from txmq.spark.sources import Database, jdbc_url
from txmq.sqla.tables import metadata, transaction_log

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _fill(url: str, n: int) -> None:
    engine = create_engine(url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            insert(transaction_log),
            [
                {
                    "transaction_id": f"tx-{i}",
                    "producer_group": "pg",
                    "state": "COMMITTED",
                    "created_at": T0 + timedelta(minutes=i),
                }
                for i in range(n)
            ],
        )
    engine.dispose()


def read_table(spark: Any, url: str, kind: str, **window: Any) -> Any:
    db = Database(url)
    try:
        return db.read(spark, kind, **window)
    finally:
        db.close()


def _ids(df: Any) -> list[int]:
    return sorted(int(r["transaction_id"][3:]) for r in df.collect())


def test_sqlite_tables_are_read_within_the_window(tmp_path: Path, spark: Any) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    _fill(url, 10)
    df = read_table(
        spark, url, "log", since=T0 + timedelta(minutes=3), until=T0 + timedelta(minutes=7)
    )
    assert _ids(df) == [3, 4, 5, 6]
    row = df.first()
    assert row["created_at"] == datetime(2026, 11, 1, 0, 3)  # UTC, as the session's time zone
    assert row["db"] == url
    # a database without txmq's tables yields no rows, not an error
    assert read_table(spark, f"sqlite:///{tmp_path / 'empty.db'}", "outbox").count() == 0


def test_postgresql_tables_are_read_through_jdbc_in_ranges(spark: Any) -> None:
    with pg_schema() as url:
        _fill(url, 100)
        df = read_table(spark, url, "log", partitions=4)
        assert df.rdd.getNumPartitions() == 4
        assert _ids(df) == list(range(100))
        df = read_table(spark, url, "log", since=T0 + timedelta(minutes=90), partitions=3)
        assert _ids(df) == list(range(90, 100))
        assert "password" not in df.first()["db"]


def test_jdbc_url_keeps_user_password_and_search_path() -> None:
    url, props = jdbc_url(
        "postgresql+psycopg://app:s3cret@db.example:6432/orders?options=-csearch_path%3Dsales"
    )
    assert url == "jdbc:postgresql://db.example:6432/orders"
    assert props == {
        "driver": "org.postgresql.Driver",
        "user": "app",
        "password": "s3cret",
        "options": "-csearch_path=sales",
    }
