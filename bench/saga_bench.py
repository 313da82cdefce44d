"""Sagas across three services on PostgreSQL, side by side in one run.

    python bench/saga_bench.py [--duration 10] [--warmup 3] [--concurrency 16]
                               [--rounds 2] [--db URL] [--scenarios abcd]

One flow — an order is created in the order service, then stock is reserved in the
inventory service, then the customer is charged in the payment service, and the order
service knows durably that it completed — each service with its own schema and
connection pool, every step with a compensation ready (release stock, refund), run as:

- ``(a) direct SQL``: the four local transactions one after another, no messaging, no
  record of progress: the floor;
- ``(b) choreography``: what teams write by hand on txmq today: the order service commits
  the order with a transactional ``OrderCreated``; inventory consumes it and, in one local
  transaction, records its dedupe key, reserves and sends ``StockReserved`` transactionally;
  payment the same, sending ``PaymentDone``; the order service consumes that, marks the
  order confirmed;
- ``(c) DBOS``: the same flow as a DBOS workflow (``pip install dbos``; its system database
  on the same PostgreSQL): create, reserve, charge, confirm as DBOS steps, the
  compensations written by hand in ``except`` as DBOS users do;
- ``(d) txmq saga``: ``txmq.saga``: the coordinator starts the saga in the order's
  transaction; reserve and charge are participants' actions behind the barrier; the
  coordinator's COMPLETED row is the durable outcome.

The broker is a real broker process (ASYNC flush); every client runs in this process.
``--concurrency`` workers each start a flow and wait for its end, back to back, for
``--warmup`` then ``--duration`` seconds; a flow counts if it started and ended inside the
measured window.  Reported: flows/s, p50 and p99 latency (start to the durable outcome),
the ratios asked for (saga vs DBOS, saga vs choreography), and an audit: every started
saga COMPLETED, every choreography order confirmed, stock and money moved once per flow.
``--rounds N`` alternates the scenarios N times (this machine is noisy) and pools them.
Everything runs in fresh schemas (and a fresh DBOS database), dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import txmq.sqla  # noqa: E402
from bench.common import Node, machine_info  # noqa: E402
from bench.tx_bench import Row, measure, merge  # noqa: E402
from txmq import (  # noqa: E402
    AdminClient,
    ConsumeFrom,
    Message,
    MessageExt,
    PushConsumer,
    TransactionProducer,
)
from txmq.saga import Coordinator, Participant, Saga, Step  # noqa: E402
from txmq.saga.group import MAX_GROUP  # noqa: E402
from txmq.saga.model import decode_reply  # noqa: E402
from txmq.sqla import SqlTransactionChecker, transaction  # noqa: E402
from txmq.sqla.tables import consumed_keys  # noqa: E402

DEFAULT_DB = os.environ.get(
    "TXMQ_BENCH_DATABASE_URL",
    os.environ.get("TXMQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
SERVICES = ("orders", "inventory", "payment")
PRODUCTS, ACCOUNTS = 64, 1024
POOL_SIZE = 20
CHECKOUT = Saga(
    "checkout",
    [
        Step("reserve", "inventory", compensation="release"),
        Step("charge", "payment", compensation="refund"),
    ],
)
TOPICS = ("saga-inventory", "saga-payment", "saga-orders-replies", "order-created",
          "stock-reserved", "payment-done")  # fmt: skip

# -- the business (the same SQL in every scenario) ---------------------------------------------

BUSINESS = {
    "orders": "CREATE TABLE bench_orders (id varchar(36) PRIMARY KEY, product int NOT NULL, "
    "account int NOT NULL, status varchar(16) NOT NULL)",
    "inventory": "CREATE TABLE bench_stock (product int PRIMARY KEY, available bigint NOT NULL, "
    "reserved bigint NOT NULL)",
    "payment": "CREATE TABLE bench_accounts (account int PRIMARY KEY, balance bigint NOT NULL)",
}
CREATE = text("INSERT INTO bench_orders (id, product, account, status) VALUES (:id, :p, :a, :s)")
CONFIRM = text("UPDATE bench_orders SET status = 'confirmed' WHERE id = :id")
RESERVE = text(
    "UPDATE bench_stock SET available = available - 1, reserved = reserved + 1 WHERE product = :p"
)
RELEASE = text(
    "UPDATE bench_stock SET available = available + 1, reserved = reserved - 1 WHERE product = :p"
)
CHARGE = text("UPDATE bench_accounts SET balance = balance - 100 WHERE account = :a")
REFUND = text("UPDATE bench_accounts SET balance = balance + 100 WHERE account = :a")


def new_flow() -> dict[str, Any]:
    oid = str(uuid.uuid4())
    h = zlib.crc32(oid.encode())
    return {"id": oid, "p": h % PRODUCTS, "a": h % ACCOUNTS}


Sessions = async_sessionmaker[AsyncSession]


@dataclass
class World:
    engines: dict[str, AsyncEngine]
    sessions: dict[str, Sessions]
    address: str = ""
    #: flows waiting for their end (id -> event), set by the scenario's last consumer
    waiting: dict[str, asyncio.Event] = field(default_factory=dict)

    def ended(self, flow_id: str) -> None:
        event = self.waiting.get(flow_id)
        if event is not None:
            event.set()

    async def wait_end(self, flow_id: str) -> None:
        await self.waiting[flow_id].wait()


FlowFn = Callable[[], Awaitable[None]]

# -- (a) direct SQL ---------------------------------------------------------------------------


def direct(w: World) -> FlowFn:
    async def one() -> None:
        f = new_flow()
        async with w.sessions["orders"].begin() as s:
            await s.execute(CREATE, {**f, "s": "pending"})
        async with w.sessions["inventory"].begin() as s:
            await s.execute(RESERVE, f)
        async with w.sessions["payment"].begin() as s:
            await s.execute(CHARGE, f)
        async with w.sessions["orders"].begin() as s:
            await s.execute(CONFIRM, f)

    return one


# -- (b) choreography by hand -----------------------------------------------------------------


async def _dedupe(session: AsyncSession, group: str, key: str) -> bool:
    """Insert the message's key in txmq_consumed_keys; False when it is there (a repeat)."""
    ins = txmq.sqla.tables.insert_if_absent(consumed_keys, "postgresql")
    row = {"consumer_group": group, "key": key, "state": "done"}
    return txmq.sqla.tables.inserted(await session.execute(ins, row))


def choreography(w: World, producers: dict[str, TransactionProducer]) -> tuple[FlowFn, list[Any]]:
    def step(service: str, group: str, sql: Any, next_topic: str | None) -> Any:
        async def listener(msg: MessageExt) -> None:
            f = json.loads(msg.body)
            async with transaction(producers[service], w.sessions[service]) as tx:
                if await _dedupe(tx.session, group, msg.keys[0]):
                    await tx.session.execute(sql, f)
                    if next_topic is not None:
                        body = json.dumps(f).encode()
                        out = Message(next_topic, body, keys=[f"{f['id']}-{next_topic}"])
                        await tx.send(out, sharding_key=f["id"])
            if next_topic is None:
                w.ended(f["id"])

        return listener

    consumers = [
        ("inventory", "bench-inventory", RESERVE, "stock-reserved", "order-created"),
        ("payment", "bench-payment", CHARGE, "payment-done", "stock-reserved"),
        ("orders", "bench-orders", CONFIRM, None, "payment-done"),
    ]
    made = []
    for service, group, sql, nxt, topic in consumers:
        c = PushConsumer(w.address, group, listener=step(service, group, sql, nxt),
                         consume_from=ConsumeFrom.FIRST_OFFSET)  # fmt: skip
        c.subscribe(topic)
        made.append(c)

    async def one() -> None:
        f = new_flow()
        w.waiting[f["id"]] = asyncio.Event()
        async with transaction(producers["orders"], w.sessions["orders"]) as tx:
            await tx.session.execute(CREATE, {**f, "s": "pending"})
            msg = Message("order-created", json.dumps(f).encode(), keys=[f"{f['id']}-created"])
            await tx.send(msg, sharding_key=f["id"])
        await w.wait_end(f["id"])
        del w.waiting[f["id"]]

    return one, made


# -- (c) DBOS -----------------------------------------------------------------------------------


def dbos_flow(w: World) -> tuple[FlowFn, Callable[[], None]]:
    from dbos import DBOS

    async def run_sql(service: str, sql: Any, f: dict[str, Any]) -> None:
        async with w.sessions[service].begin() as s:
            await s.execute(sql, f)

    @DBOS.step()
    async def create(f: dict[str, Any]) -> None:
        await run_sql("orders", CREATE, {**f, "s": "pending"})

    @DBOS.step()
    async def reserve(f: dict[str, Any]) -> None:
        await run_sql("inventory", RESERVE, f)

    @DBOS.step()
    async def release(f: dict[str, Any]) -> None:
        await run_sql("inventory", RELEASE, f)

    @DBOS.step()
    async def charge(f: dict[str, Any]) -> None:
        await run_sql("payment", CHARGE, f)

    @DBOS.step()
    async def refund(f: dict[str, Any]) -> None:
        await run_sql("payment", REFUND, f)

    @DBOS.step()
    async def confirm(f: dict[str, Any]) -> None:
        await run_sql("orders", CONFIRM, f)

    @DBOS.workflow()
    async def checkout(f: dict[str, Any]) -> None:
        await create(f)
        await reserve(f)
        try:
            await charge(f)
        except Exception:
            await release(f)  # the compensation, by hand
            raise
        await confirm(f)

    async def one() -> None:
        handle = await DBOS.start_workflow_async(checkout, new_flow())
        await handle.get_result()

    return one, lambda: None


# -- (d) txmq saga -------------------------------------------------------------------------------


def saga_flow(
    w: World, producers: dict[str, TransactionProducer], group: int = MAX_GROUP
) -> tuple[FlowFn, list[Any]]:
    coordinator = Coordinator(
        "orders", producers["orders"], w.sessions["orders"], [CHECKOUT], group=group
    )
    inventory = Participant("inventory", producers["inventory"], w.sessions["inventory"])
    payment = Participant("payment", producers["payment"], w.sessions["payment"])

    @inventory.action("reserve")
    async def reserve(data: dict[str, Any], session: AsyncSession) -> None:
        await session.execute(RESERVE, data)

    @inventory.compensation("release")
    async def release(data: dict[str, Any], session: AsyncSession) -> None:
        await session.execute(RELEASE, data)

    @payment.action("charge")
    async def charge(data: dict[str, Any], session: AsyncSession) -> None:
        await session.execute(CHARGE, data)

    @payment.compensation("refund")
    async def refund(data: dict[str, Any], session: AsyncSession) -> None:
        await session.execute(REFUND, data)

    last = len(CHECKOUT.steps) - 1

    async def replies(msg: MessageExt) -> Any:
        result = await coordinator.listen(msg)  # committed when it returns
        reply = decode_reply(msg.body)
        if reply.step == last and reply.op == "action":
            w.ended(reply.saga_id)
        return result

    made = []
    for runner, listener in ((coordinator, replies), (inventory, inventory.listen),
                             (payment, payment.listen)):  # fmt: skip
        c = PushConsumer(w.address, **{**runner.consumer_options(), "listener": listener})
        c.subscribe(runner.topic)
        made.append(c)

    async def one() -> None:
        f = new_flow()
        w.waiting[f["id"]] = asyncio.Event()
        async with w.sessions["orders"]() as session:
            async with coordinator.start(session, CHECKOUT, f, saga_id=f["id"]):
                await session.execute(CREATE, {**f, "s": "pending"})
        await w.wait_end(f["id"])
        del w.waiting[f["id"]]

    return one, made


# -- measuring --------------------------------------------------------------------------------


# -- the run -----------------------------------------------------------------------------------


async def setup_schemas(db: str, tag: str) -> dict[str, str]:
    """A fresh schema per service with txmq's tables, its business table and its rows."""
    admin = create_async_engine(db, isolation_level="AUTOCOMMIT")
    urls = {}
    try:
        for service in SERVICES:
            schema = f"txmq_saga_bench_{tag}_{service}"
            async with admin.connect() as conn:
                await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            url = make_url(db).update_query_dict({"options": f"-csearch_path={schema}"})
            urls[service] = url.render_as_string(hide_password=False)
            engine = create_async_engine(url)
            async with engine.begin() as conn:
                await conn.run_sync(txmq.sqla.upgrade)
                await conn.execute(text(BUSINESS[service]))
                if service == "inventory":
                    rows = ", ".join(f"({p}, 1000000000, 0)" for p in range(PRODUCTS))
                    await conn.execute(text(f"INSERT INTO bench_stock VALUES {rows}"))
                if service == "payment":
                    rows = ", ".join(f"({a}, 1000000000)" for a in range(ACCOUNTS))
                    await conn.execute(text(f"INSERT INTO bench_accounts VALUES {rows}"))
            await engine.dispose()
    finally:
        await admin.dispose()
    return urls


async def drop_schemas(db: str, tag: str) -> None:
    admin = create_async_engine(db, isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            for service in SERVICES:
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "txmq_saga_bench_{tag}_{service}" '
                                        "CASCADE"))  # fmt: skip
    finally:
        await admin.dispose()


async def audit(w: World) -> list[str]:
    """What the stores say: sagas completed, orders confirmed, stock and money moved once."""
    out = []
    async with w.engines["orders"].connect() as conn:
        orders = (
            await conn.execute(text("SELECT status, count(*) FROM bench_orders GROUP BY 1"))
        ).all()
        states = (
            await conn.execute(text("SELECT state, count(*) FROM txmq_sagas GROUP BY 1"))
        ).all()
    async with w.engines["inventory"].connect() as conn:
        reserved = (await conn.execute(text("SELECT sum(reserved) FROM bench_stock"))).scalar()
    async with w.engines["payment"].connect() as conn:
        spent = (await conn.execute(text(
            f"SELECT {ACCOUNTS} * 1000000000::bigint - sum(balance) FROM bench_accounts")
        )).scalar()  # fmt: skip
    by_status: dict[str, int] = {str(k): int(n) for k, n in orders}
    by_state: dict[str, int] = {str(k): int(n) for k, n in states}
    total = sum(by_status.values())
    out.append(f"orders {by_status}; sagas {by_state}; reserved {reserved}; "
               f"charged {int(spent or 0) // 100}")  # fmt: skip
    confirmed = by_status.get("confirmed", 0)
    completed = by_state.get("COMPLETED", 0)
    # every flow ended by the end of the run: a direct/choreography/DBOS order is confirmed,
    # a saga's order is COMPLETED; stock and money moved exactly once per order
    ok = confirmed + completed == total == reserved == int(spent or 0) // 100
    out.append("audit: " + ("OK" if ok else "MISMATCH"))
    return out


async def run(args: argparse.Namespace) -> list[Row]:
    tag = uuid.uuid4().hex[:8]
    urls = await setup_schemas(args.db, tag)
    engines = {
        s: create_async_engine(u, pool_size=POOL_SIZE, max_overflow=0) for s, u in urls.items()
    }
    w = World(
        engines, {s: async_sessionmaker(e, expire_on_commit=False) for s, e in engines.items()}
    )
    tmp = Path(tempfile.mkdtemp(prefix="txmq-sagabench-"))
    node = Node("broker", ["broker", "start", "--store", str(tmp / "store")], tmp, timeout=30)
    producers: dict[str, TransactionProducer] = {}
    consumers: list[Any] = []
    dbos_db = f"txmq_saga_bench_dbos_{tag}"
    dbos_started = False
    rows: list[Row] = []
    try:
        w.address = await node.start().wait_ready_async()
        async with AdminClient(w.address) as admin:
            for topic in TOPICS:
                await admin.create_topic(topic, 8)
        for s in SERVICES:
            checker = SqlTransactionChecker(engines[s])
            producers[s] = TransactionProducer(w.address, f"bench-{s}-tx", listener=checker)
            await producers[s].start()
        scenarios: list[tuple[str, FlowFn]] = []
        if "a" in args.scenarios:
            scenarios.append(("(a) direct SQL", direct(w)))
        if "b" in args.scenarios:
            fn, made = choreography(w, producers)
            consumers += made
            scenarios.append(("(b) choreography", fn))
        if "c" in args.scenarios:
            from dbos import DBOS

            sys_url = make_url(args.db).set(drivername="postgresql", database=dbos_db)
            system = sys_url.render_as_string(hide_password=False)
            DBOS(config={"name": f"saga-bench-{tag}", "system_database_url": system})
            fn, _ = dbos_flow(w)
            DBOS.launch()
            dbos_started = True
            scenarios.append(("(c) DBOS workflow", fn))
        if "d" in args.scenarios:
            fn, made = saga_flow(w, producers, args.saga_group)
            consumers += made
            scenarios.append(("(d) txmq saga", fn))
        for c in consumers:
            await c.start()
        cells: dict[tuple[str, int], list[Row]] = {}
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                print(f"round {r + 1} of {args.rounds}, concurrency {concurrency}:", flush=True)
                order = scenarios if r % 2 == 0 else scenarios[::-1]  # A/B, then B/A
                for name, fn in order:
                    await asyncio.sleep(args.pause)
                    row = await measure(name, fn, concurrency, args.warmup, args.duration,
                                        node.pid, unit="flow", timeout=30)  # fmt: skip
                    cells.setdefault((name, concurrency), []).append(row)
        rows = [merge(cell) for cell in cells.values()]
        await asyncio.sleep(1)
        for line in await audit(w):
            print(line)
    finally:
        for c in consumers:
            await c.stop()
        for p in producers.values():
            await p.stop()
        await node.stop_async()
        if dbos_started:  # (last: it shuts the loop's default executor down)
            from dbos import DBOS

            DBOS.destroy(destroy_registry=True)
        shutil.rmtree(tmp, ignore_errors=True)
        for e in engines.values():
            await e.dispose()
        if os.environ.get("TXMQ_BENCH_KEEP"):
            print(f"kept schemas txmq_saga_bench_{tag}_*")
        else:
            await drop_schemas(args.db, tag)
        if dbos_started:
            dba = create_async_engine(args.db, isolation_level="AUTOCOMMIT")
            async with dba.connect() as conn:
                await conn.execute(text(f'DROP DATABASE IF EXISTS "{dbos_db}" WITH (FORCE)'))
            await dba.dispose()
    return rows


def report(rows: list[Row]) -> None:
    by = {(r.scenario[:3], r.concurrency): r for r in rows}
    print()
    print(f"{'scenario':<20} {'c':>3} {'flows/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for r in rows:
        print(f"{r.scenario:<20} {r.concurrency:>3} {r.tps:>9,.1f} {r.p(50):>8.1f} "
              f"{r.p(99):>8.1f} {r.errors:>7}")  # fmt: skip
    for c in sorted({r.concurrency for r in rows}):
        saga = by.get(("(d)", c))
        if saga is None:
            continue
        for peer, goal in (("(c)", 1.0), ("(b)", 0.8)):
            other = by.get((peer, c))
            if other is not None and other.tps:
                ratio = saga.tps / other.tps
                verdict = "met" if ratio >= goal else "NOT met"
                print(f"c={c}: txmq saga / {other.scenario[4:]}: {ratio:.2f}x "
                      f"(goal >= {goal:.1f}x: {verdict})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--pause", type=float, default=1.0, help="seconds between scenarios")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--scenarios", default="abcd", help="which of a, b, c, d to run")
    p.add_argument("--saga-group", type=int, default=MAX_GROUP,
                   help="(d): at most this many answers in one coordinator transaction "
                   f"(default {MAX_GROUP}; 1: each answer in its own)")  # fmt: skip
    args = p.parse_args()
    print(json.dumps(machine_info()))
    rows = asyncio.run(run(args))
    report(rows)


if __name__ == "__main__":
    main()
