"""The two services' own tables (each in its own database) and their message bodies."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Integer, MetaData, String, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "CANCELLED",
    "CONFIRMED",
    "ORDER_CREATED",
    "PENDING",
    "REJECTED",
    "RESERVED",
    "STOCK_REPLIES",
    "InventoryBase",
    "Order",
    "OrderBase",
    "OrderCreated",
    "Reservation",
    "Stock",
    "StockReply",
]

PENDING, CONFIRMED, CANCELLED = "PENDING", "CONFIRMED", "CANCELLED"
RESERVED, REJECTED = "RESERVED", "REJECTED"

ORDER_CREATED = "order-created"
"""Topic of ``OrderCreated`` (tag ``OrderCreated``), key ``order-<id>-created``."""
STOCK_REPLIES = "stock-replies"
"""Topic of the inventory's replies (tags ``StockReserved`` / ``StockRejected``)."""


class OrderBase(DeclarativeBase):
    metadata = MetaData()


class InventoryBase(DeclarativeBase):
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "product": self.product,
            "quantity": self.quantity,
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
    """What the inventory decided for one order: one row per order, ever."""

    __tablename__ = "reservations"
    __table_args__ = (
        CheckConstraint(f"state IN ('{RESERVED}', '{REJECTED}')", name="ck_reservations_state"),
    )

    order_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    product: Mapped[str] = mapped_column(String(64))
    quantity: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(255), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


@dataclass(frozen=True)
class OrderCreated:
    order_id: str
    product: str
    quantity: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, body: bytes) -> OrderCreated:
        """Raises ValueError (or KeyError / TypeError) on a malformed body."""
        data = json.loads(body)
        event = cls(str(data["order_id"]), str(data["product"]), int(data["quantity"]))
        if event.quantity <= 0:
            raise ValueError(f"quantity must be positive, not {event.quantity}")
        return event


@dataclass(frozen=True)
class StockReply:
    order_id: str
    reserved: bool
    reason: str | None = None

    @property
    def tag(self) -> str:
        return "StockReserved" if self.reserved else "StockRejected"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, body: bytes) -> StockReply:
        data = json.loads(body)
        return cls(str(data["order_id"]), bool(data["reserved"]), data.get("reason"))
