"""Users' code gets txmq's types: a small service using the public API (sends, a
transaction with SQLAlchemy, an idempotent handler, admin, the synchronous facade, the test
harness) passes ``mypy --strict`` as an installed package's user would run it, and a
mistake in it is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

APP = """\
from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import txmq
import txmq.sync
from txmq import AdminClient, Message, MessageExt, Producer, SendResult, TransactionProducer
from txmq.sqla import SqlTransactionChecker, transaction
from txmq.testing import InProcessBroker

engine = create_async_engine("sqlite+aiosqlite:///app.db")
orders = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.String, primary_key=True))


async def announce(order_id: str) -> SendResult:
    async with Producer() as producer:
        return await producer.send(Message("orders", order_id.encode()), sharding_key=order_id)


async def place(order_id: str) -> str:
    producer = TransactionProducer(group="orders", listener=SqlTransactionChecker(engine))
    async with producer, async_sessionmaker(engine)() as session:
        async with transaction(producer, session) as tx:
            await session.execute(orders.insert().values(id=order_id))
            result = await tx.send(Message("orders", order_id.encode(), keys=[order_id]))
        return result.msg_id


def place_sync(order_id: str, factory: sessionmaker[Session]) -> None:
    with txmq.sync.TransactionProducer(group="orders") as producer, factory() as session:
        with transaction(producer, session) as tx:
            session.execute(orders.insert().values(id=order_id))
            tx.send(Message("orders", order_id.encode()))


@txmq.idempotent(engine, group="billing")
async def bill(msg: MessageExt, session: AsyncSession) -> None:
    await session.execute(orders.insert().values(id=msg.keys[0]))


async def lag(group: str) -> int:
    async with AdminClient() as admin:
        return sum(o.lag for o in await admin.offsets() if o.group == group)


def sent_in_test(broker: InProcessBroker) -> list[bytes]:
    return broker.bodies("orders")
"""

MISTAKE = """
async def wrong() -> int:
    async with Producer() as producer:
        return await producer.send(Message("orders", b"x"))
"""


def _mypy(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "app.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_users_service_passes_mypy_strict_and_a_mistake_is_caught(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    clean = _mypy(tmp_path)
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert "Success: no issues found in 1 source file" in clean.stdout
    (tmp_path / "app.py").write_text(APP + MISTAKE)
    caught = _mypy(tmp_path)
    assert caught.returncode == 1
    assert 'Incompatible return value type (got "SendResult", expected "int")' in caught.stdout
