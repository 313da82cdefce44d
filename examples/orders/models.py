"""The three services' own tables (each in its own database), the saga that ties them
together, and the demo's catalogue (prices) and customers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Integer, MetaData, String, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from txmq.saga import Saga, Step

__all__ = [
    "BLOCKED",
    "BROKE",
    "CANCELLED",
    "CHARGED",
    "CONFIRMED",
    "DEFAULT_CHARGE_DEADLINE_S",
    "FAULT_CUSTOMER",
    "FAULT_PRODUCT",
    "PENDING",
    "PLACE_ORDER",
    "PRICES",
    "REFUNDED",
    "RELEASED",
    "RESERVED",
    "Account",
    "Charge",
    "InventoryBase",
    "Order",
    "OrderBase",
    "OrderData",
    "PaymentBase",
    "Reservation",
    "Stock",
    "place_order",
    "price_of",
]

PENDING, CONFIRMED, CANCELLED = "PENDING", "CONFIRMED", "CANCELLED"
RESERVED, RELEASED = "RESERVED", "RELEASED"
#: what reservations said before the orders became a saga (a refusal left a row then)
REJECTED = "REJECTED"
CHARGED, REFUNDED = "CHARGED", "REFUNDED"

#: price per unit; any other product costs DEFAULT_PRICE (the inventory refuses products it
#: does not stock)
PRICES = {"apple": 3, "fig": 5, "kiwi": 4, "pear": 3, "plum": 2}
DEFAULT_PRICE = 5
DEFAULT_CHARGE_DEADLINE_S = 30.0


#: the demo's faults take this product and bill this customer, neither of which its load
#: uses, so that their sagas go as far as each fault needs
FAULT_PRODUCT, FAULT_CUSTOMER = "gift", "zoe"
#: a customer the order review refuses (the order service's blocklist), and one who cannot
#: pay at all
BLOCKED, BROKE = "mallory", "eve"


def price_of(product: str, quantity: int) -> int:
    return PRICES.get(product, DEFAULT_PRICE) * quantity


def place_order(charge_deadline: float = DEFAULT_CHARGE_DEADLINE_S) -> Saga:
    """The saga of an order: reserve its stock (inventory), charge the customer (payment:
    given up on, and compensated, when the card network has not answered within
    ``charge_deadline`` seconds), confirm it (the order service's own review).  A refusal
    or failure at any step undoes the steps before it in reverse order: refund, release."""
    return Saga(
        "place-order",
        [
            Step("reserve-stock", "inventory", compensation="release-stock", retries=3),
            Step(
                "charge",
                "payment",
                compensation="refund",
                retries=3,
                timeout=charge_deadline,
            ),
            Step("confirm-order", "orders", retries=3),
        ],
    )


PLACE_ORDER = place_order()


class OrderBase(DeclarativeBase):
    metadata = MetaData()


class InventoryBase(DeclarativeBase):
    metadata = MetaData()


class PaymentBase(DeclarativeBase):
    metadata = MetaData()


class Order(OrderBase):
    __tablename__ = "orders"
    __table_args__ = (
        CheckConstraint("quantity > 0", name="ck_orders_quantity"),
        CheckConstraint(
            f"state IN ('{PENDING}', '{CONFIRMED}', '{CANCELLED}')", name="ck_orders_state"
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    product: Mapped[str] = mapped_column(String(64))
    quantity: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=PENDING)
    reason: Mapped[str | None] = mapped_column(String(255), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    #: who pays, and how much (price x quantity when placed); None: placed before the saga
    customer: Mapped[str | None] = mapped_column(String(64), default=None)
    amount: Mapped[int | None] = mapped_column(Integer, default=None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "product": self.product,
            "quantity": self.quantity,
            "customer": self.customer,
            "amount": self.amount,
            "state": self.state,
            "reason": self.reason,
        }


class Stock(InventoryBase):
    __tablename__ = "stock"
    __table_args__ = (
        CheckConstraint("available >= 0", name="ck_stock_available"),
        CheckConstraint("reserved >= 0", name="ck_stock_reserved"),
    )

    product: Mapped[str] = mapped_column(String(64), primary_key=True)
    initial: Mapped[int] = mapped_column(Integer)
    available: Mapped[int] = mapped_column(Integer)
    reserved: Mapped[int] = mapped_column(Integer, default=0)


class Reservation(InventoryBase):
    """The stock held for one order: one row per order, ever (RESERVED, then RELEASED if
    its saga compensates)."""

    __tablename__ = "reservations"
    __table_args__ = (
        CheckConstraint(
            f"state IN ('{RESERVED}', '{RELEASED}', '{REJECTED}')", name="ck_reservations_state"
        ),
    )

    order_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    product: Mapped[str] = mapped_column(String(64))
    quantity: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(255), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Account(PaymentBase):
    __tablename__ = "accounts"
    __table_args__ = (CheckConstraint("balance >= 0", name="ck_accounts_balance"),)

    customer: Mapped[str] = mapped_column(String(64), primary_key=True)
    initial: Mapped[int] = mapped_column(Integer)
    balance: Mapped[int] = mapped_column(Integer)


class Charge(PaymentBase):
    """The money taken for one order: one row per order, ever (CHARGED, then REFUNDED if
    its saga compensates)."""

    __tablename__ = "charges"
    __table_args__ = (
        CheckConstraint("amount > 0", name="ck_charges_amount"),
        CheckConstraint(f"state IN ('{CHARGED}', '{REFUNDED}')", name="ck_charges_state"),
    )

    order_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    customer: Mapped[str] = mapped_column(String(64))
    amount: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


@dataclass(frozen=True)
class OrderData:
    """A place-order saga's data, as every step receives it."""

    order: str
    product: str
    quantity: int
    customer: str
    amount: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, data: dict[str, Any]) -> OrderData:
        """Raises KeyError / ValueError / TypeError on malformed data."""
        d = cls(
            str(data["order"]),
            str(data["product"]),
            int(data["quantity"]),
            str(data["customer"]),
            int(data["amount"]),
        )
        if d.quantity <= 0 or d.amount <= 0:
            raise ValueError(f"quantity and amount must be positive: {data}")
        return d

    def encode(self) -> bytes:
        return json.dumps(self.as_dict()).encode()
