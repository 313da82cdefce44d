"""The payment service, in blocking code (``Session``, ``txmq.sync``): a participant of the
``place-order`` saga.

- ``charge`` takes the order's amount from the customer's account with one conditional
  ``UPDATE ... WHERE balance >= amount`` and records a CHARGED charge; with too little
  money, or no account, the card is declined (``Refuse``: the saga releases the stock).
- ``refund`` (its compensation) gives the money back and marks the charge REFUNDED.

Both run behind the saga barrier, each in one local transaction with its answer to the
coordinator (see :mod:`examples.orders.inventory_service`).  The saga gives up on a charge
that has not answered by its deadline and compensates it too: the refund then either finds
the charge (and undoes it) or comes first (a null compensation: the late charge, when it
arrives, does nothing).

HTTP: ``GET /accounts``, ``GET /stats``, ``POST /faults {"crash": "in-charge" |
"in-refund"}``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Self

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

import txmq.sync
from examples.orders.counters import Counters
from examples.orders.db import connect
from examples.orders.faults import Faults
from examples.orders.models import CHARGED, REFUNDED, Account, Charge, OrderData
from examples.orders.web import JsonServer
from txmq.saga import Participant, Refuse
from txmq.sqla import SqlTransactionChecker

__all__ = ["GROUP", "SERVICE", "PaymentService"]

log = logging.getLogger("examples.orders.payment_service")

SERVICE = "payment"
GROUP = f"saga-{SERVICE}"


class PaymentService:
    """``broker``: one broker's ``HOST:PORT``; or ``namesrv``: a cluster's name servers."""

    def __init__(
        self,
        db: str,
        broker: str | None = None,
        *,
        namesrv: str | None = None,
        instance: str = "payment-1",
        route_ttl: float = 30.0,
        heartbeat_interval: float = 30.0,
    ) -> None:
        self.engine = connect(db)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.faults = Faults(("in-charge", "in-refund"))
        self.counters = Counters()
        self.producer = txmq.sync.TransactionProducer(
            broker,
            f"{SERVICE}-tx",
            namesrv=namesrv,
            listener=SqlTransactionChecker(self.engine),
            sharding="available",  # (as the inventory's)
            route_ttl=route_ttl,
            heartbeat_interval=heartbeat_interval,
        )
        self.participant = Participant(SERVICE, self.producer, self.sessions)
        self.participant.action("charge")(self._charge)
        self.participant.compensation("refund")(self._refund)
        self.consumer = txmq.sync.PushConsumer(
            broker,
            namesrv=namesrv,
            instance_name=instance,
            route_ttl=route_ttl,
            **self.participant.consumer_options(),
        )
        self.consumer.subscribe(self.participant.topic)
        self.server: JsonServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, port: int = 0) -> Self:
        self.producer.start()
        try:
            self.consumer.start()
        except BaseException:
            self.producer.stop()
            raise
        self.server = JsonServer(
            {
                ("GET", "/accounts"): lambda req: (200, self.accounts()),
                ("GET", "/stats"): lambda req: (200, self.stats()),
                ("POST", "/faults"): self.faults.route,
            },
            port=port,
        ).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        try:
            self.consumer.stop()
        finally:
            self.producer.stop()
            self.engine.dispose()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the saga's steps ------------------------------------------------------------------

    def _charge(self, data: dict[str, Any], session: Session) -> dict[str, Any]:
        order = OrderData.of(data)
        taken = session.execute(
            update(Account)
            .where(Account.customer == order.customer, Account.balance >= order.amount)
            .values(balance=Account.balance - order.amount)
        )
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            self.counters.add("declined")
            if session.get(Account, order.customer) is None:
                raise Refuse(f"no account for customer {order.customer!r}")
            raise Refuse("card declined: insufficient funds")
        session.add(
            Charge(
                order_id=order.order, customer=order.customer, amount=order.amount, state=CHARGED
            )
        )
        session.flush()
        self.faults.reached("in-charge", order.order)  # written, not committed
        self.counters.add("charged")
        return {"charged": order.amount}

    def _refund(self, data: dict[str, Any], session: Session) -> None:
        order = OrderData.of(data)
        charge = session.get(Charge, order.order, with_for_update=True)
        if charge is None or charge.state != CHARGED:  # the barrier lets one refund through
            raise LookupError(f"order {order.order}: no charge to refund")
        session.execute(
            update(Account)
            .where(Account.customer == charge.customer)
            .values(balance=Account.balance + charge.amount)
        )
        charge.state = REFUNDED
        charge.updated_at = datetime.now(UTC)
        session.flush()
        self.faults.reached("in-refund", order.order)
        self.counters.add("refunded")

    # -- reading ---------------------------------------------------------------------------

    def accounts(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return [
                {"customer": a.customer, "initial": a.initial, "balance": a.balance}
                for a in s.scalars(select(Account).order_by(Account.customer))
            ]

    def stats(self) -> dict[str, Any]:
        with self.sessions() as s:
            q = select(Charge.state, func.count()).group_by(Charge.state)
            by_state = {state: n for state, n in s.execute(q)}
        return {"charges": by_state, **self.counters.snapshot()}
