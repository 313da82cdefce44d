"""The inventory service, in async code (``AsyncSession``), as a FastAPI service would be.

It consumes ``OrderCreated`` orderly (a queue's messages one at a time, in order; a
sharding key's messages share a queue) and idempotently: the message's key, the stock
change, the reservation and the reply all commit in one database transaction, so a
redelivered or duplicated ``OrderCreated`` is skipped, and a crash before the commit
leaves nothing behind (the message is delivered again).

Stock is taken with one conditional ``UPDATE ... WHERE available >= quantity`` — never
read and written back, so two queues reserving the same product at once can't oversell.
The reply (``StockReserved`` / ``StockRejected``) goes into the transactional outbox, and
an :class:`outbox.OutboxRelay` in the same process sends it.

HTTP: ``GET /stock``, ``GET /stats``, ``POST /faults {"crash": "in-handler"}`` (the next
``OrderCreated`` kills the process after its writes, before their commit).
"""

from __future__ import annotations

import logging
from typing import Any, Self

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

import txmq
from examples.orders.counters import Counters
from examples.orders.db import connect
from examples.orders.faults import Faults
from examples.orders.models import (
    ORDER_CREATED,
    REJECTED,
    RESERVED,
    STOCK_REPLIES,
    OrderCreated,
    Reservation,
    Stock,
    StockReply,
)
from examples.orders.web import JsonServer
from txmq import ConsumeFrom, ConsumeResult, Message, MessageExt, Producer, PushConsumer, outbox
from txmq.outbox.store import pending_lag

__all__ = ["GROUP", "InventoryService"]

log = logging.getLogger("examples.orders.inventory_service")

GROUP = "inventory-service"


class InventoryService:
    def __init__(
        self,
        db: str,
        broker: str | None = None,
        *,
        namesrv: str | None = None,
        instance: str = "inventory-1",
        max_reconsume_times: int = 16,
        claim_lease: float = 30.0,
        route_ttl: float = 30.0,
    ) -> None:
        url = outbox.async_url(db)
        sqlite = url.get_backend_name() == "sqlite"
        self.aengine = create_async_engine(url, connect_args={"timeout": 30} if sqlite else {})
        self.sessions = async_sessionmaker(self.aengine, expire_on_commit=False)
        self.read_engine = connect(db)  # the HTTP front's reads, from its threads
        # the relay's own producer: sharding="available", as an order has one reply (its
        # key's order cannot break), so a reply whose broker set is down goes to another
        self.relay_producer = Producer(
            broker, "txmq-outbox-relay", namesrv=namesrv, sharding="available", route_ttl=route_ttl
        )
        self.relay = outbox.OutboxRelay(self.aengine, self.relay_producer, claim_lease=claim_lease)
        self.faults = Faults(("in-handler",))
        self.counters = Counters()
        reserve = txmq.idempotent(
            self.sessions,
            group=f"{GROUP}/{ORDER_CREATED}",
            on_duplicate=lambda m, k: self.counters.add("duplicates_skipped"),
        )(self._reserve)

        async def listener(msg: MessageExt) -> ConsumeResult:
            try:
                result: ConsumeResult = await reserve(msg)
            except Exception as exc:
                self.counters.add("handler_failures")
                log.warning("OrderCreated %s failed (%s); retried later", msg.msg_id, exc)
                raise
            return result

        self.consumer = PushConsumer(
            broker,
            GROUP,
            namesrv=namesrv,
            listener=listener,
            orderly=True,
            instance_name=instance,
            consume_from=ConsumeFrom.FIRST_OFFSET,
            max_reconsume_times=max_reconsume_times,
            route_ttl=route_ttl,
            # offsets committed soon: the order front's wait_consumed sees them (0.5 s, not 5)
            persist_interval=0.5,
        )
        self.consumer.subscribe(ORDER_CREATED)
        self.server: JsonServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, port: int = 0) -> Self:
        await self.relay_producer.start()
        try:
            await self.relay.start()
            try:
                await self.consumer.start()
            except BaseException:
                await self.relay.stop()
                raise
        except BaseException:
            await self.relay_producer.stop()
            raise
        self.server = JsonServer(
            {
                ("GET", "/stock"): lambda req: (200, self.stock()),
                ("GET", "/stats"): lambda req: (200, self.stats()),
                ("POST", "/faults"): self.faults.route,
            },
            port=port,
        ).start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        try:
            await self.consumer.stop()
        finally:
            try:
                await self.relay.stop()  # its engine and producer are ours: stopped below
            finally:
                await self.relay_producer.stop()
                await self.aengine.dispose()
                self.read_engine.dispose()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- consuming -------------------------------------------------------------------------

    async def _reserve(self, msg: MessageExt, session: AsyncSession) -> None:
        event = OrderCreated.decode(msg.body)  # malformed: raises, retried, then the DLQ
        taken = await session.execute(
            update(Stock)
            .where(Stock.product == event.product, Stock.available >= event.quantity)
            .values(
                available=Stock.available - event.quantity,
                reserved=Stock.reserved + event.quantity,
            )
        )
        if taken.rowcount == 1:  # type: ignore[attr-defined]
            reply = StockReply(event.order_id, True)
        elif await session.get(Stock, event.product) is None:
            reply = StockReply(event.order_id, False, f"unknown product {event.product!r}")
        else:
            reply = StockReply(event.order_id, False, "insufficient stock")
        session.add(
            Reservation(
                order_id=event.order_id,
                product=event.product,
                quantity=event.quantity,
                state=RESERVED if reply.reserved else REJECTED,
                reason=reply.reason,
            )
        )
        await outbox.add_async(
            session,
            Message(
                STOCK_REPLIES,
                reply.encode(),
                tags=reply.tag,
                keys=[f"order-{event.order_id}-stock"],
            ),
            sharding_key=event.order_id,
        )
        await session.flush()
        self.faults.reached("in-handler", event.order_id)  # written, not committed
        self.counters.add("reserved" if reply.reserved else "rejected")

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
            backlog, lag = pending_lag(s.connection())
        counters = self.counters.snapshot()
        return {
            "reservations": by_state,
            "outbox_backlog": backlog,
            "outbox_lag_s": lag,
            **counters,
        }
