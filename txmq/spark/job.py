"""The reconciliation job: ``txmq reconcile ...`` or ``spark-submit txmq/spark/job.py ...``.

::

    txmq reconcile --store /var/lib/txmq --db postgresql+psycopg://app@db/orders \\
        --db postgresql+psycopg://app@db/inventory --sla 10m --out reconcile-out

reads the broker's store (in a cluster, ``--store`` once per broker set:
``--store broker-a=/mnt/a/store --store broker-b=/mnt/b/store``), with the consumer groups'
committed offsets it keeps (``<store>/config/offsets.json``), and txmq's tables in every
``--db`` (a database may hold a transaction log, an outbox, consumed keys, sagas and their
step log, saga barrier rows, or any of them), classifies (see :mod:`txmq.spark.classify`
and, for sagas, :mod:`txmq.spark.sagas`), writes one Parquet table per anomaly class under
``--out``, prints a summary (also in ``summary.json``: the counts, the first rows of each
class, and facts such as each expected consumer group's evidence of consumption, consumed
keys or committed offsets) and exits 0 when nothing needs attention, 1 when something
does, 2 on bad input (unreadable store or database, bad option).  While it works, standard
error shows each phase and its duration (:mod:`txmq.spark.progress`), and nothing of
Spark's own start-up chatter unless ``--spark-log`` (:mod:`txmq.spark.launch`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from txmq.spark.launch import JDBC_JAR, default_driver_memory, session
from txmq.spark.options import MAX_ROWS, BadOption
from txmq.spark.progress import Progress, spark_tasks
from txmq.spark.result import Result, example_rows

__all__ = [
    "BROKER_FILE",
    "JDBC_JAR",
    "BadOption",
    "Options",
    "Progress",
    "Result",
    "add_arguments",
    "broker_stores",
    "default_driver_memory",
    "execute",
    "main",
    "options_from",
    "parse_args",
    "run",
    "session",
]

EXAMPLES = 5
#: the driver's heap a broadcast consumed key takes at its peak (10M keys need 2-3 GiB)
BROADCAST_BYTES = 320

#: where a store may record its broker set's name: ``{"broker_name": "broker-a", ...}``
BROKER_FILE = Path("config") / "broker.json"
#: a broker name as the broker accepts one (broker/state/config.py)
_BROKER_NAME = re.compile(r"^[^/\\;:%\s=]{1,255}$")


def broker_stores(items: Sequence[str]) -> list[tuple[str, str]]:
    """(broker name, store folder) of each ``--store``: ``NAME=PATH`` names the broker set,
    else the name the store records (``<store>/config/broker.json``), else the folder's
    name.  A name given and a name recorded that differ, or two stores of one name, are a
    :class:`BadOption`: offsets repeat across stores, so each needs its own name."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not _BROKER_NAME.match(name) or Path(item).is_dir():
            name, path = "", item
        recorded = _recorded_name(Path(path))
        if name and recorded and name != recorded:
            raise BadOption(
                f"--store {item}: that store records broker set {recorded!r} "
                f"({Path(path) / BROKER_FILE}), not {name!r}"
            )
        name = name or recorded or Path(path).resolve().name
        out.append((name, path))
    folders = [Path(p).resolve() for _, p in out]
    again = next((p for i, p in enumerate(folders) if p in folders[:i]), None)
    if again is not None:
        raise BadOption(f"store {again} is named twice: give each broker set's store once")
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadOption(
            f"two stores named {twice[0]!r}: name each broker set's store, "
            "--store NAME=PATH (one store per broker set)"
        )
    return out


def _recorded_name(store: Path) -> str | None:
    """The broker name ``store`` records, if it does."""
    try:
        data = json.loads((store / BROKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    name = data.get("broker_name") if isinstance(data, dict) else None
    return name if isinstance(name, str) and _BROKER_NAME.match(name) else None


@dataclass(frozen=True)
class Options:
    #: the broker stores, one per broker set: ``PATH`` or ``NAME=PATH`` (see
    #: :func:`broker_stores`); a single string is one store
    store: tuple[str, ...] | str
    dbs: tuple[str, ...]
    out: str
    sla: timedelta = timedelta(minutes=10)
    now: datetime | None = None
    since: datetime | None = None
    until: datetime | None = None
    expect: tuple[tuple[str, str], ...] | None = None
    producer_groups: tuple[str, ...] = ()
    master: str | None = None  # None: spark-submit's, else local[*]
    jdbc_jar: str = field(default_factory=lambda: os.environ.get("TXMQ_JDBC_JAR", JDBC_JAR))
    partitions: int = 4
    examples: int = EXAMPLES
    #: consumed keys up to this many are broadcast, more are shuffled (None: what fits)
    broadcast_keys: int | None = None
    #: the most rows of one class put together and written (its count stays exact)
    max_rows: int = MAX_ROWS
    #: Spark settings for the session the job makes (e.g. spark.driver.memory)
    conf: tuple[tuple[str, str], ...] = ()
    #: the session the job makes shows Spark's own output (its log at WARN, the JVM's
    #: notices) instead of keeping it quiet (see :mod:`txmq.spark.launch`)
    spark_log: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.store, str):  # Options(store="/var/lib/txmq"): one store
            object.__setattr__(self, "store", (self.store,))
        if not self.store:
            raise BadOption("name at least one broker store with --store")

    @property
    def stores(self) -> tuple[str, ...]:
        return (self.store,) if isinstance(self.store, str) else tuple(self.store)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def duration(text: str) -> timedelta:
    """``90``, ``30s``, ``10m``, ``2h``, ``1d`` as a timedelta."""
    m = _DURATION.match(text)
    if not m:
        raise BadOption(f"not a duration: {text!r} (say 30s, 10m, 2h or 1d)")
    return timedelta(seconds=float(m.group(1)) * _UNIT[m.group(2)])


def instant(text: str) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise), or ``-10m``: that long ago."""
    if text.startswith("-"):
        return datetime.now(UTC) - duration(text[1:])
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise BadOption(f"not a time: {text!r} (say 2026-11-23T10:00:00Z or -1h)") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        action="append",
        required=True,
        metavar="[NAME=]PATH",
        help="a broker's store folder; in a cluster, repeat it for each broker set, named "
        "NAME= (default: the name the store records, else the folder's name)",
    )
    p.add_argument(
        "--db",
        action="append",
        default=[],
        metavar="URL",
        help="a database with txmq tables (SQLAlchemy URL): transaction log, outbox, consumed "
        "keys, sagas, saga barrier; repeat for each service (a saga's participants are the "
        "databases holding its barrier rows)",
    )
    p.add_argument("--out", default="reconcile-out", help="folder for the Parquet tables")
    p.add_argument(
        "--sla",
        default="10m",
        help="how long delivery and consumption may take, and a saga may stay unchanged",
    )
    p.add_argument("--since", help="only transactions from this time (ISO 8601, or -1h)")
    p.add_argument("--until", help="only transactions before this time")
    p.add_argument("--now", help="read every view as of this time (default: now)")
    p.add_argument(
        "--expect",
        action="append",
        default=None,
        metavar="GROUP=TOPIC[,TOPIC]",
        help="consumer group GROUP must consume every message of TOPIC (default: the topics "
        "each group has consumed from, by its consumed keys or its committed offsets)",
    )
    p.add_argument(
        "--producer-group",
        action="append",
        default=[],
        metavar="GROUP",
        help="a producer group whose transactions the databases log (default: those in the logs)",
    )
    p.add_argument(
        "--master", help="Spark master (default: spark-submit's --master, else local[*])"
    )
    p.add_argument(
        "--jdbc-jar",
        default=os.environ.get("TXMQ_JDBC_JAR", JDBC_JAR),
        help=f"PostgreSQL JDBC driver (default {JDBC_JAR})",
    )
    p.add_argument("--partitions", type=int, default=4, help="JDBC reads per table")
    p.add_argument("--examples", type=int, default=EXAMPLES, help="examples per class shown")
    p.add_argument(
        "--max-rows",
        type=int,
        default=MAX_ROWS,
        metavar="N",
        help="write at most N rows of each class, the first by time; the counts stay exact "
        f"(default {MAX_ROWS:,})",
    )
    p.add_argument(
        "--broadcast-keys",
        type=int,
        metavar="N",
        help="broadcast at most N consumed keys to the messages, shuffle both sides beyond "
        f"(default: what fits in the driver's memory, {BROADCAST_BYTES} bytes a key)",
    )
    p.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, as spark-submit's --conf (e.g. spark.driver.memory=8g)",
    )
    p.add_argument(
        "--spark-log",
        action="store_true",
        help="show Spark's own output as Spark prints it: the JVM's start-up notices and "
        "Spark's log at WARN (default: quiet; Spark's errors show either way, and the job "
        "prints each phase with its duration)",
    )


def options_from(args: argparse.Namespace) -> Options:
    expect: list[tuple[str, str]] | None = None
    if args.expect is not None:
        expect = []
        for item in args.expect:
            group, sep, topics = item.partition("=")
            if not sep or not group or not topics:
                raise BadOption(f"--expect wants GROUP=TOPIC[,TOPIC], not {item!r}")
            expect += [(group, t) for t in topics.split(",") if t]
    if not args.db:
        raise BadOption("name at least one database with --db")
    if args.partitions < 1:
        raise BadOption("--partitions must be at least 1")
    if args.max_rows < 1:
        raise BadOption("--max-rows must be at least 1")
    if args.broadcast_keys is not None and args.broadcast_keys < 0:
        raise BadOption("--broadcast-keys must be 0 or more")
    return Options(
        store=tuple(args.store),
        dbs=tuple(args.db),
        out=args.out,
        sla=duration(args.sla),
        now=instant(args.now) if args.now else None,
        since=instant(args.since) if args.since else None,
        until=instant(args.until) if args.until else None,
        expect=tuple(expect) if expect is not None else None,
        producer_groups=tuple(args.producer_group),
        master=args.master,
        jdbc_jar=args.jdbc_jar,
        partitions=args.partitions,
        examples=args.examples,
        broadcast_keys=args.broadcast_keys,
        max_rows=args.max_rows,
        conf=tuple(_setting(c) for c in args.conf),
        spark_log=args.spark_log,
    )


def _setting(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise BadOption(f"--conf wants KEY=VALUE, not {item!r}")
    return key.strip(), value


def parse_args(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="txmq reconcile", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return options_from(args)
    except BadOption as exc:
        p.error(str(exc))
        raise  # unreachable


def _many(n: int, thing: str) -> str:
    """``1 store``, ``2 stores``."""
    return f"{n:,} {thing}" if n == 1 else f"{n:,} {thing}s"


def _write(rows: Any, folder: Path, schema: Any) -> None:
    """One anomaly table: ``folder`` as a Parquet table of one file (replaced)."""
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    table = pa.Table.from_pandas(rows[schema.names], schema=schema, preserve_index=False)
    pq.write_table(table, folder / "part-00000.parquet")


#: inputs up to this many bytes together (as Spark sizes them: exactly, for the ones read on
#: the driver) are planned without adaptive execution and shuffled into no more partitions
#: than the session has cores (see _plan_settings)
SMALL_BYTES = 64 * 2**20


def _size(df: Any) -> int | None:
    """The bytes Spark's optimizer reckons ``df`` takes (None: it cannot say).  Through
    Spark's internals (``queryExecution``, not public in PySpark): a Spark that has them
    otherwise is treated as a big input."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    try:
        n = df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()  # a Scala BigInt
        return n if isinstance(n, int) else int(n.toString())
    except (AttributeError, TypeError, ValueError, Py4JError):
        return None


def _plan_settings(spark: Any, inputs: Sequence[Any]) -> dict[str, str]:
    """The Spark SQL settings the passes run with: for small inputs, no adaptive execution
    (the passes ask for the broadcasts and the partitioning they want, and re-planning every
    query at each shuffle costs a job per stage) and as many shuffle partitions as cores at
    most (a task per partition and stage is most of what a small run costs).  Big inputs
    run with the session's settings."""
    sizes = [_size(df) for df in inputs]
    if any(n is None for n in sizes) or sum(n or 0 for n in sizes) > SMALL_BYTES:
        return {}
    settings = {"spark.sql.adaptive.enabled": "false"}
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    cores = max(int(spark.sparkContext.defaultParallelism), 1)
    if cores < partitions:
        settings["spark.sql.shuffle.partitions"] = str(cores)
    return settings


@contextmanager
def _settings(spark: Any, settings: dict[str, str]) -> Iterator[None]:
    """The session's SQL ``settings`` changed while the block runs (then as they were)."""
    before = {k: spark.conf.get(k, None) for k in settings}
    try:
        for k, v in settings.items():
            spark.conf.set(k, v)
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def run(opts: Options, spark: Any | None = None, progress: Progress | None = None) -> Result:
    """Reconcile once (with ``spark``, or a session made from ``opts``), telling
    ``progress`` each phase (default: nothing said)."""
    from txmq.spark.classify import CLASSES, classify
    from txmq.spark.common import Run, ms
    from txmq.spark.details import SCHEMA
    from txmq.spark.offsets import read_offsets
    from txmq.spark.sagas import SAGA_CLASSES, SAGA_SCHEMA, SagaFindings, reconcile_sagas
    from txmq.spark.sources import LOCAL_BYTES, Database, read_stores, read_tables
    from txmq.spark.store_source import segments

    progress = progress or Progress.off()
    started = time.perf_counter()
    # one cut: every view is read up to the same "as of" time, so a row that came after
    # it (a transaction still committing while the job reads) is left for the next run
    now = opts.now or datetime.now(UTC)
    margin = opts.sla
    since_read = opts.since - margin if opts.since else None
    until_read = min(opts.until + margin, now) if opts.until else now
    dbs: list[Database] = []
    checking = f"checking {_many(len(opts.stores), 'store')} and {_many(len(opts.dbs), 'database')}"
    try:
        with progress.phase(checking):
            stores = broker_stores(opts.stores)
            # clear errors before any Spark work
            parts = sum(len(segments(path)) for _, path in stores)
            committed = read_offsets(stores)
            dbs += [Database(url) for url in opts.dbs]
            pg = [db for db in dbs if db.pg]
            if pg and spark is None and not Path(opts.jdbc_jar).is_file():
                raise BadOption(
                    f"no PostgreSQL JDBC driver at {opts.jdbc_jar} (for {pg[0].name}): install "
                    "Debian's libpostgresql-jdbc-java, or name the jar with --jdbc-jar / "
                    "TXMQ_JDBC_JAR"
                )
            # the small queries first: an unreachable database is named before Spark starts
            producer_groups = set(opts.producer_groups).union(
                *(db.producer_groups(since_read, until_read) for db in dbs)
            )
            consumer_groups = set().union(*(db.consumer_groups() for db in dbs))
            keys = sum(db.estimate("consumed") for db in dbs)
            with_sagas = any(db.holds(k) for db in dbs for k in ("sagas", "barrier"))
        if spark is None:
            with progress.phase("starting Spark") as phase:
                spark = session(
                    opts.master, opts.jdbc_jar, spark_log=opts.spark_log, **dict(opts.conf)
                )
                phase.note = spark.sparkContext.master
        run = Run(spark, now, opts.sla, opts.since, opts.until, progress=progress)
        sc = spark.sparkContext
        progress.tasks(spark_tasks(sc))
        if sc.getConf().get("spark.ui.showConsoleProgress", "false").lower() == "true":
            progress.live = False  # Spark draws its own bar on the line: no second one
        limit = opts.broadcast_keys
        if limit is None:
            heap = spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory()
            limit = int(heap) // BROADCAST_BYTES
        since_ms = ms(since_read) if since_read else 0
        # the segments without an export are decoded (and cached)
        with run.step("store", f"reading {_many(len(stores), 'store')}") as phase:
            phase.note = _many(parts, "segment")
            store = read_stores(
                spark, stores, since_ms, ms(now), cached=run.cached, local_bytes=LOCAL_BYTES
            )
        # a message of the window may be consumed any time later (up to "as of"); a saga's
        # row, step log and barrier rows: from its creation (with the SLA as margin) up to
        # "as of" (its steps may come any time after it started).  Not cached: each pass
        # reads them once, only the columns it needs
        until = {"consumed": now, "steps": now, "barrier": now}
        kinds = ["log", "outbox", "consumed"]
        if with_sagas:
            kinds += ["sagas", "steps", "barrier"]
        tables = {}
        reading = f"reading {_many(len(dbs), 'database')}"
        with run.step("tables", reading, total=len(kinds) * len(dbs), unit="tables") as phase:
            for kind in kinds:
                tables[kind] = read_tables(
                    spark,
                    dbs,
                    kind,
                    since=since_read,
                    until=until.get(kind, until_read),
                    partitions=opts.partitions,
                    local_bytes=LOCAL_BYTES,
                )
                phase.advance(len(dbs))
        with _settings(spark, _plan_settings(spark, [store, *tables.values()])):
            anomalies, facts = classify(
                run,
                store,
                tables["log"],
                tables["outbox"],
                tables["consumed"],
                dbs=dbs,
                expect=opts.expect,
                producer_groups=producer_groups,
                consumer_groups=consumer_groups,
                committed=committed,
                broadcast=keys <= limit,
                max_rows=opts.max_rows,
            )
            sagas = SagaFindings()
            if with_sagas:
                sagas = reconcile_sagas(
                    run,
                    tables["sagas"],
                    tables["steps"],
                    tables["barrier"],
                    dbs=dbs,
                    max_rows=opts.max_rows,
                )
        rows = {**anomalies.rows, **sagas.rows}
        totals = {**anomalies.totals, **sagas.totals}
        out = Path(opts.out)
        writing = "writing the Parquet tables"
        with run.step("write", writing, total=len(CLASSES), unit="tables") as phase:
            counts = {c: totals.get(c, len(rows[c])) for c in CLASSES}
            examples = {c: example_rows(rows[c], opts.examples) for c in CLASSES}
            for c in CLASSES:
                _write(rows[c], out / c, SAGA_SCHEMA if c in SAGA_CLASSES else SCHEMA)
                phase.advance()
        fact_values: dict[str, Any] = {
            **facts.counts,
            "expected": facts.expected,
            # what each expected group's consumption was judged on
            "evidence": facts.evidence,
            "sagas": sagas.sagas,
            # service -> the databases its barrier rows are in (see txmq.spark.sagas)
            "saga_participants": sagas.participants,
            "window": f"{opts.since.isoformat() if opts.since else 'beginning'} .. "
            f"{opts.until.isoformat() if opts.until else 'end'}",
            "sla": str(opts.sla),
            "now": now.isoformat(timespec="seconds"),
            "master": spark.sparkContext.master,
            "stores": dict(stores),
            "consumed_keys": f"about {keys:,}, {'broadcast' if keys <= limit else 'shuffled'}",
            "seconds": run.seconds,
            # the classes with more rows than --max-rows: their tables hold the first ones
            "truncated": {c: opts.max_rows for c in totals},
        }
        run.unpersist()
    finally:
        progress.tasks(None)
        for db in dbs:
            db.close()
    result = Result(
        counts,
        examples,
        fact_values,
        str(out),
        time.perf_counter() - started,
        now=now,
        since=opts.since,
        until=opts.until,
        sla=opts.sla,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(
        json.dumps(
            {"ok": result.ok, "counts": counts, "facts": fact_values, "examples": examples},
            default=str,
            indent=2,
        )
    )
    return result


def execute(opts: Options, spark: Any | None = None) -> int:
    """Run once, print the summary; the exit code (0 clean, 1 anomalies, 2 bad input)."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        print("txmq reconcile needs PySpark: pip install 'txmq[spark]'", file=sys.stderr)
        return 2
    from txmq.spark.sources import DatabaseUnreachable
    from txmq.spark.store_source import StoreUnreadable

    # each phase on stderr as it ends (on a terminal, a live line while it runs); with
    # Spark's log shown, lines only: they would break through a live line
    with Progress(live=False if opts.spark_log else None) as progress:
        try:
            result = run(opts, spark, progress)
        except (StoreUnreadable, DatabaseUnreachable, BadOption) as exc:
            print(f"txmq reconcile: {exc}", file=sys.stderr)
            return 2
    print(result.summary())
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None, spark: Any | None = None) -> int:
    return execute(parse_args(argv), spark)


if __name__ == "__main__":
    sys.exit(main())
