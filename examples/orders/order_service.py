"""The order service, in blocking code (``Session``, ``txmq.sync``), as a Flask or Django
service would be written: it coordinates the ``place-order`` saga.

``place(product, quantity, customer)`` creates the order PENDING and starts its saga in
one local transaction: the order row, the saga's row and the half message of its first
command (reserve the stock) commit together or not at all, and a crash between the
database commit and the broker's COMMIT is settled by the broker checking back with any
live producer of the group (``SqlTransactionChecker``).  From then on the saga's state
lives in this database: each answer of the inventory and the payment service moves it on
(charge, then confirm) in a local transaction, then sends the next command.  The last step,
``confirm-order``, is this service's own review (customers on its blocklist are refused):
it marks the order CONFIRMED; when a step refuses, fails or times out, the steps before it
are compensated in reverse order (refund, release the stock) and, in the transaction that
records the saga COMPENSATED, the order becomes CANCELLED with the saga's reason.

HTTP: ``POST /orders[?wait=S] {"product", "quantity", "customer"[, "id"]}`` (``id``: a
32-hex-digit id chosen by the client, so that a retried request cannot place the order
twice; with ``wait``: the answer waits up to S seconds for the saga to end and shows the
order as it is then), ``GET /orders[?state=]``, ``GET /orders/<id>`` (with its saga's
steps, and ``checked_back``: how often a broker checked its transaction back),
``GET /stats``, ``POST /faults {"crash": point}``.
Crash points: ``before-db-commit`` (the half message is sent, the order not committed: the
check-back rolls it back), ``after-db-commit`` (the order is committed, the broker not
told: the check-back commits it) and ``between-steps`` (an answer taken and the next
command decided and committed, the command not sent: the answer comes again, finds its
decision taken, and the command is sent again).
Hold point (``{"hold": "before-broker-commit", "when": BROKER_NAME}``): the next order whose
first command is on that broker set waits after its database commit, before COMMIT is sent,
until ``{"release": ...}``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Self

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

import txmq.sync
from examples.orders.counters import Counters
from examples.orders.db import connect
from examples.orders.faults import Faults
from examples.orders.models import (
    CANCELLED,
    CONFIRMED,
    DEFAULT_CHARGE_DEADLINE_S,
    PENDING,
    Order,
    OrderData,
    place_order,
    price_of,
)
from examples.orders.web import JsonServer, Request
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message, MessageExt
from txmq.protocol.wire.errors import TxmqError
from txmq.saga import Coordinator, Ended, Participant, Refuse, saga_info
from txmq.sqla import SqlTransactionChecker

__all__ = ["BLOCKLIST", "GROUP", "SERVICE", "OrderService"]

log = logging.getLogger("examples.orders.order_service")

SERVICE = "orders"
"""Its name in the saga's steps (and its coordinator's)."""
GROUP = "order-service"
"""The service's producer group (check-backs go to any live member)."""
MAX_QUANTITY = 1000
MAX_WAIT = 30.0
#: customers the order review refuses (after their card was charged: the saga refunds it)
BLOCKLIST = frozenset({"mallory"})
_ID = re.compile(r"[0-9a-f]{32}\Z")


class _FaultyProducer(txmq.sync.TransactionProducer):
    """Dies where an armed crash point says: after a placed order's half message is sent
    (``before-db-commit``), before telling the broker COMMIT of a placed order
    (``after-db-commit``), or before sending the command of a step the coordinator decided
    and committed (``between-steps``)."""

    faults: Faults
    current: threading.local
    counters: Counters

    def send_half(self, msg: Message, **options: Any) -> SendResult:
        result = super().send_half(msg, **options)
        order_id = getattr(self.current, "order_id", None)
        if order_id is not None:
            self.faults.reached("before-db-commit", order_id)
        return result

    def send(self, msg: Message, **options: Any) -> SendResult:
        if msg.keys and not msg.topic.endswith("-replies"):
            # the command of a step the coordinator decided (committed by now), keyed
            # "<saga id>/<step>/<op>" — whichever thread sends it (answers decided together
            # leave from the thread that led their group)
            saga_id, _, rest = msg.keys[0].partition("/")
            step = rest.partition("/")[0]
            self.faults.reached("between-steps", saga_id, f"{saga_id}/{step}")
        return super().send(msg, **options)

    def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState | str,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        if not from_check and LocalTransactionState(state) is LocalTransactionState.COMMIT:
            order_id = getattr(self.current, "order_id", None)
            if order_id is not None:
                self.faults.reached("after-db-commit", order_id)
                self.faults.held("before-broker-commit", result.broker_name, order_id)
        try:
            return super().end_transaction(result, state, from_check=from_check, wait=wait)
        except TxmqError:
            # e.g. its broker set died after storing the half: its check-back settles it
            self.counters.add(f"ends_lost_on_{result.broker_name or 'broker'}")
            raise


class _CountingChecker(SqlTransactionChecker):
    """Answers check-backs from the transaction log, and counts them by order: a COMMIT
    sent without waiting (oneway) to a broker that has just died can vanish without an
    error, so the check-back, not a failed send, shows that the broker settled it."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        #: check-backs by order id
        self.checked: Counter[str] = Counter()

    async def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        state = await super().check_local_transaction(msg)
        if msg.keys:  # a saga's command: "<saga id (the order's)>/<step>/<op>"
            self.checked[msg.keys[0].partition("/")[0]] += 1
        return state


class OrderService:
    """``broker``: one broker's ``HOST:PORT``; or ``namesrv``: a cluster's name servers
    (``"h1:9876;h2:9876"``), whose routes spread the sagas over its broker sets.

    ``heartbeat_interval``: how often the producer tells every broker it knows that it is
    alive (a broker checks a transaction back only with a producer that heartbeats it: a
    restarted broker set waits up to this long for its check-backs).

    ``route_ttl``: how long the clients keep a route before asking the name servers again
    (a broker set whose master died is left out of sends until a route names its new
    master).

    ``charge_deadline``: seconds the saga waits for the payment service's answer to a
    charge before it gives up and compensates (stored with each saga as it starts).
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
        charge_deadline: float = DEFAULT_CHARGE_DEADLINE_S,
    ) -> None:
        self.engine = connect(db)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.faults = Faults(
            ("before-db-commit", "after-db-commit", "between-steps"), ("before-broker-commit",)
        )
        self._current = threading.local()
        self.counters = Counters()
        self.checker = _CountingChecker(self.engine)
        # sharding="available": a saga's messages are answered one at a time, so their
        # order cannot break; while the broker set a saga id hashes to is down, its command
        # goes to another set at once instead of being refused (one broker: no other set)
        self.producer = _FaultyProducer(
            broker,
            GROUP,
            namesrv=namesrv,
            listener=self.checker,
            sharding="available",
            heartbeat_interval=heartbeat_interval,
            route_ttl=route_ttl,
        )
        self.producer.faults, self.producer.current = self.faults, self._current
        self.producer.counters = self.counters
        self.saga = place_order(charge_deadline)
        self.coordinator = Coordinator(
            SERVICE, self.producer, self.sessions, [self.saga], on_end=self._ended
        )
        self.participant = Participant(SERVICE, self.producer, self.sessions)
        self.participant.action("confirm-order")(self._confirm)
        self.consumers = [
            txmq.sync.PushConsumer(
                broker,
                namesrv=namesrv,
                instance_name=instance,
                route_ttl=route_ttl,
                **options,
            )
            for options in (
                self.coordinator.consumer_options(),
                self.participant.consumer_options(),
            )
        ]
        self.consumers[0].subscribe(self.coordinator.topic)
        self.consumers[1].subscribe(self.participant.topic)
        self.server: JsonServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, port: int = 0) -> Self:
        self.producer.start()
        started: list[txmq.sync.PushConsumer] = []
        try:
            for consumer in self.consumers:
                started.append(consumer.start())
        except BaseException:
            for consumer in started:
                consumer.stop()
            self.producer.stop()
            raise
        self.server = JsonServer(
            {
                ("POST", "/orders"): self._post_order,
                ("GET", "/orders"): self._get_orders,
                ("GET", "/orders/{id}"): self._get_order,
                ("GET", "/stats"): lambda req: (200, self.stats()),
                ("POST", "/faults"): self.faults.route,
            },
            port=port,
        ).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        for consumer in self.consumers:
            consumer.stop()
        self.producer.stop()
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- orders ----------------------------------------------------------------------------

    def place(
        self, product: str, quantity: int, customer: str, order_id: str | None = None
    ) -> dict[str, Any]:
        """Create an order and start its saga, as one step; the order, and the name of the
        broker set that stored its first command (``broker``).  ``order_id`` (32 hex
        digits; default: a new one) is also the saga's id: an order placed again with the
        same id is refused (ValueError), not placed twice."""
        if not isinstance(product, str) or not 0 < len(product) <= 64:
            raise ValueError("product must be a name of 1 to 64 characters")
        if not isinstance(customer, str) or not 0 < len(customer) <= 64:
            raise ValueError("customer must be a name of 1 to 64 characters")
        if isinstance(quantity, bool) or not isinstance(quantity, int):
            raise ValueError("quantity must be a whole number")
        if not 0 < quantity <= MAX_QUANTITY:
            raise ValueError(f"quantity must be between 1 and {MAX_QUANTITY}")
        if order_id is None:
            order_id = uuid.uuid4().hex
        elif not isinstance(order_id, str) or not _ID.match(order_id):
            raise ValueError("id must be 32 hexadecimal digits (lower case)")
        amount = price_of(product, quantity)
        data = OrderData(order_id, product, quantity, customer, amount)
        self._current.order_id = order_id
        try:
            placed = self._start(data, order_id)
        except IntegrityError as exc:  # the same id placed at the same moment
            raise ValueError(f"order {order_id} exists already") from exc
        finally:
            self._current.order_id = None
        self.counters.add("orders_placed")
        order, first = placed
        return {**order.as_dict(), "broker": first.broker_name, "msg_id": first.msg_id}

    def _start(self, data: OrderData, order_id: str) -> tuple[Order, SendResult]:
        """The order's row and its saga's start, in one local transaction."""
        with self.sessions() as session:
            if session.get(Order, order_id) is not None:
                raise ValueError(f"order {order_id} exists already")
            with self.coordinator.start(
                session, self.saga, data.as_dict(), saga_id=order_id
            ) as saga:
                order = Order(
                    id=order_id,
                    product=data.product,
                    quantity=data.quantity,
                    customer=data.customer,
                    amount=data.amount,
                    state=PENDING,
                )
                session.add(order)
        return order, saga.sent[0]

    def wait_for_saga(self, placed: dict[str, Any], timeout: float) -> dict[str, Any]:
        """``placed`` (from :meth:`place`) as it is once its saga ended (CONFIRMED or
        CANCELLED), or after ``timeout`` seconds (PENDING)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.sessions() as s:
                order = s.get(Order, placed["id"])
                now = order.as_dict() if order is not None else {}
            if now.get("state", PENDING) != PENDING or time.monotonic() >= deadline:
                return {**placed, **now}
            time.sleep(0.05)

    # -- the saga --------------------------------------------------------------------------

    def _confirm(self, data: dict[str, Any], session: Session) -> None:
        """The last step: the order review; CONFIRMED, or refused (the saga refunds the
        charge and releases the stock)."""
        order_data = OrderData.of(data)
        order = session.get(Order, order_data.order, with_for_update=True)
        if order is None:  # cannot happen: the order commits with its saga
            raise LookupError(f"no order {order_data.order}")
        if order_data.customer in BLOCKLIST:
            raise Refuse(f"order review: customer {order_data.customer!r} is blocked")
        order.state = CONFIRMED
        order.updated_at = datetime.now(UTC)
        self.counters.add("confirmed")

    def _ended(self, ended: Ended, session: Session) -> None:
        """In the transaction that records the saga's end: a compensated saga cancels its
        order, with the reason (a completed one confirmed it in its last step)."""
        if ended.state != "COMPENSATED":
            return
        order = session.get(Order, ended.saga_id, with_for_update=True)
        if order is not None and order.state == PENDING:
            order.state = CANCELLED
            order.reason = (ended.error or "")[:255] or None
            order.updated_at = datetime.now(UTC)
        self.counters.add("cancelled")

    def stats(self) -> dict[str, Any]:
        with self.sessions() as s:
            by_state = dict(
                s.execute(select(Order.state, func.count()).group_by(Order.state)).all()
            )
        return {"orders": by_state, **self.counters.snapshot()}

    # -- HTTP ------------------------------------------------------------------------------

    def _post_order(self, req: Request) -> tuple[int, Any]:
        body = req.body
        if not isinstance(body, dict):
            raise ValueError('expected {"product": "...", "quantity": N, "customer": "..."}')
        wait = req.param("wait")
        timeout = float(wait) if wait is not None else 0.0
        if not 0 <= timeout <= MAX_WAIT:
            raise ValueError(f"wait must be between 0 and {MAX_WAIT} seconds")
        placed = self.place(
            body.get("product"),  # type: ignore[arg-type]
            body.get("quantity"),  # type: ignore[arg-type]
            body.get("customer"),  # type: ignore[arg-type]
            body.get("id"),
        )
        if timeout:
            placed = self.wait_for_saga(placed, timeout)
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
        order_id = req.path["id"]
        with self.sessions() as s:
            order = s.get(Order, order_id)
            if order is None:
                raise LookupError(f"no order {order_id}")
            info = saga_info(s.connection(), order_id)
            saga = None
            if info is not None:
                saga = {
                    "state": info.state,
                    "error": info.error,
                    "steps": [
                        {"branch": e.branch, "op": e.op, "event": e.event, "detail": e.detail}
                        for e in info.steps
                    ],
                }
            checked = self.checker.checked.get(order_id, 0)
            return 200, {**order.as_dict(), "saga": saga, "checked_back": checked}
