"""One service of the saga tests, in a process of its own (``python -m tests.saga_service``):
``shop`` coordinates (it starts a saga for each ``start NAME JSON`` line on stdin and
prints ``STARTED <saga id>``), ``inventory`` and ``payment`` take part.  Each has its own
database (``--db``), creates its tables if they are not there, and prints ``READY`` once
its consumer runs; SIGTERM stops it cleanly, SIGKILL as a crash.

What a handler does wrong is said by the saga's data (and by the ``switches`` table of the
service's database, which a test sets and clears): ``decline`` (the charge refuses),
``charge_fails`` (the first n charges of a saga raise), ``charge_sleep`` (the charge takes
that long), ``confirm_refused`` (the shop's own step refuses); switch ``bank-down`` (every
refund raises), ``acquirer-down`` (every capture raises).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import txmq.sync
from txmq.saga import Coordinator, Participant, Refuse, Saga, Step, tcc
from txmq.sqla import SqlTransactionChecker
from txmq.sqla import metadata as txmq_tables

app = sa.MetaData()
stock = sa.Table(
    "stock",
    app,
    sa.Column("product", sa.String(32), primary_key=True),
    sa.Column("available", sa.Integer, nullable=False),
    sa.Column("reserved", sa.Integer, nullable=False),
)
accounts = sa.Table(
    "accounts",
    app,
    sa.Column("customer", sa.String(32), primary_key=True),
    sa.Column("balance", sa.Integer, nullable=False),
    sa.Column("held", sa.Integer, nullable=False),
)
orders = sa.Table(
    "orders",
    app,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
)
switches = sa.Table("switches", app, sa.Column("name", sa.String(32), primary_key=True))

CHECKOUT = Saga(
    "checkout",
    [
        Step("reserve-stock", "inventory", compensation="release-stock"),
        Step(
            "charge",
            "payment",
            compensation="refund",
            retries=3,
            compensation_retries=1,
            timeout=20,
        ),
        Step("confirm-order", "shop"),
    ],
)
#: the same, with a charge given up on after a second
SLOW = Saga(
    "slow",
    [
        Step("reserve-stock", "inventory", compensation="release-stock"),
        Step("charge", "payment", compensation="refund", retries=5, timeout=1),
    ],
)
HOLD = tcc(
    "hold",
    [
        ("inventory", "hold-stock", "ship-stock", "unhold-stock"),
        ("payment", "hold-funds", "capture", "unhold-funds"),
    ],
    confirm_retries=1,
)
STOCK, BALANCE = 1000, 100_000

#: charges tried per saga in this process (charge_fails)
tries: dict[str, int] = {}


def switched(session: Session, name: str) -> bool:
    return session.execute(sa.select(switches).where(switches.c.name == name)).first() is not None


def move_stock(session: Session, product: str, available: int, reserved: int) -> None:
    session.execute(
        stock.update()
        .where(stock.c.product == product)
        .values(available=stock.c.available + available, reserved=stock.c.reserved + reserved)
    )


def move_money(session: Session, customer: str, balance: int, held: int) -> None:
    session.execute(
        accounts.update()
        .where(accounts.c.customer == customer)
        .values(balance=accounts.c.balance + balance, held=accounts.c.held + held)
    )


def inventory(p: Participant) -> None:
    @p.action("reserve-stock")
    def reserve(data: dict[str, Any], session: Session) -> None:
        move_stock(session, data["product"], -data["quantity"], data["quantity"])

    @p.compensation("release-stock")
    def release(data: dict[str, Any], session: Session) -> None:
        move_stock(session, data["product"], data["quantity"], -data["quantity"])

    @p.try_("hold-stock")
    def hold(data: dict[str, Any], session: Session) -> None:
        move_stock(session, data["product"], -data["quantity"], data["quantity"])

    @p.confirm("ship-stock")
    def ship(data: dict[str, Any], session: Session) -> None:
        move_stock(session, data["product"], 0, -data["quantity"])

    @p.cancel("unhold-stock")
    def unhold(data: dict[str, Any], session: Session) -> None:
        move_stock(session, data["product"], data["quantity"], -data["quantity"])


def payment(p: Participant) -> None:
    @p.action("charge")
    def charge(data: dict[str, Any], session: Session) -> None:
        if data.get("decline"):
            raise Refuse("card declined")
        key = data["order"]
        tries[key] = tries.get(key, 0) + 1
        if tries[key] <= data.get("charge_fails", 0):
            raise ConnectionError(f"the card network is down (try {tries[key]})")
        time.sleep(data.get("charge_sleep", 0))
        move_money(session, data["customer"], -data["amount"], 0)

    @p.compensation("refund")
    def refund(data: dict[str, Any], session: Session) -> None:
        if switched(session, "bank-down"):
            raise ConnectionError("the bank is down")
        move_money(session, data["customer"], data["amount"], 0)

    @p.try_("hold-funds")
    def hold(data: dict[str, Any], session: Session) -> None:
        if data.get("decline"):
            raise Refuse("insufficient funds")
        move_money(session, data["customer"], -data["amount"], data["amount"])

    @p.confirm("capture")
    def capture(data: dict[str, Any], session: Session) -> None:
        if switched(session, "acquirer-down"):
            raise ConnectionError("the acquirer is down")
        move_money(session, data["customer"], 0, -data["amount"])

    @p.cancel("unhold-funds")
    def unhold(data: dict[str, Any], session: Session) -> None:
        move_money(session, data["customer"], data["amount"], -data["amount"])


def shop(p: Participant) -> None:
    @p.action("confirm-order")
    def confirm(data: dict[str, Any], session: Session) -> None:
        if data.get("confirm_refused"):
            raise Refuse("the order was cancelled meanwhile")
        session.execute(
            orders.update().where(orders.c.id == data["order"]).values(state="CONFIRMED")
        )


def prepare(engine: sa.Engine, role: str) -> None:
    with engine.begin() as conn:
        txmq_tables.create_all(conn)
        app.create_all(conn)
        if role == "inventory" and conn.execute(sa.select(stock)).first() is None:
            conn.execute(
                stock.insert(),
                [{"product": p, "available": STOCK, "reserved": 0} for p in ("apple", "pear")],
            )
        if role == "payment" and conn.execute(sa.select(accounts)).first() is None:
            conn.execute(
                accounts.insert(),
                [{"customer": c, "balance": BALANCE, "held": 0} for c in ("ann", "bob")],
            )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("shop", "inventory", "payment"))
    ap.add_argument("--db", required=True)
    ap.add_argument("--namesrv", required=True)
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    engine = sa.create_engine(args.db, pool_size=10, max_overflow=10)
    prepare(engine, args.role)
    sessions = sessionmaker(engine, expire_on_commit=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    producer = txmq.sync.TransactionProducer(
        namesrv=args.namesrv,
        group=f"{args.role}-tx",
        listener=SqlTransactionChecker(engine),
        route_ttl=1.0,
    )
    with producer:
        part = Participant(args.role, producer, sessions)
        {"inventory": inventory, "payment": payment, "shop": shop}[args.role](part)
        runners: list[Any] = [part]
        coordinator = None
        if args.role == "shop":
            coordinator = Coordinator("shop", producer, sessions, [CHECKOUT, SLOW, HOLD])
            runners.append(coordinator)
        consumers = []
        for runner in runners:
            c = txmq.sync.PushConsumer(
                namesrv=args.namesrv, rebalance_interval=1.0, **runner.consumer_options()
            )
            c.subscribe(runner.topic)
            consumers.append(c.start())
        print("READY", flush=True)
        if coordinator is not None:
            threading.Thread(
                target=read_commands, args=(coordinator, sessions, stop), daemon=True
            ).start()
        stop.wait()
        for c in consumers:
            c.stop()
    engine.dispose()
    return 0


def read_commands(
    coordinator: Coordinator, sessions: sessionmaker[Session], stop: threading.Event
) -> None:
    """``start NAME JSON``: a saga NAME with that data (its order row committed with it)."""
    import json

    for line in sys.stdin:
        verb, _, rest = line.strip().partition(" ")
        if verb != "start":
            continue
        name, _, raw = rest.partition(" ")
        data = json.loads(raw)
        try:
            # the order's id is the saga's: a start sent again (after a crash) is refused
            with sessions() as session:
                with coordinator.start(session, name, data, saga_id=data["order"]) as saga:
                    if name != "hold":
                        session.execute(orders.insert().values(id=data["order"], state="PENDING"))
        except sa.exc.IntegrityError:
            print(f"EXISTS {data['order']}", flush=True)
            continue
        print(f"STARTED {data['order']} {saga.saga_id}", flush=True)
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
