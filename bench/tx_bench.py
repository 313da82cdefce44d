"""Transactional sends: database + message, against the database alone.

    python bench/tx_bench.py [--duration 10] [--warmup 2] [--concurrency 1,16]
                             [--db URL] [--flush async,sync] [--rounds 1]
                             [--scenarios abc] [--json out.json]

One business transaction — insert one order row through a SQLAlchemy ``AsyncSession``
(psycopg 3, pool of 20) and commit — measured side by side, in one run, as:

- ``(a) order only``: that alone;
- ``(b) order + outbox row``: plus one INSERT of an outbox-like row (topic, key, ~200 B
  bytea body) in the same transaction — the physical floor of "database + message";
- ``(c) txmq``: ``async with txmq.sqla.transaction(producer, session) as tx``: the order
  row, ``tx.send(Message(...))`` (a half message), the log row; commit, then COMMIT at
  the broker — against a real broker process (``txmq broker start``), once per flush mode
  in ``--flush``, with a :class:`SqlTransactionChecker` as the producer's listener.

For each concurrency, ``N`` asyncio workers run transactions back to back for
``--warmup`` seconds (not counted), then ``--duration`` seconds; a transaction counts if
it started and ended inside the measured window. ``--rounds N`` repeats the whole sequence
N times (so a slow spell of the machine hits every scenario alike) and pools the rounds.
Reported: transactions/s, latency p50/p99 per transaction, for txmq the ratio to (b), and
where the CPU went (milliseconds per transaction in this client process, the broker
process and all local ``postgres`` processes; how busy the whole machine was). At the end
every txmq message must be committed: the broker's pending transactions
(``AdminClient.transactions("pending")``) are counted after a short wait, and the topic
must hold one message per transaction.

Everything runs in a fresh PostgreSQL schema, dropped at the end; the brokers run in
temporary directories, stopped and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Identity,
    LargeBinary,
    String,
    func,
    insert,
    make_url,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import txmq.sqla  # noqa: E402
from bench.common import TICK, Node, machine_info, percentile, proc_cpu  # noqa: E402
from txmq import AdminClient, Message, TransactionProducer  # noqa: E402
from txmq.sqla import SqlTransactionChecker, transaction  # noqa: E402

DEFAULT_DB = os.environ.get(
    "TXMQ_BENCH_DATABASE_URL",
    os.environ.get("TXMQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
TOPIC = "bench-orders"
GROUP = "bench-orders-tx"
POOL_SIZE = 20


# -- the business tables --------------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "bench_orders"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    customer: Mapped[str] = mapped_column(String(64))
    amount_cents: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Outbox(Base):
    """Outbox-like, not txmq's outbox (that arrives with a later issue)."""

    __tablename__ = "bench_outbox"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    topic: Mapped[str] = mapped_column(String(128))
    key: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


OUTBOX = Outbox.__table__


def new_order() -> tuple[Order, bytes]:
    """A new order and its ~200-byte event body."""
    oid = str(uuid.uuid4())
    order = Order(id=oid, customer="customer-0042", amount_cents=12_345, status="created")
    body = json.dumps(
        {
            "type": "order.created",
            "order_id": oid,
            "customer": order.customer,
            "amount_cents": order.amount_cents,
            "currency": "EUR",
            "lines": [{"sku": "SKU-000123", "qty": 2}, {"sku": "SKU-000456", "qty": 1}],
            "at": "2026-11-22T12:00:00Z",
        },
        separators=(",", ":"),
    ).encode()
    return order, body


# -- the scenarios --------------------------------------------------------------------------

TxFn = Callable[[], Awaitable[None]]


def order_only(sessions: async_sessionmaker[Any]) -> TxFn:
    async def one() -> None:
        async with sessions() as session:
            order, _ = new_order()
            session.add(order)
            await session.commit()

    return one


def order_and_outbox(sessions: async_sessionmaker[Any]) -> TxFn:
    async def one() -> None:
        async with sessions() as session:
            order, body = new_order()
            session.add(order)
            # the leanest outbox write: one Core INSERT, nothing read back (as txmq's log row)
            await session.execute(insert(OUTBOX).values(topic=TOPIC, key=order.id, body=body))
            await session.commit()

    return one


def with_txmq(sessions: async_sessionmaker[Any], producer: TransactionProducer) -> TxFn:
    async def one() -> None:
        async with sessions() as session:
            async with transaction(producer, session) as tx:
                order, body = new_order()
                session.add(order)
                await tx.send(Message(TOPIC, body, keys=[order.id]), sharding_key=order.id)

    return one


# -- where the CPU goes ----------------------------------------------------------------------


def postgres_cpu() -> dict[int, float]:
    """CPU seconds of every local ``postgres`` process (the server and its backends)."""
    found: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "postgres":
                    found[int(d.name)] = proc_cpu(int(d.name))
            except OSError:
                continue
    return found


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes used between two :func:`postgres_cpu` samples (those that
    exited in between are not counted; those that started are, from their start)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


@dataclass
class CpuSample:
    client: float
    broker: float
    postgres: dict[int, float]
    busy: float  # machine-wide busy seconds (all cores)
    wall: float

    @classmethod
    def take(cls, broker_pid: int | None) -> CpuSample:
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(x) for x in cpu]
        idle = ticks[3] + ticks[4]  # idle + iowait
        return cls(
            client=time.process_time(),
            broker=proc_cpu(broker_pid) if broker_pid else 0.0,
            postgres=postgres_cpu(),
            busy=(sum(ticks[:8]) - idle) / TICK,
            wall=time.perf_counter(),
        )


@dataclass
class Row:
    scenario: str
    concurrency: int
    transactions: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    errors: int = 0
    first_error: str = ""
    #: CPU milliseconds per transaction in the measured window, and the machine's load
    cpu_client_ms: float = 0.0
    cpu_broker_ms: float = 0.0
    cpu_postgres_ms: float = 0.0
    machine_busy: float = 0.0  # fraction of all cores busy

    @property
    def tps(self) -> float:
        return self.transactions / self.seconds if self.seconds else 0.0

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


async def measure(
    name: str,
    fn: TxFn,
    concurrency: int,
    warmup: float,
    duration: float,
    broker_pid: int | None = None,
    *,
    unit: str = "tx",
    timeout: float | None = None,
) -> Row:
    """``concurrency`` workers run ``fn`` back to back; count what falls in the window
    (``unit``: what one run of ``fn`` is called in the printed line; ``timeout``: a run that
    takes longer is an error)."""
    row = Row(name, concurrency)
    gc.collect()
    t_start = time.perf_counter() + warmup
    t_end = t_start + duration
    done = 0
    latencies: list[float] = []
    samples: list[CpuSample] = []

    async def sampler() -> None:
        for t in (t_start, t_end):
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            samples.append(CpuSample.take(broker_pid))

    async def worker() -> None:
        nonlocal done
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            try:
                await asyncio.wait_for(fn(), timeout)
            except Exception as exc:  # counted and shown; the run goes on
                row.errors += 1
                row.first_error = row.first_error or f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.01)
                continue
            t1 = time.perf_counter()
            if t0 >= t_start and t1 <= t_end:
                done += 1
                latencies.append((t1 - t0) * 1000)

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    row.transactions, row.seconds, row.latencies_ms = done, duration, latencies
    s0, s1 = samples
    if done:
        row.cpu_client_ms = (s1.client - s0.client) * 1000 / done
        row.cpu_broker_ms = (s1.broker - s0.broker) * 1000 / done
        row.cpu_postgres_ms = cpu_between(s0.postgres, s1.postgres) * 1000 / done
    row.machine_busy = (s1.busy - s0.busy) / ((s1.wall - s0.wall) * (os.cpu_count() or 1))
    print(
        f"  {name:<34} c={concurrency:<3} {row.tps:>8,.0f} {unit}/s   p50 {row.p(50):6.2f} ms   "
        f"p99 {row.p(99):6.2f} ms   CPU/{unit} {row.cpu_client_ms:.2f} client "
        f"{row.cpu_broker_ms:.2f} broker {row.cpu_postgres_ms:.2f} pg ms, "
        f"busy {row.machine_busy:.0%}"
        + (f"   errors {row.errors} ({row.first_error})" if row.errors else ""),
        flush=True,
    )
    return row


# -- the broker -----------------------------------------------------------------------------


class BrokerProc:
    """``txmq broker start`` (``flush``) in a temporary folder, removed by :meth:`stop`."""

    def __init__(self, flush: str) -> None:
        self.flush = flush
        self.tmp = Path(tempfile.mkdtemp(prefix=f"txmq-txbench-{flush}-"))
        argv = ["broker", "start", "--store", str(self.tmp / "store"), "--flush", flush]
        self.node = Node("broker", argv, self.tmp, timeout=30)
        self.address = ""

    async def start(self) -> None:
        self.address = await self.node.start().wait_ready_async()
        async with AdminClient(self.address) as admin:
            await admin.create_topic(TOPIC, 4)

    async def stop(self) -> None:
        await self.node.stop_async()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def broker_audit(address: str, wait: float = 5.0) -> tuple[int, int]:
    """(pending transactions after up to ``wait`` seconds, messages stored in TOPIC)."""
    async with AdminClient(address) as admin:
        deadline = time.monotonic() + wait
        while True:
            pending = len(await admin.transactions("pending", 1000))
            if pending == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        stats = await admin.topic_stats(TOPIC)
    return pending, sum(q.max_offset - q.min_offset for q in stats)


# -- the run --------------------------------------------------------------------------------


class CountingTx:
    """Counts the transactions a scenario function completed (warm-up included)."""

    def __init__(self, fn: TxFn) -> None:
        self.fn = fn
        self.count = 0

    async def __call__(self) -> None:
        await self.fn()
        self.count += 1


async def truncate(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE bench_orders, bench_outbox, txmq_transaction_log"))
    async with engine.connect() as conn:  # fresh statistics, no dead tuples from the last run
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE bench_orders, bench_outbox, txmq_transaction_log"))


async def run(args: argparse.Namespace) -> list[Row]:
    schema = f"txmq_bench_{uuid.uuid4().hex[:10]}"
    admin_engine = create_async_engine(args.db, isolation_level="AUTOCOMMIT")
    async with admin_engine.connect() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        version = (await conn.execute(text("SHOW server_version"))).scalar()
        sync_commit = (await conn.execute(text("SHOW synchronous_commit"))).scalar()
    url = make_url(args.db).update_query_dict({"options": f"-csearch_path={schema}"})
    engine = create_async_engine(url, pool_size=POOL_SIZE, max_overflow=0)
    brokers: list[BrokerProc] = []
    producers: list[TransactionProducer] = []
    rows: list[Row] = []
    try:
        async with engine.begin() as conn:
            await conn.run_sync(txmq.sqla.upgrade)  # txmq_transaction_log
            await conn.run_sync(Base.metadata.create_all)
        print(f"PostgreSQL {version} (synchronous_commit={sync_commit}), schema {schema}")
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        checker = SqlTransactionChecker(engine)
        scenarios: list[tuple[str, TxFn, int | None]] = [
            ("(a) order only", order_only(sessions), None),
            ("(b) order + outbox row", order_and_outbox(sessions), None),
        ]
        counted: list[tuple[BrokerProc, CountingTx]] = []
        for flush in args.flush:
            broker = BrokerProc(flush)
            brokers.append(broker)
            await broker.start()
            producer = TransactionProducer(broker.address, GROUP, listener=checker)
            await producer.start()
            producers.append(producer)
            fn = CountingTx(with_txmq(sessions, producer))
            counted.append((broker, fn))
            scenarios.append((f"(c) txmq, {flush} flush", fn, broker.node.pid))
        # warm the pool: every connection opened once
        await asyncio.gather(*(order_only(sessions)() for _ in range(POOL_SIZE)))
        cells: dict[tuple[str, int], list[Row]] = {}
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                print(f"round {r + 1} of {args.rounds}, concurrency {concurrency}:", flush=True)
                for name, fn, pid in scenarios:
                    if name[1] not in args.scenarios:
                        continue
                    await truncate(engine)
                    await asyncio.sleep(args.pause)
                    row = await measure(name, fn, concurrency, args.warmup, args.duration, pid)
                    cells.setdefault((name, concurrency), []).append(row)
        rows.extend(merge(cell) for cell in cells.values())
        print()
        for broker, fn in counted:
            pending, stored = await broker_audit(broker.address)
            ok = pending == 0 and stored == fn.count
            print(
                f"txmq {broker.flush} flush: {fn.count} transactions committed by the client, "
                f"{stored} messages in {TOPIC!r}, pending transactions at the broker: {pending}"
                f" -> {'OK' if ok else 'MISMATCH'}"
            )
            if not ok:
                rows.append(Row(f"AUDIT FAILED ({broker.flush})", 0, errors=1))
    finally:
        for producer in producers:
            await producer.stop()
        for broker in brokers:
            await broker.stop()
        await engine.dispose()
        async with admin_engine.connect() as conn:
            await conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        await admin_engine.dispose()
    return rows


def merge(rows: Sequence[Row]) -> Row:
    """One row for the rounds of one cell: their transactions and latencies pooled."""
    done = sum(r.transactions for r in rows)

    def per_tx(attr: str) -> float:
        return sum(getattr(r, attr) * r.transactions for r in rows) / done if done else 0.0

    return Row(
        rows[0].scenario,
        rows[0].concurrency,
        transactions=done,
        seconds=sum(r.seconds for r in rows),
        latencies_ms=[x for r in rows for x in r.latencies_ms],
        errors=sum(r.errors for r in rows),
        first_error=next((r.first_error for r in rows if r.first_error), ""),
        cpu_client_ms=per_tx("cpu_client_ms"),
        cpu_broker_ms=per_tx("cpu_broker_ms"),
        cpu_postgres_ms=per_tx("cpu_postgres_ms"),
        machine_busy=sum(r.machine_busy for r in rows) / len(rows),
    )


def format_table(rows: Sequence[Row]) -> str:
    base = {r.concurrency: r.tps for r in rows if r.scenario.startswith("(b)")}
    headers = [
        "scenario",
        "concurrency",
        "tx/s",
        "p50 ms",
        "p99 ms",
        "vs (b)",
        "CPU ms/tx: client",
        "broker",
        "postgres",
        "machine busy",
    ]
    body = []
    for r in rows:
        if not r.concurrency:
            continue
        ratio = f"{r.tps / base[r.concurrency]:.0%}" if base.get(r.concurrency) else "-"
        body.append(
            [
                r.scenario + (f" [{r.errors} errors]" if r.errors else ""),
                str(r.concurrency),
                f"{r.tps:,.0f}",
                f"{r.p(50):.2f}",
                f"{r.p(99):.2f}",
                ratio,
                f"{r.cpu_client_ms:.2f}",
                f"{r.cpu_broker_ms:.2f}" if r.cpu_broker_ms else "-",
                f"{r.cpu_postgres_ms:.2f}",
                f"{r.machine_busy:.0%}",
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells)
        )

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, body)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds before each")
    p.add_argument("--concurrency", default="1,16", help="comma-separated worker counts")
    p.add_argument("--db", default=DEFAULT_DB, help="PostgreSQL URL (postgresql+psycopg://...)")
    p.add_argument("--flush", default="async,sync", help="broker flush modes for (c)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every cell this many times, interleaved; the table pools them",
    )
    p.add_argument("--scenarios", default="abc", help="which of (a), (b), (c) to run")
    p.add_argument("--pause", type=float, default=1.0, help="idle seconds between cells")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.flush = [f.strip() for f in args.flush.split(",") if f.strip()]
    if any(f not in ("async", "sync") for f in args.flush):
        p.error("--flush takes async, sync or both")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if any(c < 1 or c > POOL_SIZE for c in args.concurrency):
        p.error(f"--concurrency values must be between 1 and {POOL_SIZE} (the pool size)")
    if not args.scenarios or set(args.scenarios) - set("abc"):
        p.error("--scenarios takes letters from abc")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be positive, --warmup not negative")
    if make_url(args.db).get_backend_name() != "postgresql":
        p.error("--db must be a PostgreSQL URL")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows = asyncio.run(run(args))
    mi = machine_info()
    print()
    print(f"machine: nproc={mi['nproc']}  cpu={mi['cpu']}  python {mi['python']}")
    print(
        f"{args.duration:g} s measured after {args.warmup:g} s warm-up per cell, "
        f"{args.rounds} round(s); "
        f"wall time {time.perf_counter() - t0:.0f} s"
    )
    print()
    print(format_table(rows))
    if args.json:
        doc = {
            "machine": mi,
            "params": {k: v for k, v in vars(args).items() if k != "db"},
            "rows": [
                {**asdict(r), "latencies_ms": None, "tps": r.tps, "p50": r.p(50), "p99": r.p(99)}
                for r in rows
            ],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
