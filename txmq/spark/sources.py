"""The three views as DataFrames: txmq's tables in each database, and the broker's store.

PostgreSQL tables are read through JDBC (the driver jar from Debian's
``libpostgresql-jdbc-java`` by default), split into ``partitions`` ranges of an indexed
column; the bounds and the list of tables come from a quick query through SQLAlchemy, which
also turns an unreachable database into a clear error before Spark starts reading.  SQLite
files (the embedded demo) are read through SQLAlchemy on the driver.  Databases are named by
their SQLAlchemy URLs, as everywhere else in txmq.  A table a database does not have is
read as no rows (every database has the tables it uses, whichever they are).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType
from sqlalchemy import bindparam, create_engine, inspect, make_url, text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.exc import SQLAlchemyError

from txmq.broker.store.export import arrow_schema, scan_segment, valid_export
from txmq.spark.common import local_frame, ms
from txmq.spark.store_source import NAME, SCHEMA, SegmentPart, StoreDataSource, segments

__all__ = [
    "LOCAL_BYTES",
    "TABLES",
    "Database",
    "DatabaseUnreachable",
    "Table",
    "jdbc_url",
    "read_store",
    "read_stores",
    "read_tables",
]


#: values per query when fetching rows by key
_CHUNK = 10_000
#: the job reads a table, or decodes store segments, on the driver up to this many bytes
#: (see :meth:`Database.read` and :func:`read_store`): a Spark read's own costs (a JDBC
#: schema query, a connection per task; a Python worker per segment) are most of the time
#: a small input takes
LOCAL_BYTES = 16 * 2**20


#: rows decoded on the driver beyond this many are cached (see :func:`read_store`)
LOCAL_ROWS = 4096


class DatabaseUnreachable(RuntimeError):
    """A database named on the command line cannot be read."""


@dataclass(frozen=True)
class Table:
    name: str
    columns: str  # Spark DDL of the columns read
    time_column: str  # the window applies to it
    split_column: str | None  # indexed: JDBC partitions are ranges of it (None: one read)
    #: timestamp columns read as epoch milliseconds too: (column, name of the ms column)
    ms: tuple[tuple[str, str], ...] = (("created_at", "created_ms"),)
    #: JSON columns, read as their text
    json: tuple[str, ...] = ()

    @property
    def types(self) -> list[tuple[str, str]]:
        """(name, Spark type) of each column read."""
        return [(c.split(" ")[0], c.split(" ")[1]) for c in self.columns.split(", ")]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.types]


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
    # sagas (txmq.saga): the coordinator's rows and step log, each participant's barrier
    "sagas": Table(
        "txmq_sagas",
        "saga_id string, name string, definition string, coordinator string, state string, "
        "step int, op string, effected string, error string, created_at timestamp, "
        "updated_at timestamp",
        "created_at",
        None,  # no index but the primary key (text) and (state, updated_at)
        ms=(("created_at", "created_ms"), ("updated_at", "updated_ms")),
        json=("definition", "effected"),
    ),
    "steps": Table(
        "txmq_saga_steps",
        "id long, saga_id string, step int, branch string, op string, event string, at timestamp",
        "at",
        "id",
        ms=(("at", "at_ms"),),
    ),
    "barrier": Table(
        "txmq_saga_barrier",
        "saga_id string, branch string, op string, reason string, created_at timestamp",
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
    column = f'"{table.time_column}"'
    if since is not None:
        parts.append(f"{column} >= {literal(since)}")
    if until is not None:
        parts.append(f"{column} < {literal(until)}")
    return " AND ".join(parts) or "1 = 1"


class Database:
    """One database named on the command line: its tables read as DataFrames, a few small
    queries (groups, the rows of the few anomalies) through one SQLAlchemy engine, which
    also turns an unreachable database into :class:`DatabaseUnreachable`."""

    def __init__(self, url: str | URL) -> None:
        self.url = make_url(url)
        self.pg = self.url.get_backend_name() == "postgresql"
        #: the URL without its password: the ``db`` column and messages show this
        self.name = self.url.render_as_string(hide_password=True)
        self._engine: Any = None
        self._tables: set[str] | None = None

    @contextmanager
    def connect(self, what: str) -> Iterator[Connection]:
        """A connection; any database error is :class:`DatabaseUnreachable` (``what`` says
        what was being read)."""
        try:
            if self._engine is None:
                self._engine = create_engine(self.url)
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise DatabaseUnreachable(f"cannot read {what} from {self.name}: {exc}") from exc

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def has(self, kind: str) -> bool:
        """Whether the database has txmq's table ``kind`` (a key of :data:`TABLES`)."""
        if self._tables is None:
            with self.connect(TABLES[kind].name) as conn:
                self._tables = set(inspect(conn).get_table_names())
        return TABLES[kind].name in self._tables

    def holds(self, kind: str) -> bool:
        """Whether the database has table ``kind`` with a row in it (one index probe)."""
        if not self.has(kind):
            return False
        table = TABLES[kind].name
        with self.connect(table) as conn:
            return conn.execute(text(f"SELECT 1 FROM {table} LIMIT 1")).first() is not None

    def read(
        self,
        spark: SparkSession,
        kind: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        partitions: int = 2,
        local_bytes: int = 0,
    ) -> DataFrame:
        """Table ``kind`` within the window, with its times as epoch milliseconds too
        (``created_ms`` for ``created_at``, see :attr:`Table.ms`) and a ``db`` column naming
        the database; empty if the database does not have the table.  PostgreSQL: JDBC,
        ``partitions`` ranges of an indexed column, or on the driver when the table takes
        at most ``local_bytes``; SQLite: read here, on the driver."""
        rows = self.rows(kind, since=since, until=until, local_bytes=local_bytes)
        if rows is not None:
            return local_frame(spark, rows, _columns(TABLES[kind]) + ", db string")
        return self._jdbc(spark, kind, since=since, until=until, partitions=partitions)

    def rows(
        self,
        kind: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        local_bytes: int = 0,
    ) -> list[tuple[Any, ...]] | None:
        """The rows :meth:`read` makes its DataFrame of (its columns, ``db`` last), read on
        the driver: a SQLite table, a table the database does not have (none), or a
        PostgreSQL table of at most ``local_bytes`` (None: a bigger one, for JDBC)."""
        return self._rows(kind, since, until, local_bytes)[0]

    def _rows(
        self, kind: str, since: datetime | None, until: datetime | None, local_bytes: int
    ) -> tuple[list[tuple[Any, ...]] | None, int]:
        """(:meth:`rows`, the bytes PostgreSQL's table takes: 0 for SQLite or no table)."""
        table = TABLES[kind]
        names = table.names
        if not self.has(kind):
            return [], 0
        if self.pg and local_bytes <= 0:
            return None, 0
        where = _where(table, since, until, self.pg)
        with self.connect(table.name) as conn:
            if not self.pg:  # SQLite: small, read on the driver
                q = f"SELECT {_quoted(names)} FROM {table.name} WHERE {where}"
                at = [names.index(c) for c, _ in table.ms]
                return [
                    (*r, *(None if r[i] is None else ms(r[i]) for i in at), self.name)
                    for r in (_sqlite_row(r, names) for r in conn.execute(text(q)))
                ], 0
            size = conn.execute(
                text("SELECT pg_table_size(to_regclass(:t))"), {"t": table.name}
            ).scalar()
            if size is None or size > local_bytes:
                return None, 0
            # the query JDBC would run, its values as JDBC reads them
            q = f"SELECT {', '.join(_select(table))} FROM {table.name} WHERE {where}"
            return [(*r, self.name) for r in conn.execute(text(q))], int(size)

    def _jdbc(
        self,
        spark: SparkSession,
        kind: str,
        *,
        since: datetime | None,
        until: datetime | None,
        partitions: int,
    ) -> DataFrame:
        """Table ``kind`` of a PostgreSQL database through JDBC (see :meth:`read`)."""
        table = TABLES[kind]
        where = _where(table, since, until, self.pg)
        lo: Any = None
        hi: Any = None
        with self.connect(table.name) as conn:
            if table.split_column is not None:
                lo, hi = conn.execute(
                    text(
                        f"SELECT min({table.split_column}), max({table.split_column}) "
                        f"FROM {table.name} WHERE {where}"
                    )
                ).one()
        url, props = jdbc_url(self.url)
        query = f"(SELECT {', '.join(_select(table))} FROM {table.name} WHERE {where}) AS t"
        reader = spark.read.format("jdbc").option("url", url).option("dbtable", query)
        reader = reader.option("fetchsize", "50000").options(**props)
        if lo is not None and partitions > 1 and lo != hi:
            if isinstance(lo, datetime):
                lo_s = lo.isoformat(sep=" ")
                hi_s = (hi + timedelta(microseconds=1)).isoformat(sep=" ")
            else:
                lo_s, hi_s = str(lo), str(int(hi) + 1)
            reader = (
                reader.option("partitionColumn", table.split_column)
                .option("lowerBound", lo_s)
                .option("upperBound", hi_s)
                .option("numPartitions", str(partitions))
            )
        df = reader.load()
        # each column as the job's type: cast only where JDBC's differs (a cast, even to the
        # same type, keeps Spark from handing a filter on the column to PostgreSQL)
        have = {f.name: f.dataType for f in df.schema.fields}
        wanted = [*table.types, *((alias, "long") for _, alias in table.ms)]
        cast = [
            F.col(f"`{c}`")
            if have.get(c) == DataType.fromDDL(t)
            else F.col(f"`{c}`").cast(t).alias(c)
            for c, t in wanted
        ]
        return self._with_db(df.select(*cast))

    def producer_groups(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> set[str]:
        """The producer groups in the transaction log (within the window): the groups whose
        transactions the run can check."""
        table = TABLES["log"]
        if not self.has("log"):
            return set()
        where = _where(table, since, until, self.pg)
        with self.connect(table.name) as conn:
            q = text(f"SELECT DISTINCT producer_group FROM {table.name} WHERE {where}")
            return {r[0] for r in conn.execute(q)}

    def estimate(self, kind: str) -> int:
        """About how many rows table ``kind`` has: PostgreSQL's statistics when it has any
        (no scan), else a count."""
        table = TABLES[kind].name
        if not self.has(kind):
            return 0
        with self.connect(table) as conn:
            if self.pg:
                est = conn.execute(
                    text("SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(:t)"),
                    {"t": table},
                ).scalar()
                if est is not None and est >= 0:  # -1: never analyzed
                    return int(est)
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() or 0)

    def consumer_groups(self) -> set[str]:
        """The consumer groups with consumed keys: one index probe per group (the primary key
        starts with the group), not a scan of the keys."""
        table = TABLES["consumed"].name
        if not self.has("consumed"):
            return set()
        q = text(
            f"WITH RECURSIVE g(v) AS (SELECT min(consumer_group) FROM {table} UNION ALL "
            f"SELECT (SELECT min(consumer_group) FROM {table} WHERE consumer_group > g.v) "
            "FROM g WHERE g.v IS NOT NULL) SELECT v FROM g WHERE v IS NOT NULL"
        )
        with self.connect(table) as conn:
            return {r[0] for r in conn.execute(q)}

    def fetch(
        self, kind: str, where: dict[str, Sequence[Any]], extra: str = ""
    ) -> list[tuple[Any, ...]]:
        """The rows of table ``kind`` (its columns, then ``db``) whose columns hold one of the
        values given for them in ``where`` (and meet ``extra``, SQL): the few rows of the
        anomalies, by key, in chunks."""
        table = TABLES[kind]
        if not self.has(kind) or not all(where.values()):
            return []
        names = table.names
        (col, values), *fixed = sorted(where.items(), key=lambda kv: -len(kv[1]))
        cond = " AND ".join(f"{c} IN :{c}" for c in [col, *(c for c, _ in fixed)])
        q = text(
            f"SELECT {_quoted(names)} FROM {table.name} WHERE {cond}"
            + (f" AND {extra}" if extra else "")
        ).bindparams(*(bindparam(c, expanding=True) for c in [col, *(c for c, _ in fixed)]))
        out: list[tuple[Any, ...]] = []
        values = list(values)
        with self.connect(table.name) as conn:
            for i in range(0, len(values), _CHUNK):
                params = {col: values[i : i + _CHUNK], **{c: list(v) for c, v in fixed}}
                out += [(*_sqlite_row(r, names), self.name) for r in conn.execute(q, params)]
        return out

    def _with_db(self, df: DataFrame) -> DataFrame:
        return df.withColumn("db", F.lit(self.name))


def _columns(table: Table) -> str:
    """The Spark DDL of the columns :meth:`Database.read` gives (but ``db``)."""
    return table.columns + "".join(f", {alias} long" for _, alias in table.ms)


def _select(table: Table) -> list[str]:
    """A PostgreSQL select list of ``table``'s columns as the job reads them: JSON as its
    text, and the times as epoch milliseconds too (what the passes use, and a number is much
    cheaper for the driver to read than a timestamp's text)."""
    read = [f'"{n}"::text AS "{n}"' if n in table.json else f'"{n}"' for n in table.names]
    return read + [
        f'floor(extract(epoch FROM "{c}") * 1000)::bigint AS {alias}' for c, alias in table.ms
    ]


def read_tables(
    spark: SparkSession,
    dbs: Sequence[Database],
    kind: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    partitions: int = 2,
    local_bytes: int = 0,
) -> DataFrame:
    """Table ``kind`` of every database in ``dbs`` (see :meth:`Database.read`), as one
    DataFrame: the rows read on the driver together, the bigger tables through JDBC.  The
    PostgreSQL tables read on the driver take at most ``local_bytes`` together."""
    local: list[tuple[Any, ...]] = []
    frames = []
    left = local_bytes
    for db in dbs:
        rows, size = db._rows(kind, since, until, left)
        if rows is None:
            frames.append(db._jdbc(spark, kind, since=since, until=until, partitions=partitions))
        else:
            local += rows
            left -= size
    if local or not frames:
        frames.insert(0, local_frame(spark, local, _columns(TABLES[kind]) + ", db string"))
    return functools.reduce(lambda a, b: a.unionByName(b), frames)


def _quoted(names: Sequence[str]) -> str:
    """Column names as a select list (quoted: ``at`` is a keyword of PostgreSQL's)."""
    return ", ".join(f'"{n}"' for n in names)


def _sqlite_row(row: Any, names: Sequence[str]) -> tuple[Any, ...]:
    out = []
    for name, value in zip(names, row, strict=True):
        if isinstance(value, str) and (name == "at" or name.endswith("_at")):
            value = datetime.fromisoformat(value)
        out.append(value)
    return tuple(out)


def read_store(
    spark: SparkSession,
    store: str,
    since_ms: int = 0,
    until_ms: int | None = None,
    cached: list[DataFrame] | None = None,
    local_bytes: int = 0,
) -> DataFrame:
    """The broker store's transaction records (see :mod:`broker.store.export`): the Parquet
    exports of sealed segments where the broker has written them, the other segments
    decoded by the ``txmq-store`` data source, or here, on the driver, when they take at
    most ``local_bytes`` together or are one segment (typically the newest: the others have
    their export; the data source would decode it in one task too, after starting a Python
    worker, and cache what it decoded).  With ``until_ms``, the store as it was then:
    the records stored before it (a half's op record stored later is left out too).  With
    ``cached``, the rows the data source decodes are cached and computed now (and added to
    it: the caller unpersists them), as the job reads the rows more than once and decoding
    is the expensive part."""
    parts = segments(store, since_ms)
    exports = {p.path: valid_export(store, p.path) for p in parts if not p.last}
    decode = [p for p in parts if exports.get(p.path) is None]
    if len(decode) <= 1 or sum(_size(p.path) for p in decode) <= local_bytes:
        decoded, count = _decoded(spark, decode, since_ms)
        if cached is not None and count > LOCAL_ROWS:
            # a local relation's rows are part of its plan, which Spark's rules walk through
            # row by row in every query that reads it: cached, the plan holds none
            cached.append(decoded.cache())
            decoded.count()
    else:
        spark.dataSource.register(StoreDataSource)
        decoded = (
            spark.read.format(NAME)
            .option("since_ms", str(since_ms))
            .option("segments", ",".join(Path(p.path).name for p in decode))
            .load(store)
        )
        if cached is not None:
            cached.append(decoded.cache())
            decoded.count()
    files = [str(e) for e in exports.values() if e is not None]
    rows = decoded
    if files:
        exported = spark.read.schema(SCHEMA).parquet(*files)
        if since_ms:
            exported = exported.where(F.col("store_ts") >= since_ms)
        rows = exported.unionByName(decoded)
    if until_ms is None:
        return rows
    # the export folds a half's first op record into the half's row: one stored after the
    # cut is not there yet
    later = F.col("op_ts") >= until_ms
    return rows.where(F.col("store_ts") < until_ms).select(
        *(
            F.when(later, None).otherwise(F.col(c)).alias(c) if c in ("op_ts", "resolution") else c
            for c in rows.columns
        )
    )


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0  # gone: it decodes to nothing either way


def _decoded(
    spark: SparkSession, parts: Sequence[SegmentPart], since_ms: int
) -> tuple[DataFrame, int]:
    """The rows of segments ``parts``, decoded here (as the data source's readers do), and
    how many they are."""
    import pyarrow as pa  # type: ignore[import-untyped]

    schema = arrow_schema()
    batches = [b for p in parts for b in scan_segment(p.path, p.last, since_ms)]
    table = pa.Table.from_batches(batches, schema=schema)
    return spark.createDataFrame(table, schema=SCHEMA), int(table.num_rows)


def read_stores(
    spark: SparkSession,
    stores: Sequence[tuple[str, str]],
    since_ms: int = 0,
    until_ms: int | None = None,
    cached: list[DataFrame] | None = None,
    local_bytes: int = 0,
) -> DataFrame:
    """The rows of several broker stores (``stores``: (broker name, folder), one per broker
    set of a cluster), each read by :func:`read_store`, with a ``broker`` column naming the
    broker set it came from: commit-log offsets (``half_offset``) repeat across stores, so a
    half is named by (``broker``, ``half_offset``); message ids are unique in the cluster."""
    frames = [
        read_store(spark, path, since_ms, until_ms, cached, local_bytes).withColumn(
            "broker", F.lit(name)
        )
        for name, path in stores
    ]
    return functools.reduce(lambda a, b: a.unionByName(b), frames)
