"""The three views as DataFrames: txmq's tables in each database, and the broker's store.

PostgreSQL tables are read through JDBC (the driver jar from Debian's
``libpostgresql-jdbc-java`` by default), split into ``partitions`` ranges of an indexed
column; the bounds and the list of tables come from a quick query through SQLAlchemy, which
also turns an unreachable database into a clear error before Spark starts reading.  SQLite
files (the embedded demo) are read through SQLAlchemy on the driver.  Databases are named by
their SQLAlchemy URLs, as everywhere else in txmq.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from sqlalchemy import create_engine, inspect, make_url, text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.exc import SQLAlchemyError

from broker.store.export import valid_export
from spark.store_source import NAME, SCHEMA, StoreDataSource, segments

__all__ = [
    "TABLES",
    "DatabaseUnreachable",
    "Table",
    "jdbc_url",
    "log_groups",
    "read_store",
    "read_table",
]


class DatabaseUnreachable(RuntimeError):
    """A database named on the command line cannot be read."""


@dataclass(frozen=True)
class Table:
    name: str
    columns: str  # Spark DDL of the columns read
    time_column: str  # the window applies to it
    split_column: str  # indexed: JDBC partitions are ranges of it


TABLES = {
    "log": Table(
        "txmq_transaction_log",
        "transaction_id string, producer_group string, state string, created_at timestamp",
        "created_at",
        "created_at",
    ),
    "outbox": Table(
        "txmq_outbox",
        "id long, msg_id string, topic string, keys string, state string, attempts int, "
        "last_error string, created_at timestamp",
        "created_at",
        "id",
    ),
    "consumed": Table(
        "txmq_consumed_keys",
        "consumer_group string, key string, state string, created_at timestamp",
        "created_at",
        "created_at",
    ),
}


def jdbc_url(url: str | URL) -> tuple[str, dict[str, str]]:
    """The JDBC URL and connection properties of a PostgreSQL SQLAlchemy URL."""
    u = make_url(url)
    if u.get_backend_name() != "postgresql":
        raise ValueError(f"not a PostgreSQL URL: {u.render_as_string()}")
    props = {"driver": "org.postgresql.Driver", "user": u.username or "postgres"}
    if u.password:
        props["password"] = str(u.password)
    options = u.query.get("options")
    if options:  # e.g. -csearch_path=schema (pgjdbc passes it on as libpq does)
        props["options"] = options if isinstance(options, str) else " ".join(options)
    host = u.host or "localhost"
    return f"jdbc:postgresql://{host}:{u.port or 5432}/{u.database or 'postgres'}", props


def _where(table: Table, since: datetime | None, until: datetime | None, pg: bool) -> str:
    def literal(t: datetime) -> str:
        if pg:
            return f"TIMESTAMP WITH TIME ZONE '{t.isoformat()}'"
        # SQLite keeps SQLAlchemy's DateTime as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff'
        return f"'{t.astimezone(UTC).strftime('%Y-%m-%d %H:%M:%S.%f')}'"

    parts = []
    if since is not None:
        parts.append(f"{table.time_column} >= {literal(since)}")
    if until is not None:
        parts.append(f"{table.time_column} < {literal(until)}")
    return " AND ".join(parts) or "1 = 1"


def read_table(
    spark: SparkSession,
    db: str,
    kind: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    partitions: int = 2,
) -> DataFrame:
    """Table ``kind`` (a key of :data:`TABLES`) of database ``db``, within the window, with a
    ``db`` column naming the database; empty if the database does not have the table."""
    table = TABLES[kind]
    names = [name for name, _ in _types(table)]
    u = make_url(db)
    pg = u.get_backend_name() == "postgresql"
    where = _where(table, since, until, pg)
    with _connected(u, table) as conn:
        if not inspect(conn).has_table(table.name):
            return _with_db(spark.createDataFrame([], table.columns), u)
        lo, hi = conn.execute(
            text(
                f"SELECT min({table.split_column}), max({table.split_column}) "
                f"FROM {table.name} WHERE {where}"
            )
        ).one()
        rows = (
            None
            if pg
            else conn.execute(
                text(f"SELECT {', '.join(names)} FROM {table.name} WHERE {where}")
            ).all()
        )
    if rows is not None:  # SQLite: small, read on the driver
        return _with_db(
            spark.createDataFrame([_sqlite_row(r, names) for r in rows], table.columns), u
        )
    url, props = jdbc_url(u)
    query = f"(SELECT {', '.join(names)} FROM {table.name} WHERE {where}) AS t"
    reader = spark.read.format("jdbc").option("url", url).option("dbtable", query)
    reader = reader.option("fetchsize", "50000").options(**props)
    if lo is not None and partitions > 1 and lo != hi:
        if isinstance(lo, datetime):
            lo_s, hi_s = lo.isoformat(sep=" "), (hi + timedelta(microseconds=1)).isoformat(sep=" ")
        else:
            lo_s, hi_s = str(lo), str(int(hi) + 1)
        reader = (
            reader.option("partitionColumn", table.split_column)
            .option("lowerBound", lo_s)
            .option("upperBound", hi_s)
            .option("numPartitions", str(partitions))
        )
    df = reader.load()
    return _with_db(df.selectExpr(*[f"CAST({c} AS {t}) AS {c}" for c, t in _types(table)]), u)


def log_groups(db: str, since: datetime | None = None, until: datetime | None = None) -> set[str]:
    """The producer groups in database ``db``'s transaction log (within the window): the
    groups whose transactions the run can check.  One query, in the database."""
    table = TABLES["log"]
    u = make_url(db)
    where = _where(table, since, until, u.get_backend_name() == "postgresql")
    with _connected(u, table) as conn:
        if not inspect(conn).has_table(table.name):
            return set()
        q = text(f"SELECT DISTINCT producer_group FROM {table.name} WHERE {where}")
        return {r[0] for r in conn.execute(q)}


@contextmanager
def _connected(u: URL, table: Table) -> Iterator[Connection]:
    """A short connection to ``u``; any database error is :class:`DatabaseUnreachable`."""
    try:
        engine = create_engine(u)
        try:
            with engine.connect() as conn:
                yield conn
        finally:
            engine.dispose()
    except SQLAlchemyError as exc:
        raise DatabaseUnreachable(
            f"cannot read {table.name} from {u.render_as_string()}: {exc}"
        ) from exc


def _types(table: Table) -> list[tuple[str, str]]:
    """(name, Spark type) of each column read."""
    return [(c.split(" ")[0], c.split(" ")[1]) for c in table.columns.split(", ")]


def _sqlite_row(row: Any, names: Sequence[str]) -> tuple[Any, ...]:
    out = []
    for name, value in zip(names, row, strict=True):
        if isinstance(value, str) and name.endswith("_at"):
            value = datetime.fromisoformat(value)
        out.append(value)
    return tuple(out)


def _with_db(df: DataFrame, u: URL) -> DataFrame:
    from pyspark.sql import functions as F

    return df.withColumn("db", F.lit(u.render_as_string(hide_password=True)))


def read_store(
    spark: SparkSession, store: str, since_ms: int = 0, cached: list[DataFrame] | None = None
) -> DataFrame:
    """The broker store's transaction records (see :mod:`broker.store.export`): the Parquet
    exports of sealed segments where the broker has written them, the other segments
    decoded by the ``txmq-store`` data source.  With ``cached``, the decoded rows are
    cached (and added to it: the caller unpersists them), as the job reads the rows more
    than once and decoding is the expensive part."""
    from pyspark.sql import functions as F

    spark.dataSource.register(StoreDataSource)
    parts = segments(store, since_ms)
    exports = {p.path: valid_export(store, p.path) for p in parts if not p.last}
    decode = [Path(p.path).name for p in parts if exports.get(p.path) is None]
    decoded = (
        spark.read.format(NAME)
        .option("since_ms", str(since_ms))
        .option("segments", ",".join(decode))
        .load(store)
    )
    if cached is not None and decode:
        cached.append(decoded.cache())
    files = [str(e) for e in exports.values() if e is not None]
    if not files:
        return decoded
    exported = spark.read.schema(SCHEMA).parquet(*files)
    if since_ms:
        exported = exported.where(F.col("store_ts") >= since_ms)
    return exported.unionByName(decoded)
