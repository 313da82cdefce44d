"""The books of the orders example: do the three databases agree?

- every saga ended (COMPLETED or COMPENSATED: none running, compensating or parked for an
  operator) and every order is CONFIRMED or CANCELLED, as its saga says (COMPLETED
  confirmed it, COMPENSATED cancelled it);
- stock: available + reserved = initial for every product, and reserved = the sum of its
  RESERVED reservations (stock taken twice, or given back twice, shows here);
- money: balance + the CHARGED charges of a customer = the initial balance (a charge taken
  twice, or refunded twice, shows here);
- every CONFIRMED order holds a RESERVED reservation and a CHARGED charge of its product,
  quantity, customer and amount; a CANCELLED one holds neither (released, refunded, or
  never taken); no reservation or charge exists for an order the order service does not
  have (a rolled-back order's command must never have been delivered).
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
    CHARGED,
    CONFIRMED,
    PENDING,
    RESERVED,
    Account,
    Charge,
    Order,
    Reservation,
    Stock,
)
from txmq.saga import State
from txmq.sqla.tables import sagas

__all__ = ["Report", "check"]

EXAMPLES = 5  # ids shown per kind of problem
#: the order state each ended saga leaves
ORDER_OF = {State.COMPLETED: CONFIRMED, State.COMPENSATED: CANCELLED}


@dataclass
class Report:
    orders: Counter[str] = field(default_factory=Counter)
    """Orders by state."""
    sagas: Counter[str] = field(default_factory=Counter)
    """Sagas by state."""
    stock: list[dict[str, Any]] = field(default_factory=list)
    """Per product: initial, available, reserved."""
    accounts: list[dict[str, Any]] = field(default_factory=list)
    """Per customer: initial, balance, charged (held by CHARGED charges)."""
    reservations: Counter[str] = field(default_factory=Counter)
    charges: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def pending(self) -> int:
        """Orders not yet settled, and sagas not yet ended."""
        running = sum(n for state, n in self.sagas.items() if state not in State.ENDED)
        return max(self.orders.get(PENDING, 0), running)


def _some(ids: list[str]) -> str:
    shown = ", ".join(sorted(ids)[:EXAMPLES])
    return shown + (f", … ({len(ids)} in all)" if len(ids) > EXAMPLES else "")


def check(orders_db: str | URL, inventory_db: str | URL, payment_db: str | URL) -> Report:
    """Read the three databases and compare them."""
    report = Report()
    engines = [connect(orders_db), connect(inventory_db), connect(payment_db)]
    try:
        with Session(engines[0]) as s:
            orders = {o.id: o for o in s.scalars(select(Order))}
            saga_states = {i: st for i, st in s.execute(select(sagas.c.saga_id, sagas.c.state))}
        with Session(engines[1]) as s:
            stock = list(s.scalars(select(Stock).order_by(Stock.product)))
            reservations = {r.order_id: r for r in s.scalars(select(Reservation))}
        with Session(engines[2]) as s:
            accounts = list(s.scalars(select(Account).order_by(Account.customer)))
            charges = {c.order_id: c for c in s.scalars(select(Charge))}
    finally:
        for engine in engines:
            engine.dispose()

    report.orders = Counter(o.state for o in orders.values())
    report.sagas = Counter(saga_states.values())
    report.reservations = Counter(r.state for r in reservations.values())
    report.charges = Counter(c.state for c in charges.values())
    problems = report.problems
    pending = [o.id for o in orders.values() if o.state == PENDING]
    if pending:
        problems.append(f"{len(pending)} order(s) still {PENDING}: {_some(pending)}")
    for state in sorted(set(report.sagas) - State.ENDED):
        stuck = [i for i, st in saga_states.items() if st == state]
        problems.append(f"{len(stuck)} saga(s) still {state}: {_some(stuck)}")
    _stock(report, stock, reservations)
    _money(report, accounts, charges)

    wrong: dict[str, list[str]] = {}
    for o in sorted(orders.values(), key=lambda o: o.id):
        r, c, saga = reservations.get(o.id), charges.get(o.id), saga_states.get(o.id)
        if o.customer is None:  # placed before the orders became sagas: no charge, no saga
            continue
        if saga is None:
            wrong.setdefault("without a saga", []).append(o.id)
        elif saga in ORDER_OF and o.state != ORDER_OF[saga]:
            wrong.setdefault("whose state disagrees with its saga's", []).append(o.id)
        held = r is not None and r.state == RESERVED
        paid = c is not None and c.state == CHARGED
        if o.state == CONFIRMED and not (held and paid):
            wrong.setdefault("CONFIRMED without its stock reserved and its charge", []).append(o.id)
        elif o.state == CANCELLED and (held or paid):
            wrong.setdefault("CANCELLED but stock or money still held", []).append(o.id)
        if r is not None and (r.product, r.quantity) != (o.product, o.quantity):
            wrong.setdefault("reserved a different product or quantity", []).append(o.id)
        if c is not None and (c.customer, c.amount) != (o.customer, o.amount):
            wrong.setdefault("charged a different customer or amount", []).append(o.id)
    phantoms = sorted({*reservations, *charges} - set(orders))
    if phantoms:
        wrong["reserved or charged for orders that do not exist (phantom commands)"] = phantoms
    for what, ids in wrong.items():
        problems.append(f"{len(ids)} order(s) {what}: {_some(ids)}")
    return report


def _stock(report: Report, stock: list[Stock], reservations: dict[str, Reservation]) -> None:
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
            report.problems.append(
                f"{st.product}: available {st.available} + reserved {st.reserved} "
                f"!= initial {st.initial}"
            )
        if st.reserved != held[st.product]:
            report.problems.append(
                f"{st.product}: reserved {st.reserved} but its reservations hold "
                f"{held[st.product]} (stock taken twice, or given back wrongly)"
            )


def _money(report: Report, accounts: list[Account], charges: dict[str, Charge]) -> None:
    charged: Counter[str] = Counter()
    for c in charges.values():
        if c.state == CHARGED:
            charged[c.customer] += c.amount
    for a in accounts:
        report.accounts.append(
            {
                "customer": a.customer,
                "initial": a.initial,
                "balance": a.balance,
                "charged": charged[a.customer],
            }
        )
        if a.balance + charged[a.customer] != a.initial:
            report.problems.append(
                f"{a.customer}: balance {a.balance} + charged {charged[a.customer]} "
                f"!= initial {a.initial} (money taken twice, or given back wrongly)"
            )
    unknown = sorted(set(charged) - {a.customer for a in accounts})
    if unknown:
        report.problems.append(f"charges of customers without an account: {', '.join(unknown)}")
