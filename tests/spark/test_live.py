"""The job beside a live broker: two healthy producers keep committing local transactions
(PostgreSQL) and sending their messages while the job reads; nothing it calls ``lost`` is
delivered afterwards (issue 16, item 10: the store was read first, the transaction log later
and without an upper bound, so transactions committed in between looked lost)."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, func, select

import txmq.sqla
from tests.conftest import BrokerProcess, Spawner, read_line, wait_for
from tests.sqla_support import pg_schema
from txmq.consumer.pull import PullStatus
from txmq.protocol.message import Prop
from txmq.spark.job import main
from txmq.sqla.tables import transaction_log
from txmq.sync import AdminClient, PullConsumer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SCRIPT = "tests/spark/tx_load_proc.py"
TOPIC = "live-orders"
GROUP = "live-shop"
#: the load is bounded: per producer at most this many transactions, and this long
MAX_PER_PRODUCER, MAX_SECONDS = 20_000, 180


@pytest.fixture
def app_db() -> Iterator[tuple[str, Engine]]:
    with pg_schema() as url:
        engine = create_engine(url)
        with engine.connect() as conn:
            txmq.sqla.upgrade(conn)
        Table(
            "orders",
            MetaData(),
            Column("id", String(64), primary_key=True),
            Column("amount", Integer, nullable=False),
        ).create(engine)
        try:
            yield url, engine
        finally:
            engine.dispose()


def _committed(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        q = select(transaction_log.c.transaction_id).where(transaction_log.c.state == "COMMITTED")
        return set(conn.execute(q).scalars())


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(transaction_log)).scalar_one())


def _delivered(address: str) -> list[str]:
    """The transaction ids of every message stored in the topic (what a consumer gets)."""
    out: list[str] = []
    with PullConsumer(address, f"{TOPIC}-audit") as consumer:
        for qid in consumer.queues(TOPIC):
            offset = 0
            while True:
                res = consumer.pull(TOPIC, qid, offset, max_msgs=1024, long_poll=0)
                if res.status != PullStatus.FOUND:
                    break
                out += [m.get_property(Prop.TRANSACTION_ID) or "" for m in res.messages]
                offset = res.next_offset
    return out


def test_nothing_lost_is_delivered_when_the_job_runs_beside_producers(
    app_db: tuple[str, Engine],
    broker_process: Callable[..., BrokerProcess],
    spawn: Spawner,
    spark: Any,
    tmp_path: Path,
) -> None:
    url, engine = app_db
    broker = broker_process().start()
    producers = [
        spawn(
            SCRIPT,
            *("--broker", broker.address, "--group", GROUP, "--topic", TOPIC),
            *("--db", url, "--table", "orders", "--prefix", f"p{i}-{uuid.uuid4().hex[:6]}"),
            *("--max", str(MAX_PER_PRODUCER), "--seconds", str(MAX_SECONDS)),
        )
        for i in range(2)
    ]
    for p in producers:
        read_line(p, "READY")
    wait_for(lambda: _count(engine) >= 500, timeout=60)  # both are sending

    out = tmp_path / "out"
    before = _count(engine)
    rc = main(
        [*("--store", str(broker.store), "--db", url, "--sla", "10m", "--out", str(out))],
        spark=spark,
    )
    during = _count(engine) - before
    for p in producers:
        p.send_signal(signal.SIGTERM)
    sent = sum(int(read_line(p, "DONE", timeout=60).split()[1]) for p in producers)
    assert during > 100, "the producers kept committing while the job ran"
    assert all(p.wait(30) == 0 for p in producers)

    lost = spark.read.parquet(str(out / "lost")).collect()
    committed = _committed(engine)
    assert len(committed) == sent
    # every committed transaction's message is delivered (as the broker may take a check
    # round for the last ones, wait for it)
    with AdminClient(broker.address) as admin:
        wait_for(lambda: not admin.transactions("pending"), timeout=90, interval=0.5)
    delivered = wait_for(
        lambda: (d := set(_delivered(broker.address))) == committed and d, timeout=60
    )
    falsely_lost = {r["transaction_id"] for r in lost} & delivered
    assert not falsely_lost, f"{len(falsely_lost)} of {len(lost)} 'lost' were delivered"
    assert rc == 0, [r.asDict() for r in lost[:5]]
