"""txmq.testing as its users meet it: a project's own pytest run, its conftest naming the
plugin, its unchanged producers, consumers, transactions and idempotent handlers against
the in-process broker; and each helper doing what it says."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import txmq
import txmq.sync
from txmq import LocalTransactionState, Message, MessageExt
from txmq.protocol.wire import SendMessage
from txmq.protocol.wire.errors import BrokerBusy, RequestTimeout
from txmq.testing import ConsumeTimeout, InProcessBroker

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.anyio

PROJECT_CONFTEST = """\
pytest_plugins = ["txmq.testing"]
"""

#: a service's code, unchanged: it names no broker and no transport
SERVICE = """\
import sqlalchemy as sa
import txmq
import txmq.sync
from txmq import Message

metadata = sa.MetaData()
orders = sa.Table("orders", metadata, sa.Column("id", sa.String, primary_key=True))


def place_order(order_id: str) -> None:
    with txmq.sync.Producer() as producer:
        producer.send(Message("orders", order_id.encode(), keys=[order_id]))


def handler(engine):
    @txmq.idempotent(engine, group="billing")
    def bill(msg, session):
        session.execute(orders.insert().values(id=msg.keys[0]))

    return bill
"""

PROJECT_TEST = """\
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import txmq
import txmq.sqla
import txmq.sync
from txmq import ConsumeFrom, outbox

from service import handler, metadata, orders, place_order


def test_an_order_is_announced(txmq_broker):
    place_order("o-1")
    assert txmq_broker.bodies("orders") == [b"o-1"]


def test_billing_applies_each_order_once(txmq_broker, tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'billing.db'}")
    metadata.create_all(engine)
    with engine.begin() as conn:
        txmq.sqla.upgrade(conn)
    place_order("o-1")
    place_order("o-2")
    consumer = txmq.sync.PushConsumer(
        group="billing", listener=handler(engine), consume_from=ConsumeFrom.FIRST_OFFSET
    )
    consumer.subscribe("orders")
    with consumer:
        txmq_broker.wait_consumed("billing", "orders")
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(orders.c.id)).scalars()) == ["o-1", "o-2"]


def test_an_order_and_its_messages_commit_together(txmq_broker, tmp_path):
    url = f"sqlite:///{tmp_path / 'orders.db'}"
    engine = sa.create_engine(url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        txmq.sqla.upgrade(conn)
    sessions = sessionmaker(engine)
    checker = txmq.sqla.SqlTransactionChecker(engine)
    with txmq.sync.TransactionProducer(group="orders", listener=checker) as producer:
        with sessions() as session, txmq.sqla.transaction(producer, session) as tx:
            session.execute(orders.insert().values(id="o-9"))
            tx.send(txmq.Message("orders", b"o-9"))
        with pytest.raises(ValueError), sessions() as session:
            with txmq.sqla.transaction(producer, session) as tx:
                session.execute(orders.insert().values(id="o-10"))
                tx.send(txmq.Message("orders", b"o-10"))
                raise ValueError("the order is refused: nothing commits")
    assert txmq_broker.bodies("orders") == [b"o-9"]
    with sessions() as session, session.begin():
        outbox.add(session, txmq.Message("shipments", b"s-1"), sharding_key="o-9")
    with outbox.sync.OutboxRelay(url) as relay:
        deadline = time.monotonic() + 10
        while txmq_broker.bodies("shipments") != [b"s-1"]:
            assert time.monotonic() < deadline, relay.stats()
            time.sleep(0.01)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_an_async_service_is_tested_the_same_way(txmq_broker):
    got = []

    async def listener(msg):
        got.append(msg.body)

    async with txmq.Producer() as producer:
        await producer.send(txmq.Message("events", b"e-1"))
    consumer = txmq.PushConsumer(group="g", listener=listener, consume_from="FIRST_OFFSET")
    consumer.subscribe("events")
    async with consumer:
        await txmq_broker.wait_consumed_async("g", "events")
    assert got == [b"e-1"]
"""


def test_a_projects_own_tests_run_against_the_in_process_broker(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(PROJECT_CONFTEST)
    (project / "service.py").write_text(SERVICE)
    (project / "test_service.py").write_text(PROJECT_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXMQ_")}
    env["PYTHONPATH"] = str(project)
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 passed" in r.stdout, r.stdout[-2000:]
    assert time.monotonic() - began < 60


@pytest.fixture
def broker(in_process_broker: Callable[..., InProcessBroker]) -> InProcessBroker:
    return in_process_broker(message_delay_levels="1s 5s 10s 30s 1m 2m 3m")


def test_the_next_send_fails_or_loses_its_answer(broker: InProcessBroker) -> None:
    with txmq.sync.Producer() as producer:
        broker.fail_next(SendMessage, error=BrokerBusy("told to fail"))
        producer.send(Message("f", b"retried"))  # a retriable error: sent again, once
        broker.fail_next(SendMessage, times=3, error=BrokerBusy("told to fail"))
        with pytest.raises(BrokerBusy, match="told to fail"):
            producer.send(Message("f", b"never"), timeout=0.5)
        broker.fail_next(SendMessage)  # stored, its answer lost: the retry is answered
        producer.send(Message("f", b"answered-at-the-retry"), timeout=0.3)
        broker.fail_next(SendMessage, times=3)  # every try stored, every answer lost
        with pytest.raises(RequestTimeout):
            producer.send(Message("f", b"never-answered"), timeout=0.3)
        producer.send(Message("f", b"after"))
    # a resend of the same message id is stored once (the broker's dedupe window)
    assert sorted(broker.bodies("f")) == [
        *(b"after", b"answered-at-the-retry", b"never-answered", b"retried")
    ]


async def test_advance_brings_retries_due_without_waiting(broker: InProcessBroker) -> None:
    async with txmq.Producer() as producer:
        await producer.send(Message("r", b"x"))
    tries: list[int] = []

    async def listener(msg: MessageExt) -> txmq.ConsumeResult:
        tries.append(msg.reconsume_times)
        first = len(tries) == 1
        return txmq.ConsumeResult.RECONSUME_LATER if first else txmq.ConsumeResult.SUCCESS

    consumer = txmq.PushConsumer(group="r", listener=listener, consume_from="FIRST_OFFSET")
    consumer.subscribe("r")
    async with consumer:
        with anyio.fail_after(10):
            while not tries:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        began = time.monotonic()
        broker.advance(10)  # the first retry's level: 10 s
        with anyio.fail_after(5):
            while len(tries) < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert time.monotonic() - began < 5
        await broker.wait_consumed_async("r", "r")
    assert tries == [0, 1]


async def test_a_delayed_message_comes_when_the_clock_is_moved(broker: InProcessBroker) -> None:
    async with txmq.Producer() as producer:
        await producer.send(Message("d", b"in-a-minute", delay_level=5))
    assert broker.bodies("d") == []
    broker.advance(59)
    await anyio.sleep(0.2)
    assert broker.bodies("d") == []
    broker.advance(1)
    with anyio.fail_after(5):
        while broker.bodies("d") != [b"in-a-minute"]:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    with pytest.raises(ValueError, match="forward only"):
        broker.advance(-1)


async def test_check_back_now_asks_the_producer_at_once(broker: InProcessBroker) -> None:
    class Listener:
        def execute_local_transaction(self, msg: Message, arg: object) -> LocalTransactionState:
            return LocalTransactionState.UNKNOWN

        def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
            return LocalTransactionState.COMMIT

    async with txmq.TransactionProducer(group="tp", listener=Listener()) as producer:
        await producer.send_message_in_transaction(Message("tx", b"decided-later"))
        assert broker.pending_transactions() == 1 and broker.bodies("tx") == []
        assert broker.check_back_now() == 1  # (the default immunity is 6 s)
        with anyio.fail_after(5):
            while broker.bodies("tx") != [b"decided-later"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert broker.pending_transactions() == 0


def test_waiting_for_a_group_that_consumes_nothing_says_why(broker: InProcessBroker) -> None:
    with txmq.sync.Producer() as producer:
        producer.send(Message("w", b"x"))
    with pytest.raises(ConsumeTimeout, match="group 'nobody' left 1 message"):
        broker.wait_consumed("nobody", "w", timeout=0.2)


def test_a_client_of_no_broker_in_process_is_told_so(tmp_path: Path) -> None:
    with pytest.raises(txmq.BrokerUnavailable, match="no broker is served in this process"):
        with txmq.sync.Producer("127.0.0.1:1", transport="loopback") as producer:
            producer.send(Message("x", b"x"))


def test_the_plugin_is_registered_for_pytest() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert names.get("txmq.testing") == "txmq.testing"
    assert textwrap.dedent(PROJECT_CONFTEST).strip() == 'pytest_plugins = ["txmq.testing"]'


def test_a_client_of_a_stopped_in_process_broker_is_told_so(tmp_path: Path) -> None:
    broker = InProcessBroker(tmp_path / "store").start()
    with txmq.sync.Producer(broker.address, transport="loopback") as producer:
        producer.send(Message("s", b"before"))
        broker.stop()
        # (as from a broker process that is gone: unavailable, nothing sent)
        with pytest.raises(txmq.BrokerUnavailable):
            producer.send(Message("s", b"after"), timeout=0.5)


def test_bad_settings_and_arguments_are_refused_with_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"unknown broker setting 'delay_level'.*did you mean"):
        InProcessBroker(tmp_path / "s", delay_level="1s")
    with pytest.raises(ValueError, match="transaction_timeout_s"):
        InProcessBroker(tmp_path / "s", transaction_timeout_s=-1)
    with InProcessBroker(tmp_path / "s") as broker:
        with pytest.raises(ValueError, match="times must be at least 1"):
            broker.fail_next(times=0)
    monkeypatch.setenv("TXMQ_PERSIST_INTERVAL_S", "soon")
    with pytest.raises(ValueError, match=r"\$TXMQ_PERSIST_INTERVAL_S is 'soon': give seconds"):
        txmq.PushConsumer("127.0.0.1:1")
    monkeypatch.setenv("TXMQ_PERSIST_INTERVAL_S", "0")
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        txmq.PushConsumer("127.0.0.1:1")
