"""Helpers for the SQLAlchemy tests: a business table, fake transaction producers, and
PostgreSQL schemas made and dropped per test."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest
from sqlalchemy import (
    Column,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    make_url,
    text,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped

from tests.conftest import free_port
from txmq.broker.server import EmbeddedBroker
from txmq.client.producer import MessageQueueSelector, SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message
from txmq.sqla import metadata as txmq_metadata

#: the client transports the transactional-send, outbox, idempotent-consumer and contract
#: tests run on: txmq's protocol, RocketMQ 5's gRPC, and an in-process broker (loopback)
TRANSPORTS = ["txmq", "grpc", "loopback"]
#: those of them that reach a broker from another process (loopback is this process's)
PROCESS_TRANSPORTS = ["txmq", "grpc"]
_IN_PROCESS = itertools.count(1)


@dataclass
class Via:
    """A broker, and how txmq's producers and consumers reach it on one transport: txmq's
    protocol at ``broker.address``, RocketMQ 5's gRPC endpoint (``--grpc-port``), or the
    broker's router in this process (loopback).  Admin requests (txmq's protocol) always go
    to ``broker.address``."""

    broker: EmbeddedBroker
    transport: str
    address: str

    @property
    def kw(self) -> dict[str, Any]:
        """Keyword arguments of a client on this transport."""
        return {"transport": self.transport}


def start_broker(
    embedded_broker: Callable[..., EmbeddedBroker], transport: str, **config: Any
) -> Via:
    """An embedded broker (serving gRPC too when ``transport`` is "grpc", and in process
    when it is "loopback")."""
    if transport == "grpc":
        pytest.importorskip("rocketmq.grpc_protocol.service_pb2_grpc")
        port = free_port()
        b = embedded_broker(grpc_port=port, **config)
        return Via(b, transport, f"127.0.0.1:{port}")
    if transport == "loopback":
        address = f"in-process-test:{next(_IN_PROCESS)}"
        return Via(embedded_broker(in_process=address, **config), transport, address)
    b = embedded_broker(**config)
    return Via(b, transport, b.address)


PG_URL = os.environ.get(
    "TXMQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)

app_metadata = MetaData()
orders = Table(
    "orders",
    app_metadata,
    Column("id", String(64), primary_key=True),
    Column("amount", Integer, nullable=False),
)
order_lines = Table(
    "order_lines",
    app_metadata,
    Column("id", Integer, primary_key=True),
    Column(
        "order_id",
        String(64),
        ForeignKey("orders.id", deferrable=True, initially="DEFERRED"),
        nullable=False,
    ),
)


class Base(DeclarativeBase):
    metadata = app_metadata


class Order(Base):
    __table__ = orders

    id: Mapped[str]
    amount: Mapped[int]


def create_all(conn: Any) -> None:
    txmq_metadata.create_all(conn)
    app_metadata.create_all(conn)


class Recorder:
    """Records what a fake producer was asked to do, in order, with other events."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self._offsets = itertools.count(1000)

    def result(self, msg: Message, transaction_id: str) -> SendResult:
        n = next(self._offsets)
        return SendResult("SEND_OK", f"MSG{n}", f"OFF{n}", msg.topic, 0, n, 0, transaction_offset=n)

    def ends(self) -> list[tuple[str, LocalTransactionState]]:
        return [(e[1], e[2]) for e in self.events if e[0] == "end"]

    def halves(self) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == "half"]


class FakeAsyncProducer:
    """Stands in for txmq.TransactionProducer (send_half / end_transaction)."""

    group = "test-producers"

    def __init__(self, rec: Recorder, *, end_error: Exception | None = None) -> None:
        self.rec = rec
        self.end_error = end_error
        self.listener: Any = None

    async def send_half(
        self,
        msg: Message,
        *,
        transaction_id: str,
        sharding_key: str | None = None,
        selector: MessageQueueSelector | None = None,
        arg: Any = None,
        queue_id: int | None = None,
        timeout: float | None = None,
    ) -> SendResult:
        result = self.rec.result(msg, transaction_id)
        self.rec.events.append(("half", result.msg_id, transaction_id, msg.topic, sharding_key))
        return result

    async def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        self.rec.events.append(("end", result.msg_id, state))
        if self.end_error is not None:
            raise self.end_error
        return "OK"


class FakeSyncProducer:
    """Stands in for txmq.sync.TransactionProducer."""

    def __init__(self, rec: Recorder, *, end_error: Exception | None = None) -> None:
        self.aio = FakeAsyncProducer(rec, end_error=end_error)  # like the sync facades
        self.rec = rec
        self.end_error = end_error

    def send_half(self, msg: Message, *, transaction_id: str, **kwargs: Any) -> SendResult:
        result = self.rec.result(msg, transaction_id)
        self.rec.events.append(
            ("half", result.msg_id, transaction_id, msg.topic, kwargs.get("sharding_key"))
        )
        return result

    def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        self.rec.events.append(("end", result.msg_id, state))
        if self.end_error is not None:
            raise self.end_error
        return "OK"


def pg_unreachable(exc: OperationalError) -> NoReturn:
    """Skip a PostgreSQL test when the server is down, except in CI (``CI=true``), where
    the test command starts it and a skip would hide a broken setup: there it fails."""
    why = f"PostgreSQL not reachable at {PG_URL}: {exc.orig}"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{why} (CI=true: PostgreSQL tests must run)", pytrace=False)
    pytest.skip(why)


@contextmanager
def pg_schema() -> Iterator[str]:
    """A fresh PostgreSQL schema (skips the test if the server is unreachable); yields a
    URL whose connections use it as their search path."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    schema = f"txmq_t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as exc:
        admin.dispose()
        pg_unreachable(exc)
    url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
