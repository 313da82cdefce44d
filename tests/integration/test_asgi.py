"""txmq in ASGI applications (txmq.asgi): a lifespan starts and stops the clients with the
application, and a FastAPI dependency gives each request a local transaction — over an
in-process broker, with Starlette's TestClient (which runs the lifespan), on SQLite and
PostgreSQL.

(No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations, which
name objects local to the test.)"""

import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
import pytest
import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tests.conftest import ROOT, free_port
from tests.sqla_support import app_metadata, orders, pg_schema
from txmq.asgi import ClientStartFailed, running, transaction_dependency, txmq_lifespan
from txmq.client.producer import Producer
from txmq.client.transaction import TransactionProducer
from txmq.consumer.push import ConsumeFrom, PushConsumer
from txmq.protocol.message import Message, MessageExt
from txmq.sqla import AsyncLocalTransaction, SqlTransactionChecker, transaction
from txmq.sqla.tables import metadata as txmq_metadata
from txmq.testing import InProcessBroker


@pytest.fixture
def broker(in_process_broker: Callable[..., InProcessBroker]) -> InProcessBroker:
    return in_process_broker()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An application database with txmq's tables and ``orders`` (an async URL)."""
    if request.param == "sqlite":
        path = tmp_path / "app.db"
        sync_url, async_url = f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}"
        yield from _seeded(sync_url, async_url)
    else:
        with pg_schema() as pg:
            yield from _seeded(pg, pg)


def _seeded(sync_url: str, async_url: str) -> Iterator[str]:
    engine = sa.create_engine(sync_url)
    with engine.begin() as conn:
        txmq_metadata.create_all(conn)
        app_metadata.create_all(conn)
    engine.dispose()
    yield async_url


class Service:
    """The FastAPI orders service of these tests: places an order (a row and an ``orders``
    message, in one local transaction) and bills it (a push consumer of ``orders``)."""

    def __init__(self, url: str) -> None:
        self.engine = create_async_engine(url)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.producer = TransactionProducer(
            group="orders", listener=SqlTransactionChecker(self.engine)
        )
        self.billed: list[bytes] = []
        self.consumer = PushConsumer(
            group="billing", listener=self.bill, consume_from=ConsumeFrom.FIRST_OFFSET
        )
        self.consumer.subscribe("orders")
        self.app = FastAPI(
            lifespan=txmq_lifespan(self.producer, self.consumer, lifespan=self.own_lifespan)
        )
        tx_dep = transaction_dependency(self.producer, self.sessions)
        Tx = Annotated[AsyncLocalTransaction, tx_dep]

        @self.app.post("/orders/{order_id}")
        async def place(order_id: str, tx: Tx, fail: str = "") -> dict[str, str]:
            await tx.session.execute(orders.insert().values(id=order_id, amount=42))
            await tx.send(Message("orders", order_id.encode(), keys=[order_id]))
            if fail == "error":
                raise RuntimeError(f"order {order_id} failed after sending")
            if fail == "http":
                raise HTTPException(409, f"order {order_id} refused")
            return {"placed": order_id}

    def bill(self, msg: MessageExt) -> None:
        self.billed.append(msg.body)

    @asynccontextmanager
    async def own_lifespan(self, app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        yield {"service": "orders"}
        await self.engine.dispose()

    async def ids(self) -> list[str]:
        async with self.engine.connect() as conn:
            return list((await conn.execute(sa.select(orders.c.id).order_by("id"))).scalars())


def _ids(service: Service, client: TestClient) -> list[str]:
    portal = client.portal
    assert portal is not None
    return portal.call(service.ids)


def test_the_lifespan_runs_the_clients_and_commits_with_the_endpoint(
    broker: InProcessBroker, url: str
) -> None:
    service = Service(url)
    assert not service.producer.started and not service.consumer.started
    with TestClient(service.app) as client:
        assert service.producer.started and service.consumer.started
        r = client.post("/orders/o-1")
        assert (r.status_code, r.json()) == (200, {"placed": "o-1"})
        broker.wait_consumed("billing", "orders")
        assert service.billed == [b"o-1"]
        assert _ids(service, client) == ["o-1"]
    assert not service.producer.started and not service.consumer.started


@pytest.mark.parametrize(("fail", "status"), [("error", 500), ("http", 409)])
def test_an_endpoint_that_raises_after_sending_rolls_back_its_row_and_its_message(
    broker: InProcessBroker, url: str, fail: str, status: int
) -> None:
    service = Service(url)
    with TestClient(service.app, raise_server_exceptions=False) as client:
        assert client.post("/orders/o-bad", params={"fail": fail}).status_code == status
        assert client.post("/orders/o-good").status_code == 200
        broker.wait_consumed("billing", "orders")
        assert _ids(service, client) == ["o-good"]
        # the rolled-back message never reached the topic; the one after it did
        assert broker.bodies("orders") == [b"o-good"]
        assert service.billed == [b"o-good"]


def test_a_starlette_app_runs_the_lifespan_and_a_transaction(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    """Starlette has no dependencies: the endpoint opens ``txmq.sqla.transaction``; the
    application's own lifespan runs inside txmq's and its state reaches the requests."""
    [url] = _seeded(f"sqlite:///{tmp_path / 'app.db'}", f"sqlite+aiosqlite:///{tmp_path}/app.db")
    engine = create_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    producer = TransactionProducer(group="orders", listener=SqlTransactionChecker(engine))
    billed: list[bytes] = []
    consumer = PushConsumer(
        group="billing", listener=lambda m: billed.append(m.body), consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("orders")
    seen_started: list[bool] = []

    @asynccontextmanager
    async def own(app: Starlette) -> AsyncIterator[dict[str, str]]:
        seen_started.append(producer.started and consumer.started)
        yield {"name": "orders"}
        seen_started.append(producer.started and consumer.started)
        await engine.dispose()

    async def place(request: Request) -> JSONResponse:
        order_id = request.path_params["order_id"]
        async with transaction(producer, sessions) as tx:
            await tx.session.execute(orders.insert().values(id=order_id, amount=1))
            await tx.send(Message("orders", order_id.encode()))
        return JSONResponse({"placed": order_id, "by": request.state.name})

    app = Starlette(
        routes=[Route("/orders/{order_id}", place, methods=["POST"])],
        lifespan=txmq_lifespan(producer, consumer, lifespan=own),
    )
    with TestClient(app) as client:
        assert client.post("/orders/s-1").json() == {"placed": "s-1", "by": "orders"}
        broker.wait_consumed("billing", "orders")
        assert billed == [b"s-1"]
    assert seen_started == [True, True]
    assert not producer.started and not consumer.started


def test_a_client_that_fails_to_start_fails_the_startup_in_one_line(
    broker: InProcessBroker,
) -> None:
    first = Producer(group="first")
    dead = Producer(f"127.0.0.1:{free_port()}", group="nowhere", transport="txmq")
    never = PushConsumer(group="never")
    never.subscribe("orders")
    app = Starlette(lifespan=txmq_lifespan(first, dead, never))
    with pytest.raises(ClientStartFailed) as caught, TestClient(app):
        pass
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(
        "txmq: Producer 'nowhere' (client 2 of 3) did not start: BrokerUnavailable: "
    ), message
    assert message.endswith("; stopped the 1 started before it"), message
    assert caught.value.__cause__ is not None
    assert not first.started and not dead.started and not never.started


class Fake:
    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    async def start(self) -> None:
        if self.fails:
            raise OSError(f"{self.name} cannot\nstart")
        self.log.append(f"start {self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_clients_start_in_order_and_stop_in_reverse() -> None:
    log: list[str] = []

    async def main() -> None:
        async with running(Fake("a", log), Fake("b", log), Fake("c", log)):
            log.append("serving")

    anyio.run(main)
    assert log == ["start a", "start b", "start c", "serving", "stop c", "stop b", "stop a"]

    log.clear()

    async def failing() -> None:
        async with running(Fake("a", log), Fake("b", log), Fake("c", log, fails=True)):
            log.append("serving")

    with pytest.raises(ClientStartFailed, match=r"^txmq: Fake \(client 3 of 3\) did not "):
        anyio.run(failing)
    assert log == ["start a", "start b", "stop b", "stop a"]


def test_blocking_clients_are_refused_at_once() -> None:
    import txmq.sync

    with pytest.raises(TypeError, match="not an async client"):
        txmq_lifespan(txmq.sync.Producer("127.0.0.1:1"))  # type: ignore[arg-type]


def test_importing_txmq_asgi_imports_no_web_framework() -> None:
    code = (
        "import sys, txmq.asgi; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]"
