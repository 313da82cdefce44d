"""A producer process using ``txmq.sqla.transaction`` killed with SIGKILL mid-transaction,
on PostgreSQL and on a SQLite file shared by the processes.

The process (``tests/sqla_producer_proc.py``) is killed exactly

- after its database commit, before COMMIT reaches the broker: the broker's check-back
  reaches another live producer of the same group (this test process, with a
  :class:`SqlTransactionChecker` on the same database), which answers COMMIT from the
  log; every message is delivered exactly once;
- before its database commit, with the half messages stored: the check answers UNKNOWN
  while the process lives (its transaction holds the log row), ROLLBACK once it is dead;
  nothing is delivered and the business row is gone.
"""

from __future__ import annotations

import os
import select as io_select
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import txmq.sqla
from tests.conftest import ROOT
from tests.sqla_support import pg_schema
from txmq import (
    AdminClient,
    ConsumeFrom,
    Message,
    MessageExt,
    PullConsumer,
    PullStatus,
    PushConsumer,
    TransactionProducer,
)
from txmq.broker.server import EmbeddedBroker
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Prop
from txmq.protocol.wire import TransactionRow
from txmq.sqla import COMMITTED, ROLLED_BACK, SqlTransactionChecker, transaction_log

pytestmark = pytest.mark.anyio

S = LocalTransactionState
#: a check round every 0.1 s once a half is 0.5 s old; never parked during a test
CHECKS = {
    "transaction_check_interval_s": 0.1,
    "transaction_timeout_s": 0.5,
    "transaction_check_max": 1000,
}
SCRIPT = ROOT / "tests" / "sqla_producer_proc.py"


# -- the application database -------------------------------------------------------------


@dataclass
class AppDb:
    backend: str
    url: str
    aurl: str
    engine: Engine
    aengine: AsyncEngine
    orders: Table

    def order_ids(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted(conn.execute(select(self.orders.c.id)).scalars())

    def log_state(self, tid: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(transaction_log.c.state).where(transaction_log.c.transaction_id == tid)
            ).scalar()


@contextmanager
def _urls(backend: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if backend == "sqlite":
        path = tmp_path / "app.db"  # a file: every process opens the same database
        yield f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}"
    else:
        with pg_schema() as url:  # a schema of its own, dropped afterwards
            yield url, url


@pytest.fixture(params=["postgresql", "sqlite"])
async def app_db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AppDb]:
    with _urls(request.param, tmp_path) as (url, aurl):
        orders = Table(
            f"orders_{uuid.uuid4().hex[:8]}",
            MetaData(),
            Column("id", String(64), primary_key=True),
            Column("amount", Integer, nullable=False),
            Column("status", String(16), nullable=False),
        )
        engine = create_engine(url)
        with engine.connect() as conn:
            txmq.sqla.upgrade(conn)  # txmq_transaction_log, as `txmq db upgrade` makes it
        orders.create(engine)
        aengine = create_async_engine(aurl)
        try:
            yield AppDb(request.param, url, aurl, engine, aengine, orders)
        finally:
            await aengine.dispose()
            orders.drop(engine, checkfirst=True)
            engine.dispose()


# -- the producer process -------------------------------------------------------------------


@dataclass
class ProducerProc:
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """Read stdout lines until one starts with ``prefix``; return it (blocking)."""
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {prefix!r} line within {timeout}s: {self.lines}")
            ready, _, _ = io_select.select([out], [], [], remaining)
            if not ready:
                continue
            line = out.readline().decode().strip()  # unbuffered: select sees every byte
            if not line:
                self.proc.wait(10)
                raise AssertionError(
                    f"the producer exited ({self.proc.returncode}) before {prefix!r}:\n"
                    + self.stderr_path.read_text()
                )
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(10) == -signal.SIGKILL


@pytest.fixture
def sqla_producer(tmp_path: Path) -> Iterator[Callable[..., ProducerProc]]:
    """Factory: ``sqla_producer(*args)`` starts ``tests/sqla_producer_proc.py`` and waits
    for its READY line; every process is killed at the end."""
    procs: list[ProducerProc] = []

    def spawn(*args: str) -> ProducerProc:
        stderr_path = tmp_path / f"sqla-producer{len(procs)}.stderr"
        with stderr_path.open("ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=ROOT,
                bufsize=0,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        p = ProducerProc(proc, stderr_path)
        procs.append(p)
        p.expect("READY")
        return p

    yield spawn
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)
        if p.proc.stdout is not None:
            p.proc.stdout.close()


# -- the live producer, the consumer, the broker ------------------------------------------------


class RecordingChecker:
    """A :class:`SqlTransactionChecker` that remembers its answers: (time, id, state)."""

    def __init__(self, checker: SqlTransactionChecker) -> None:
        self.checker = checker
        self.answers: list[tuple[float, str, S]] = []

    def execute_local_transaction(self, msg: Message, arg: Any) -> S:
        return self.checker.execute_local_transaction(msg, arg)

    async def check_local_transaction(self, msg: MessageExt) -> S:
        state = await self.checker.check_local_transaction(msg)
        tid = msg.get_property(Prop.TRANSACTION_ID) or ""
        self.answers.append((time.monotonic(), tid, state))
        return state

    def states(self, tid: str) -> list[S]:
        return [s for _, t, s in self.answers if t == tid]


@dataclass
class Names:
    topic: str
    group: str
    order_id: str
    tid: str

    @classmethod
    def fresh(cls, what: str) -> Names:
        u = uuid.uuid4().hex[:10]
        return cls(f"sqla-{what}-{u}", f"sqla-{what}-tx-{u}", f"o-{u}", f"tx-{what}-{u}")


async def until(predicate: Callable[[], Awaitable[Any]], timeout: float = 20.0) -> Any:
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(0.05)


async def pending(address: str, state: str = "pending") -> list[TransactionRow]:
    async with AdminClient(address) as admin:
        return await admin.transactions(state)


async def read_topic(address: str, topic: str) -> list[MessageExt]:
    """Every message stored in ``topic`` (what any consumer group would get)."""
    out: list[MessageExt] = []
    async with PullConsumer(address, f"{topic}-audit") as consumer:
        for qid in await consumer.queues(topic):
            offset = 0
            while True:
                res = await consumer.pull(topic, qid, offset, max_msgs=256, long_poll=0)
                if res.status != PullStatus.FOUND:
                    break
                out.extend(res.messages)
                offset = res.next_offset
    return out


async def more_check_rounds(b: EmbeddedBroker, n: int = 5) -> None:
    assert b.broker is not None
    checker = b.broker.transaction_checker
    target = checker.rounds + n

    async def done() -> bool:
        return checker.rounds >= target

    await until(done)


async def start_consumer(address: str, topic: str, received: list[MessageExt]) -> PushConsumer:
    async with AdminClient(address) as admin:
        await admin.create_topic(topic, 4)  # so that the first rebalance finds its queues
    consumer = PushConsumer(
        address, f"{topic}-readers", listener=received.append, consume_from=ConsumeFrom.FIRST_OFFSET
    )
    consumer.subscribe(topic)
    await consumer.start()
    return consumer


def producer_args(b: EmbeddedBroker, db: AppDb, n: Names, stop: str) -> list[str]:
    return [
        *("--broker", b.address, "--group", n.group, "--topic", n.topic),
        *("--db", db.aurl, "--table", db.orders.name),
        *("--order-id", n.order_id, "--transaction-id", n.tid),
        *("--messages", "2", "--stop", stop),
    ]


# -- the tests ----------------------------------------------------------------------------------


async def test_killed_after_db_commit_is_committed_by_another_producer(
    app_db: AppDb,
    embedded_broker: Callable[..., EmbeddedBroker],
    sqla_producer: Callable[..., ProducerProc],
) -> None:
    b = embedded_broker(**CHECKS)
    n = Names.fresh("committed")
    received: list[MessageExt] = []
    checker = RecordingChecker(SqlTransactionChecker(app_db.aengine, lock_timeout=0.3))
    consumer = await start_consumer(b.address, n.topic, received)
    try:
        async with TransactionProducer(b.address, n.group, listener=checker):
            proc = sqla_producer(*producer_args(b, app_db, n, "after-db-commit"))
            line = await anyio.to_thread.run_sync(proc.expect, "DB-COMMITTED")
            proc.sigkill()  # the database committed; COMMIT never left the process
            assert line == f"DB-COMMITTED {n.tid} COMMIT"
            assert app_db.order_ids() == [n.order_id]
            assert app_db.log_state(n.tid) == COMMITTED

            async def resolved() -> bool:
                return not any(t.transaction_id == n.tid for t in await pending(b.address))

            await until(resolved)

            async def delivered() -> bool:
                return len(received) >= 2

            await until(delivered)
            await more_check_rounds(b)  # more rounds, more time: nothing more comes
            await anyio.sleep(0.5)
    finally:
        await consumer.stop()

    bodies = Counter(m.body for m in received)
    want = {f"{n.order_id} 0".encode(): 1, f"{n.order_id} 1".encode(): 1}
    assert bodies == want, "each message delivered exactly once"
    stored = await read_topic(b.address, n.topic)
    assert Counter(m.body for m in stored) == want
    assert all(m.get_property(Prop.TRANSACTION_ID) == n.tid for m in stored)
    # the decision was the live producer's (the killed one could only say UNKNOWN)
    assert S.COMMIT in checker.states(n.tid)
    assert S.ROLLBACK not in checker.states(n.tid)
    assert await pending(b.address) == [] and await pending(b.address, "parked") == []
    assert app_db.order_ids() == [n.order_id]


async def test_killed_before_db_commit_is_rolled_back_by_another_producer(
    app_db: AppDb,
    embedded_broker: Callable[..., EmbeddedBroker],
    sqla_producer: Callable[..., ProducerProc],
) -> None:
    b = embedded_broker(**CHECKS)
    n = Names.fresh("rolledback")
    received: list[MessageExt] = []
    checker = RecordingChecker(SqlTransactionChecker(app_db.aengine, lock_timeout=0.3))
    consumer = await start_consumer(b.address, n.topic, received)
    try:
        async with TransactionProducer(b.address, n.group, listener=checker):
            proc = sqla_producer(*producer_args(b, app_db, n, "before-db-commit"))
            assert await anyio.to_thread.run_sync(proc.expect, "HALF-SENT") == f"HALF-SENT {n.tid}"
            halves = [t for t in await pending(b.address) if t.transaction_id == n.tid]
            assert len(halves) == 2

            async def asked_while_alive() -> bool:  # the open transaction is waited for
                return S.UNKNOWN in checker.states(n.tid)

            await until(asked_while_alive)
            killed_at = time.monotonic()
            proc.sigkill()  # the database transaction dies with the process

            async def resolved() -> bool:
                return not any(t.transaction_id == n.tid for t in await pending(b.address))

            await until(resolved)
            await more_check_rounds(b)
            await anyio.sleep(0.5)
    finally:
        await consumer.stop()

    assert received == []
    assert await read_topic(b.address, n.topic) == []
    assert app_db.order_ids() == []  # the business row went with the dead transaction
    assert app_db.log_state(n.tid) == ROLLED_BACK  # written by the live producer's check
    answers = [(t, s) for t, tid, s in checker.answers if tid == n.tid]
    assert all(s is S.UNKNOWN for t, s in answers if t < killed_at), answers
    assert S.ROLLBACK in [s for _, s in answers]
    assert S.COMMIT not in [s for _, s in answers]
    assert await pending(b.address) == [] and await pending(b.address, "parked") == []
