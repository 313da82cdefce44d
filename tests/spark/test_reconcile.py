"""The reconciliation job on real data: the orders example (its orders are sagas across three
services, each step a transactional message) on PostgreSQL with a real broker, then one
hand-made fault of every anomaly class; the job finds exactly those."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Engine, Table, func, insert, select
from sqlalchemy.orm import Session

from examples.orders import db as dbs
from examples.orders.checker import check
from examples.orders.inventory_service import InventoryService
from examples.orders.order_service import OrderService
from examples.orders.payment_service import PaymentService
from tests.conftest import ROOT, running_async, wait_for
from tests.sqla_support import pg_schema
from txmq.broker.server import EmbeddedBroker
from txmq.client.transaction import LocalTransactionState
from txmq.consumer.pull import PullConsumer
from txmq.protocol.message import Message
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.spark.classify import CLASSES
from txmq.spark.job import JDBC_JAR, main
from txmq.sqla import transaction
from txmq.sqla.tables import consumed_keys, outbox, transaction_log
from txmq.sync import AdminClient, Producer, TransactionProducer

# a module-wide budget above the default 120 s: the first test also builds the world (the
# orders example on PostgreSQL) and every test starts Spark work on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
#: a job in a process of its own: ~70 s alone, past 240 s beside the suite's other workers
#: (CI); the world's sagas give it three more tables a database to read
JOB_TIMEOUT = 480

#: the seeded faults' events: a hand-written choreography beside the sagas (a transactional
#: send of ORDER_CREATED, consumed idempotently by INVENTORY_GROUP)
ORDER_CREATED = "order-created"
INVENTORY_GROUP = "inventory-service/order-created"
#: its healthy event, consumed once (the duplicate fault applies it again under its id)
HEALTHY_KEY = "order-healthy-created"


@dataclass
class World:
    """The orders example after a healthy run, and the faults seeded since."""

    store: Path
    orders_db: str
    inventory_db: str
    payment_db: str
    address: str
    expected: dict[str, set[str]] = field(default_factory=lambda: {c: set() for c in CLASSES})
    seeded_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    lost_outbox: str = ""
    #: the transactions of the healthy run: the sagas' (their services' logs) and the one
    #: that failed
    healthy: int = 0


class Undecided:
    """A producer's local transaction that never says: the broker checks, then parks."""

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: Any) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN


def _run_orders(w: World) -> None:
    """Orders placed through the real services until every saga ended; beside them, one
    event of a hand-written choreography, consumed once."""
    with (
        running_async(InventoryService(w.inventory_db, w.address)),
        PaymentService(w.payment_db, w.address),
        OrderService(w.orders_db, w.address) as orders,
    ):
        for i in range(12):  # some out of stock, some declined (eve cannot pay)
            orders.place(["apple", "pear"][i % 2], 1 + i % 3, "eve" if i % 4 == 3 else "ann")
        # a local transaction that fails: its half message is rolled back (healthy)
        with (
            pytest.raises(RuntimeError),
            transaction(orders.producer, orders.sessions) as tx,
        ):
            tx.send(Message(ORDER_CREATED, b"{}", keys=["order-never-created"]))
            raise RuntimeError("the business rule said no")
        wait_for(lambda: check(w.orders_db, w.inventory_db, w.payment_db).pending == 0, timeout=60)
        report = check(w.orders_db, w.inventory_db, w.payment_db)
        assert report.ok, report.problems
    with Producer(w.address, "choreography") as p:
        p.send(Message(ORDER_CREATED, b"{}", keys=[HEALTHY_KEY]))
    inventory = dbs.connect(w.inventory_db)
    _insert(inventory, consumed_keys, consumer_group=INVENTORY_GROUP, key=HEALTHY_KEY, state="done")
    inventory.dispose()
    logged = 0
    for db in (w.orders_db, w.inventory_db, w.payment_db):
        engine = dbs.connect(db)
        with engine.connect() as conn:
            logged += conn.execute(select(func.count()).select_from(transaction_log)).scalar_one()
        engine.dispose()
    w.healthy = logged + 1


def _insert(engine: Engine, table: Table, **values: Any) -> None:
    with Session(engine) as s, s.begin():
        s.execute(insert(table).values(**values))


def _half(tp: TransactionProducer, tx_id: str, key: str, state: LocalTransactionState) -> None:
    r = tp.send_half(Message(ORDER_CREATED, b"{}", keys=[key]), transaction_id=tx_id)
    tp.end_transaction(r, state)


def _seed_faults(w: World) -> None:
    o, i = dbs.connect(w.orders_db), dbs.connect(w.inventory_db)
    old = datetime.now(UTC) - timedelta(hours=1)
    committed = {"producer_group": "order-service", "state": "COMMITTED"}
    with TransactionProducer(w.address, "order-service") as tp:
        # lost: committed locally, the broker never got the half message
        _insert(o, transaction_log, transaction_id="lost-no-half", **committed)
        # lost: committed locally, but the broker was told ROLLBACK
        _half(tp, "lost-rolled-back", "order-lost-created", LocalTransactionState.ROLLBACK)
        _insert(o, transaction_log, transaction_id="lost-rolled-back", **committed)
        w.expected["lost"] |= {"lost-no-half", "lost-rolled-back"}
        # phantom: committed at the broker, no local transaction (its message was consumed)
        _half(tp, "phantom-1", "order-phantom-created", LocalTransactionState.COMMIT)
        _insert(
            i,
            consumed_keys,
            consumer_group=INVENTORY_GROUP,
            key="order-phantom-created",
            state="done",
        )
        w.expected["phantom"].add("phantom-1")
    # parked: a live producer of the group that never knows; the broker gives up
    with TransactionProducer(w.address, "order-service", listener=Undecided()) as tp:
        tp.send_half(
            Message(ORDER_CREATED, b"{}", keys=["order-parked-created"]),
            transaction_id="parked-1",
            check_immunity_s=0,
        )
        with AdminClient(w.address) as admin:
            wait_for(
                lambda: any(t.transaction_id == "parked-1" for t in admin.transactions("parked")),
                timeout=30,
            )
    w.expected["parked"].add("parked-1")
    # no anomaly: parked, re-checked by an operator, parked again, rolled back by an operator
    # (it never committed locally): the first half is superseded by its copy, not parked
    with TransactionProducer(w.address, "order-service", listener=Undecided()) as tp:
        rechecked = tp.send_half(
            Message(ORDER_CREATED, b"{}", keys=["order-rechecked-created"]),
            transaction_id="rechecked-1",
            check_immunity_s=0,
        )
        with AdminClient(w.address) as admin:

            def parked_now() -> bool:
                return any(t.transaction_id == "rechecked-1" for t in admin.transactions("parked"))

            wait_for(parked_now, timeout=30)
            [again] = admin.decide_transaction("RECHECK", msg_id=rechecked.msg_id)
            assert again.recheck_offset is not None
            wait_for(parked_now, timeout=30)
            admin.decide_transaction("ROLLBACK", msg_id=rechecked.msg_id, reason="never paid")
    with Producer(w.address, "faults") as p:
        # unconsumed: committed, nobody of the inventory group consumed it
        r = p.send(Message(ORDER_CREATED, b"{}", keys=["order-unconsumed-created"]))
        w.expected["unconsumed"].add(r.msg_id)
        # dead-lettered: a poison message the inventory group gave up on
        poison = p.send(Message(ORDER_CREATED, b"{not json", keys=["poison-1"]))
    w.expected["dead_lettered"].add(poison.msg_id)

    async def dead_letter() -> None:
        async with PullConsumer(w.address, "inventory-service") as pc:
            got = await pc.pull(ORDER_CREATED, poison.queue_id, poison.queue_offset, max_msgs=1)
            msg = got.messages[0]
            assert msg.msg_id == poison.msg_id
            await pc.call(
                ConsumerSendMsgBack(
                    group="inventory-service",
                    commit_log_offset=msg.commit_log_offset,
                    delay_level=-1,
                    origin_msg_id=msg.msg_id,
                )
            )

    anyio.run(dead_letter)
    # lost: an outbox row the relay never delivered (it was stopped, then the row parked)
    lost_outbox = uuid.uuid4().hex
    _insert(
        i,
        outbox,
        msg_id=lost_outbox,
        topic="stock-replies",
        keys="order-x-stock",
        body=b"{}",
        state="parked",
        attempts=16,
        last_error="broker unreachable",
        created_at=old,
    )
    w.expected["lost"].add(lost_outbox)
    w.lost_outbox = lost_outbox
    # duplicate: one event applied by the inventory group under two keys (its id and its key)
    key = HEALTHY_KEY
    with Session(i) as s, s.begin():
        with AdminClient(w.address) as admin:
            msg = next(m for m in admin.messages_by_key(key) if m.topic == ORDER_CREATED)
        s.execute(
            insert(consumed_keys).values(
                consumer_group=INVENTORY_GROUP, key=msg.msg_id, state="done"
            )
        )
    w.expected["duplicate"].add(key)
    o.dispose()
    i.dispose()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from txmq.broker.state.config import BrokerConfig

    folder = tmp_path_factory.mktemp("reconcile")
    with pg_schema() as orders_db, pg_schema() as inventory_db, pg_schema() as payment_db:
        dbs.upgrade("orders", orders_db)
        dbs.upgrade("inventory", inventory_db)
        dbs.upgrade("payment", payment_db)
        dbs.seed_stock(inventory_db, {"apple": 8, "pear": 8})
        dbs.seed_accounts(payment_db, {"ann": 100, "eve": 0})
        broker = EmbeddedBroker(
            BrokerConfig(
                store=folder / "store",
                port=0,
                transaction_check_interval_s=0.2,
                transaction_check_max=2,
            )
        ).start()
        try:
            w = World(folder / "store", orders_db, inventory_db, payment_db, broker.address)
            _run_orders(w)
            w.seeded_at = datetime.now(UTC)
            _seed_faults(w)
            yield w
        finally:
            broker.stop()


def _job_args(w: World, out: Path) -> list[str]:
    """The job's arguments for the world, judged a minute from now with a 30 s SLA."""
    now = datetime.now(UTC) + timedelta(minutes=1)
    return [
        *("--store", str(w.store), "--db", w.orders_db, "--db", w.inventory_db),
        *("--db", w.payment_db),
        *("--out", str(out), "--sla", "30s", "--now", now.isoformat()),
    ]


def _reconcile(w: World, out: Path, spark: Any, *extra: str) -> int:
    return main([*_job_args(w, out), *extra], spark=spark)


def _found(spark: Any, out: Path) -> dict[str, set[str]]:
    found = {}
    for c in CLASSES:
        rows = spark.read.parquet(str(out / c)).collect()
        if c in ("lost", "phantom", "parked"):
            found[c] = {r["transaction_id"] or r["msg_id"] for r in rows}
        elif c == "duplicate":
            found[c] = {r["key"] for r in rows}
        else:
            found[c] = {r["msg_id"] for r in rows}
    return found


def test_finds_exactly_the_anomalies_seeded(
    world: World, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = _reconcile(world, tmp_path / "out", spark)
    summary = capsys.readouterr().out
    assert _found(spark, tmp_path / "out") == world.expected, summary
    assert rc == 1
    assert "needs attention: 8 anomalies" in summary, summary
    assert "decide ROLLBACK" in summary  # the parked half never committed locally
    assert f"{INVENTORY_GROUP} <- {ORDER_CREATED}" in summary
    # the sagas' steps + the failed one + the seeded transactional sends
    assert f"reconciled {world.healthy + 5} transactional sends" in summary, summary


def test_shuffled_keys_and_capped_tables_keep_the_counts_exact(
    world: World, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Consumed keys too many to broadcast are joined by a shuffle, with the same result;
    a class with more anomalies than --max-rows gets that many rows and its exact count."""
    out = tmp_path / "out"
    rc = _reconcile(world, out, spark, "--broadcast-keys", "0", "--max-rows", "1")
    summary = capsys.readouterr().out
    assert rc == 1
    facts = json.loads((out / "summary.json").read_text())
    assert facts["counts"] == {c: len(v) for c, v in world.expected.items()}, summary
    assert facts["facts"]["consumed_keys"].endswith("shuffled")
    assert facts["facts"]["truncated"] == {"lost": 1}
    assert "lost: the table holds the first 1 of 3 (--max-rows)" in summary
    found = _found(spark, out)
    assert len(found["lost"]) == 1 and found["lost"] <= world.expected["lost"]
    assert {c: v for c, v in found.items() if c != "lost"} == {
        c: v for c, v in world.expected.items() if c != "lost"
    }


def test_two_windows_split_the_anomalies_between_them(
    world: World, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Incremental runs: before the faults were seeded, and from then on. The outbox row
    dated an hour back and the duplicate (its message is a healthy order's) fall in the
    first; every other fault in the second."""
    cut = world.seeded_at.isoformat()
    rc = _reconcile(world, tmp_path / "before", spark, "--until", cut)
    summary = capsys.readouterr().out
    assert rc == 1 and f"reconciled {world.healthy} transactional sends" in summary, summary
    before = _found(spark, tmp_path / "before")
    assert before == {
        c: (
            world.expected[c] if c == "duplicate" else {world.lost_outbox} if c == "lost" else set()
        )
        for c in CLASSES
    }, summary
    rc = _reconcile(world, tmp_path / "since", spark, "--since", cut)
    summary = capsys.readouterr().out
    since = _found(spark, tmp_path / "since")
    assert rc == 1 and since == {c: world.expected[c] - before[c] for c in CLASSES}, summary
    later = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    rc = _reconcile(world, tmp_path / "later", spark, "--since", later)
    summary = capsys.readouterr().out
    assert rc == 0 and "nothing needs attention" in summary, summary


def test_bad_input_exits_2_with_a_clear_message(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["--store", str(tmp_path / "nowhere"), "--db", db], spark=spark) == 2
    assert "is not a txmq broker store" in capsys.readouterr().err
    (tmp_path / "store" / "commitlog").mkdir(parents=True)
    bad = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    assert main(["--store", str(tmp_path / "store"), "--db", bad], spark=spark) == 2
    assert "cannot read txmq_transaction_log" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "store"), "--db", db, "--sla", "soon"], spark=spark)
    assert "not a duration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "store"), "--db", db, "--conf", "driver"], spark=spark)
    assert "--conf wants KEY=VALUE" in capsys.readouterr().err
    # through the txmq command: a missing driver jar is named before Spark starts
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "txmq"),
            "reconcile",
            "--store",
            str(tmp_path / "store"),
            "--db",
            "postgresql+psycopg://app:s3cret@db/orders",
            "--jdbc-jar",
            str(tmp_path / "no.jar"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no PostgreSQL JDBC driver at" in r.stderr, r.stderr
    assert "s3cret" not in r.stderr


def test_spark_submit_local_2_finds_the_same(world: World, tmp_path: Path) -> None:
    """The job as a cluster user submits it: spark-submit, a master of two threads."""
    out = tmp_path / "out"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "spark-submit"),
            "--master",
            "local[2]",
            "--jars",
            JDBC_JAR,
            "--conf",
            "spark.ui.enabled=false",
            str(ROOT / "txmq" / "spark" / "job.py"),
            *_job_args(world, out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=JOB_TIMEOUT,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {c: len(v) for c, v in world.expected.items()}
    assert summary["facts"]["master"] == "local[2]"
    assert "needs attention: 8 anomalies" in r.stdout


def test_the_txmq_reconcile_command_finds_the_same(
    world: World, spark: Any, tmp_path: Path
) -> None:
    """``txmq reconcile`` as the README writes it, end to end in a process of its own (its
    own Spark session: --master, --conf): the summary, a table per class holding exactly
    the seeded anomalies, and exit code 1 (something needs attention)."""
    out = tmp_path / "reconcile-out"
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "txmq"),
            "reconcile",
            *_job_args(world, out),
            *("--master", "local[2]", "--conf", "spark.driver.memory=1g"),
            *("--conf", "spark.ui.enabled=false"),
        ],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-4000:]
    assert "needs attention: 8 anomalies" in r.stdout, r.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {c: len(v) for c, v in world.expected.items()}
    assert summary["facts"]["master"] == "local[2]"
    assert _found(spark, out) == world.expected
