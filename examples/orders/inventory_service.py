"""The inventory service, in async code (``AsyncSession``), as a FastAPI service would be:
a participant of the ``place-order`` saga.

- ``reserve-stock`` takes the order's units with one conditional ``UPDATE ... WHERE
  available >= quantity`` (never read and written back, so two orders of one product at
  once cannot oversell) and records a RESERVED reservation; short of stock, or an unknown
  product, it refuses (``Refuse``: the saga compensates the steps before it — none).
- ``release-stock`` (its compensation) gives the units back and marks the reservation
  RELEASED.

Each runs behind the saga barrier in one local transaction with its answer to the
coordinator (a transactional message: the broker checks back with the transaction log),
so a redelivered command has no second effect, a compensation that comes before its action
makes that action a no-op, and a crash before the commit leaves nothing behind (the command
is delivered again).

HTTP: ``GET /stock``, ``GET /stats``, ``POST /faults {"crash": "in-reserve" |
"in-release"}`` (the next reservation or release kills the process after its writes,
before their commit).
"""

from __future__ import annotations

import logging
from typing import Any, Self

import anyio
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

import txmq
from examples.orders.counters import Counters
from examples.orders.db import connect
from examples.orders.faults import Faults
from examples.orders.models import RELEASED, RESERVED, OrderData, Reservation, Stock
from examples.orders.web import JsonServer
from txmq.saga import Participant, Refuse
from txmq.sqla import SqlTransactionChecker
from txmq.sqla.db import async_url

__all__ = ["GROUP", "SERVICE", "InventoryService"]

log = logging.getLogger("examples.orders.inventory_service")

SERVICE = "inventory"
"""Its name in the saga's steps."""
GROUP = f"saga-{SERVICE}"
"""The consumer group of its saga commands."""


class InventoryService:
    """``broker``: one broker's ``HOST:PORT``; or ``namesrv``: a cluster's name servers.

    ``max_reconsume_times``: how often a command that raised is delivered again before
    the step's own retry limit decides (a malformed command goes to the dead letters at
    once)."""

    def __init__(
        self,
        db: str,
        broker: str | None = None,
        *,
        namesrv: str | None = None,
        instance: str = "inventory-1",
        route_ttl: float = 30.0,
        heartbeat_interval: float = 30.0,
    ) -> None:
        url = async_url(db)
        sqlite = url.get_backend_name() == "sqlite"
        self.aengine = create_async_engine(url, connect_args={"timeout": 30} if sqlite else {})
        self.sessions = async_sessionmaker(self.aengine, expire_on_commit=False)
        self.read_engine = connect(db)  # the HTTP front's reads, from its threads
        self.faults = Faults(("in-reserve", "in-release"))
        self.counters = Counters()
        # sharding="available": each answer is one message the coordinator matches by its
        # command's id, so no order can break; while the broker set a saga id hashes to is
        # down, the answer goes to another set instead of failing (and being retried)
        self.producer = txmq.TransactionProducer(
            broker,
            f"{SERVICE}-tx",
            namesrv=namesrv,
            listener=SqlTransactionChecker(self.aengine),
            sharding="available",
            route_ttl=route_ttl,
            heartbeat_interval=heartbeat_interval,
        )
        self.participant = Participant(SERVICE, self.producer, self.sessions)
        self.participant.action("reserve-stock")(self._reserve)
        self.participant.compensation("release-stock")(self._release)
        self.consumer = txmq.PushConsumer(
            broker,
            namesrv=namesrv,
            instance_name=instance,
            route_ttl=route_ttl,
            **self.participant.consumer_options(),
        )
        self.consumer.subscribe(self.participant.topic)
        self.server: JsonServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, port: int = 0) -> Self:
        await self.producer.start()
        try:
            await self.consumer.start()
        except BaseException:
            await self.producer.stop()
            raise
        self.server = JsonServer(
            {
                ("GET", "/stock"): lambda req: (200, self.stock()),
                ("GET", "/stats"): lambda req: (200, self.stats()),
                ("POST", "/faults"): self.faults.route,
            },
            port=port,
        )
        # its own thread and event loop (uvicorn's), started and stopped off this loop
        await anyio.to_thread.run_sync(self.server.start)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await anyio.to_thread.run_sync(self.server.stop)
        try:
            await self.consumer.stop()
        finally:
            await self.producer.stop()
            await self.aengine.dispose()
            self.read_engine.dispose()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the saga's steps ------------------------------------------------------------------

    async def _reserve(self, data: dict[str, Any], session: AsyncSession) -> dict[str, Any]:
        order = OrderData.of(data)
        taken = await session.execute(
            update(Stock)
            .where(Stock.product == order.product, Stock.available >= order.quantity)
            .values(
                available=Stock.available - order.quantity,
                reserved=Stock.reserved + order.quantity,
            )
        )
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            self.counters.add("refused")
            if await session.get(Stock, order.product) is None:
                raise Refuse(f"unknown product {order.product!r}")
            raise Refuse("insufficient stock")
        session.add(
            Reservation(
                order_id=order.order,
                product=order.product,
                quantity=order.quantity,
                state=RESERVED,
            )
        )
        await session.flush()
        self.faults.reached("in-reserve", order.order)  # written, not committed
        self.counters.add("reserved")
        return {"reserved": order.quantity}

    async def _release(self, data: dict[str, Any], session: AsyncSession) -> None:
        order = OrderData.of(data)
        held = await session.get(Reservation, order.order, with_for_update=True)
        if held is None or held.state != RESERVED:  # the barrier lets one release through
            raise LookupError(f"order {order.order}: no stock reserved to release")
        await session.execute(
            update(Stock)
            .where(Stock.product == held.product)
            .values(
                available=Stock.available + held.quantity,
                reserved=Stock.reserved - held.quantity,
            )
        )
        held.state = RELEASED
        await session.flush()
        self.faults.reached("in-release", order.order)
        self.counters.add("released")

    # -- reading ---------------------------------------------------------------------------

    def stock(self) -> list[dict[str, Any]]:
        with Session(self.read_engine) as s:
            return [
                {
                    "product": st.product,
                    "initial": st.initial,
                    "available": st.available,
                    "reserved": st.reserved,
                }
                for st in s.scalars(select(Stock).order_by(Stock.product))
            ]

    def stats(self) -> dict[str, Any]:
        with Session(self.read_engine) as s:
            by_state = dict(
                s.execute(select(Reservation.state, func.count()).group_by(Reservation.state)).all()
            )
        return {"reservations": by_state, **self.counters.snapshot()}
