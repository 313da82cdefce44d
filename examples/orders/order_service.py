"""The order service, in blocking code (``Session``, ``txmq.sync``), as a Flask or Django
service would be written.

``place(product, quantity)`` creates the order PENDING in a local transaction with a
transactional send of ``OrderCreated`` (sharded by order id): the order row, the
transaction-log row and the half message commit together or not at all, and a crash
between the database commit and the broker's COMMIT is settled by the broker checking
back with any live producer of the group (``SqlTransactionChecker``).

The inventory's ``StockReserved`` / ``StockRejected`` replies are consumed idempotently
(the reply's key is recorded in the same transaction as the order's new state): the order
becomes CONFIRMED, or CANCELLED — the compensation when stock is short.

HTTP: ``POST /orders[?wait=S] {"product", "quantity"}`` (with ``wait``: the answer waits
up to S seconds for the inventory service to consume the order's ``OrderCreated`` —
``txmq.wait_consumed`` — and says ``"inventory": "consumed"`` with the order as it is then,
or ``"pending"``), ``GET /orders[?state=]``,
``GET /orders/<id>``, ``GET /stats``, ``POST /faults {"crash": point}``.
Crash points: ``before-db-commit`` (the half message is sent, the order not committed:
the check-back rolls it back) and ``after-db-commit`` (the order is committed, the broker
not told: the check-back commits it).  Hold point (``{"hold": "before-broker-commit",
"when": BROKER_NAME}``): the next order whose half message is on that broker set waits
after its database commit, before COMMIT is sent, until ``{"release": ...}``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import UTC, datetime
from typing import Any, Self

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

import txmq
import txmq.sync
from examples.orders.counters import Counters
from examples.orders.db import connect
from examples.orders.faults import Faults
from examples.orders.models import (
    CANCELLED,
    CONFIRMED,
    ORDER_CREATED,
    PENDING,
    STOCK_REPLIES,
    Order,
    OrderCreated,
    StockReply,
)
from examples.orders.web import JsonServer, Request
from txmq import ConsumeFrom, Message, MessageExt
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.wire.errors import TxmqError
from txmq.sqla import SqlTransactionChecker, transaction

__all__ = ["GROUP", "OrderService"]

log = logging.getLogger("examples.orders.order_service")

GROUP = "order-service"
"""The service's producer group (check-backs go to any live member) and consumer group."""
MAX_QUANTITY = 1000
MAX_WAIT = 30.0
INVENTORY_GROUP = "inventory-service"
"""The inventory service's consumer group (``inventory_service.GROUP``)."""


class _FaultyProducer(txmq.sync.TransactionProducer):
    """Dies before telling the broker COMMIT when ``after-db-commit`` is armed."""

    faults: Faults
    current: threading.local
    counters: Counters

    def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState | str,
        *,
        from_check: bool = False,
    ) -> str:
        if not from_check and LocalTransactionState(state) is LocalTransactionState.COMMIT:
            order_id = getattr(self.current, "order_id", "?")
            self.faults.reached("after-db-commit", order_id)
            self.faults.held("before-broker-commit", result.broker_name, order_id)
        try:
            return super().end_transaction(result, state, from_check=from_check)
        except TxmqError:
            # e.g. its broker set died after storing the half: its check-back settles it
            self.counters.add(f"ends_lost_on_{result.broker_name or 'broker'}")
            raise


class OrderService:
    """``broker``: one broker's ``HOST:PORT``; or ``namesrv``: a cluster's name servers
    (``"h1:9876;h2:9876"``), whose routes spread the orders over its broker sets.

    ``heartbeat_interval``: how often the producer tells every broker it knows that it is
    alive (a broker checks a transaction back only with a producer that heartbeats it: a
    restarted broker set waits up to this long for its check-backs).

    ``route_ttl``: how long the producer and the consumer keep a route before asking the
    name servers again (a broker set whose master died is left out of sends until a route
    names its new master).
    """

    def __init__(
        self,
        db: str,
        broker: str | None = None,
        *,
        namesrv: str | None = None,
        instance: str = "orders-1",
        heartbeat_interval: float = 30.0,
        route_ttl: float = 30.0,
    ) -> None:
        self.engine = connect(db)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.faults = Faults(("before-db-commit", "after-db-commit"), ("before-broker-commit",))
        self._current = threading.local()
        # sharding="available": an order has one OrderCreated, so its key's order cannot
        # break; while the broker set its key hashes to is down, the order goes to another
        # set at once instead of being refused (in a cluster; one broker: no other set)
        self.producer = _FaultyProducer(
            broker,
            GROUP,
            namesrv=namesrv,
            listener=SqlTransactionChecker(self.engine),
            sharding="available",
            heartbeat_interval=heartbeat_interval,
            route_ttl=route_ttl,
        )
        self.counters = Counters()
        self.producer.faults, self.producer.current = self.faults, self._current
        self.producer.counters = self.counters

        on_reply = txmq.idempotent(
            self.sessions,
            group=f"{GROUP}/{STOCK_REPLIES}",
            on_duplicate=lambda m, k: self.counters.add("replies_duplicate"),
        )(self._apply_reply)
        self.consumer = txmq.sync.PushConsumer(
            broker,
            GROUP,
            namesrv=namesrv,
            listener=on_reply,
            instance_name=instance,
            consume_from=ConsumeFrom.FIRST_OFFSET,
            route_ttl=route_ttl,
        )
        self.consumer.subscribe(STOCK_REPLIES)
        # the front's wait for the inventory (POST /orders?wait=S): offset lookups
        self.admin = txmq.sync.AdminClient(broker, namesrv=namesrv)
        self.server: JsonServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, port: int = 0) -> Self:
        self.producer.start()
        try:
            self.consumer.start()
            self.admin.start()
        except BaseException:
            self.consumer.stop()
            self.producer.stop()
            raise
        self.server = JsonServer(
            {
                ("POST", "/orders"): self._post_order,
                ("GET", "/orders"): self._get_orders,
                ("GET", "/orders/(?P<id>[0-9a-f]{32})"): self._get_order,
                ("GET", "/stats"): lambda req: (200, self.stats()),
                ("POST", "/faults"): self.faults.route,
            },
            port=port,
        ).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.admin.stop()
        self.consumer.stop()
        self.producer.stop()
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- orders ----------------------------------------------------------------------------

    def place(self, product: str, quantity: int) -> dict[str, Any]:
        """Create an order and announce it, as one step; the order, and the name of the
        broker set that stored its ``OrderCreated`` (``broker``)."""
        if not isinstance(product, str) or not 0 < len(product) <= 64:
            raise ValueError("product must be a name of 1 to 64 characters")
        if isinstance(quantity, bool) or not isinstance(quantity, int):
            raise ValueError("quantity must be a whole number")
        if not 0 < quantity <= MAX_QUANTITY:
            raise ValueError(f"quantity must be between 1 and {MAX_QUANTITY}")
        order_id = uuid.uuid4().hex
        self._current.order_id = order_id
        event = OrderCreated(order_id, product, quantity)
        msg = Message(
            ORDER_CREATED, event.encode(), tags="OrderCreated", keys=[f"order-{order_id}-created"]
        )
        with transaction(self.producer, self.sessions) as tx:
            order = Order(id=order_id, product=product, quantity=quantity, state=PENDING)
            tx.session.add(order)
            sent = tx.send(msg, sharding_key=order_id)
            self.faults.reached("before-db-commit", order_id)
        self.counters.add("orders_placed")
        return {**order.as_dict(), "broker": sent.broker_name, "msg_id": sent.msg_id}

    def wait_for_inventory(self, placed: dict[str, Any], timeout: float) -> dict[str, Any]:
        """``placed`` (from :meth:`place`) once the inventory service has consumed its
        ``OrderCreated`` (then the order as it is now: CONFIRMED or CANCELLED if the reply
        came back already), or after ``timeout`` seconds as it was; ``inventory`` says
        which ("consumed" or "pending")."""
        try:
            self.admin.wait_consumed(placed["msg_id"], INVENTORY_GROUP, timeout=timeout)
        except TxmqError as exc:  # ConsumeTimeout, or the broker did not answer
            log.info("order %s: inventory not seen yet (%s)", placed["id"], exc)
            return {**placed, "inventory": "pending"}
        with self.sessions() as s:
            order = s.get(Order, placed["id"])
            now = order.as_dict() if order is not None else {}
        return {**placed, **now, "inventory": "consumed"}

    def _apply_reply(self, msg: MessageExt, session: Session) -> None:
        reply = StockReply.decode(msg.body)
        order = session.get(Order, reply.order_id, with_for_update=True)
        if order is None:  # cannot happen: the order commits before its message is sent
            raise LookupError(f"reply for unknown order {reply.order_id}")
        if order.state == PENDING:
            order.state = CONFIRMED if reply.reserved else CANCELLED
            order.reason = reply.reason
            order.updated_at = datetime.now(UTC)
        self.counters.add("replies_applied")

    def stats(self) -> dict[str, Any]:
        with self.sessions() as s:
            by_state = dict(
                s.execute(select(Order.state, func.count()).group_by(Order.state)).all()
            )
        counters = self.counters.snapshot()
        return {"orders": by_state, **counters}

    # -- HTTP ------------------------------------------------------------------------------

    def _post_order(self, req: Request) -> tuple[int, Any]:
        if not isinstance(req.body, dict):
            raise ValueError('expected {"product": "...", "quantity": N}')
        wait = req.param("wait")
        timeout = float(wait) if wait is not None else 0.0
        if not 0 <= timeout <= MAX_WAIT:
            raise ValueError(f"wait must be between 0 and {MAX_WAIT} seconds")
        placed = self.place(req.body.get("product"), req.body.get("quantity"))  # type: ignore[arg-type]
        if timeout:
            placed = self.wait_for_inventory(placed, timeout)
        return 201, placed

    def _get_orders(self, req: Request) -> tuple[int, Any]:
        q = select(Order).order_by(Order.created_at.desc()).limit(100)
        state = req.param("state")
        if state is not None:
            if state.upper() not in (PENDING, CONFIRMED, CANCELLED):
                raise ValueError(f"state must be {PENDING}, {CONFIRMED} or {CANCELLED}")
            q = q.where(Order.state == state.upper())
        with self.sessions() as s:
            return 200, [o.as_dict() for o in s.scalars(q)]

    def _get_order(self, req: Request) -> tuple[int, Any]:
        order_id = req.match.group("id")
        with self.sessions() as s:
            order = s.get(Order, order_id)
            if order is None:
                raise LookupError(f"no order {order_id}")
            return 200, order.as_dict()
