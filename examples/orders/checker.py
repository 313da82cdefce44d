"""The books of the orders example: do the two databases agree?

- every order is CONFIRMED or CANCELLED (none left PENDING);
- every product: available + reserved = initial stock;
- every product: reserved = the sum of its RESERVED reservations (an effect applied twice
  would show here: one reservation row, stock taken twice);
- every CONFIRMED order has a RESERVED reservation of its product and quantity, every
  CANCELLED one a REJECTED reservation, and no reservation exists for an order the order
  service does not have (a rolled-back order's message must never have been delivered).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from examples.orders.db import connect
from examples.orders.models import (
    CANCELLED,
    CONFIRMED,
    PENDING,
    REJECTED,
    RESERVED,
    Order,
    Reservation,
    Stock,
)

__all__ = ["Report", "check"]

EXAMPLES = 5  # ids shown per kind of problem


@dataclass
class Report:
    orders: Counter[str] = field(default_factory=Counter)
    """Orders by state."""
    stock: list[dict[str, Any]] = field(default_factory=list)
    """Per product: initial, available, reserved."""
    reservations: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def pending(self) -> int:
        return self.orders.get(PENDING, 0)


def _some(ids: list[str]) -> str:
    shown = ", ".join(sorted(ids)[:EXAMPLES])
    return shown + (f", … ({len(ids)} in all)" if len(ids) > EXAMPLES else "")


def check(orders_db: str | URL, inventory_db: str | URL) -> Report:
    """Read both databases and compare them."""
    report = Report()
    o_engine, i_engine = connect(orders_db), connect(inventory_db)
    try:
        with Session(o_engine) as s:
            orders = {o.id: o for o in s.scalars(select(Order))}
        with Session(i_engine) as s:
            stock = list(s.scalars(select(Stock).order_by(Stock.product)))
            reservations = {r.order_id: r for r in s.scalars(select(Reservation))}
    finally:
        o_engine.dispose()
        i_engine.dispose()

    report.orders = Counter(o.state for o in orders.values())
    report.reservations = Counter(r.state for r in reservations.values())
    problems = report.problems
    pending = [o.id for o in orders.values() if o.state == PENDING]
    if pending:
        problems.append(f"{len(pending)} order(s) still {PENDING}: {_some(pending)}")

    held: Counter[str] = Counter()
    for res in reservations.values():
        if res.state == RESERVED:
            held[res.product] += res.quantity
    for st in stock:
        report.stock.append(
            {
                "product": st.product,
                "initial": st.initial,
                "available": st.available,
                "reserved": st.reserved,
            }
        )
        if st.available + st.reserved != st.initial:
            problems.append(
                f"{st.product}: available {st.available} + reserved {st.reserved} "
                f"!= initial {st.initial}"
            )
        if st.reserved != held[st.product]:
            problems.append(
                f"{st.product}: reserved {st.reserved} but its reservations hold "
                f"{held[st.product]} (stock taken twice, or given back wrongly)"
            )

    wrong: dict[str, list[str]] = {}
    for o in orders.values():
        r = reservations.get(o.id)
        if o.state == CONFIRMED and (r is None or r.state != RESERVED):
            wrong.setdefault("CONFIRMED without a reservation", []).append(o.id)
        elif o.state == CANCELLED and (r is None or r.state != REJECTED):
            wrong.setdefault("CANCELLED but its stock is held or it was never seen", []).append(
                o.id
            )
        if r is not None and (r.product, r.quantity) != (o.product, o.quantity):
            wrong.setdefault("reserved a different product or quantity", []).append(o.id)
    phantoms = [oid for oid in reservations if oid not in orders]
    if phantoms:
        wrong["reservations for orders that do not exist (phantom messages)"] = phantoms
    for what, ids in wrong.items():
        problems.append(f"{len(ids)} order(s) {what}: {_some(ids)}")
    return report
