"""examples/orders end to end: three services (order, inventory, payment) whose orders are
sagas (reserve the stock, charge, confirm; compensated in reverse on a refusal, a failure or
a deadline), on PostgreSQL and SQLite; on a local cluster of a name server with the
failover controller and two broker sets — broker-a a master and a slave, broker-b one
broker — and on one broker alone.  A load of orders while, in turn: the order service is
SIGKILLed starting a saga (before and after its database commit) and between two steps; a
broker set is SIGKILLed and restarted while orders flow; in the cluster broker-a's master is
SIGKILLed and the controller elects its slave; each participant is SIGKILLed inside its
action and inside its compensation; the payment service is paused past a charge's
deadline; commands are delivered twice; a compensation is delivered before its action; a
poison command arrives.  After a bounded wait the books balance every time: money and
stock, every saga COMPLETED or COMPENSATED, no effect applied twice.
Also: the checker finds each kind of inconsistency seeded on purpose, a person can place and
look at orders through the front, and the README's demo command exits 0 with its summary in
every layout."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from examples.orders import db as dbs
from examples.orders.checker import check
from examples.orders.demo import ALL_FAULTS, Demo, DemoConfig, default_faults, run_demo
from examples.orders.inventory_service import InventoryService
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
from examples.orders.order_service import OrderService
from examples.orders.payment_service import PaymentService
from examples.orders.web import request
from tests.conftest import ROOT, running_async
from tests.sqla_support import pg_schema
from txmq.broker.server import EmbeddedBroker
from txmq.saga import State
from txmq.sqla.tables import sagas

pytestmark = pytest.mark.slow

#: a demo run's budget: ~90 s alone (thirteen faults, each waiting for the sagas before it
#: to end), two to three times that beside the suite's other workers
DEMO_BUDGET_S = 450
SMALL_STOCK = {"apple": 25, "fig": 25, "kiwi": 25, "pear": 25, "plum": 25, "gift": 100}


@contextlib.contextmanager
def databases(backend: str, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """The three services' databases: SQLite files, or fresh PostgreSQL schemas."""
    if backend == "sqlite":
        yield tuple(f"sqlite:///{tmp_path / f'{s}.db'}" for s in ("o", "i", "p"))  # type: ignore[misc]
    else:
        with pg_schema() as orders_db, pg_schema() as inventory_db, pg_schema() as payment_db:
            yield orders_db, inventory_db, payment_db


@pytest.mark.timeout(DEMO_BUDGET_S)
@pytest.mark.parametrize(
    ("backend", "layout"),
    # SQLite on a cluster and a secured cluster: the README's command, below
    [("postgresql", "cluster"), ("sqlite", "single")],
)
def test_every_fault_in_turn_and_the_books_balance(
    backend: str, layout: str, tmp_path: Path
) -> None:
    with databases(backend, tmp_path) as (orders_db, inventory_db, payment_db):
        config = DemoConfig(
            orders=140,
            orders_db=orders_db,
            inventory_db=inventory_db,
            payment_db=payment_db,
            stock=dict(SMALL_STOCK),  # ~280 units asked for, 125 there: many cancelled
            duplicates=10,
            single_broker=layout == "single",
        )
        result = run_demo(config)
    failed = [(f.name, f.detail) for f in result.faults if not f.verified]
    assert result.settled, result.report.problems
    assert result.report.ok, result.report.problems
    expected = default_faults(layout == "single")
    assert [f.name for f in result.faults] == list(expected) and not failed, failed
    orders, report = result.report.orders, result.report
    assert orders[PENDING] == 0 and orders[CONFIRMED] > 0 and orders[CANCELLED] > 0
    assert set(report.sagas) == {State.COMPLETED, State.COMPENSATED}
    assert report.sagas[State.COMPLETED] == orders[CONFIRMED]
    # every accepted order exists, plus the one committed by the order service that was
    # killed before it could answer; the one killed before its commit does not
    assert sum(orders.values()) == result.accepted + 1
    assert sum(st["initial"] for st in report.stock) == 225
    # compensations ran: stock released (declined cards) and charges refunded (refused by
    # the order review)
    assert report.reservations["RELEASED"] > 0 and report.charges["REFUNDED"] > 0
    duplicates = next(f for f in result.faults if f.name == "duplicates")
    assert duplicates.data["sent"] >= 10, duplicates.data  # a reserve (and a charge) each
    assert result.dead_lettered == ["poison-1"]
    broker_fault = next(f for f in result.faults if f.name == "broker-restart")
    if layout == "single":
        assert result.layout.startswith("one broker on ")
        # the two killed requests, three while the broker was down
        assert result.refused == 2 + 3
        assert result.by_broker == {"broker-a": result.accepted}
        return
    assert "master-failover" in expected and set(expected) == set(ALL_FAULTS)
    assert result.layout.startswith("a cluster: name server 127.0.0.1:")
    assert "broker-a replicated (broker-a-0 127.0.0.1:" in result.layout
    failover = next(f for f in result.faults if f.name == "master-failover")
    # the two killed requests, those whose send failed on broker-b as it died, and those
    # refused while broker-a failed over (its new master alone could not copy them)
    assert result.refused == 2 + broker_fault.data["refused"] + failover.data["refused"]
    moved = broker_fault.data["down_accepted"]
    assert set(moved) == {"broker-a"} and moved["broker-a"] > 0, broker_fault.detail
    d = failover.data
    assert d["master_id"] != d["victim_id"] and d["epoch"] > d["epoch_before"], d
    assert d["after_accepted"]["broker-a"] > 0 and d["failover_s"] > d["elected_s"] > 0, d
    assert set(result.by_broker) == {"broker-a", "broker-b"}, result.by_broker
    assert min(result.by_broker.values()) > 0 and sum(result.by_broker.values()) == result.accepted


def _order(oid: str, product: str, quantity: int, state: str) -> Order:
    return Order(
        id=oid, product=product, quantity=quantity, customer="ann", amount=3 * quantity, state=state
    )


def _saga(oid: str, state: str) -> dict[str, object]:
    return {
        "saga_id": oid,
        "name": "place-order",
        "definition": {},
        "coordinator": "orders",
        "state": state,
        "step": 0,
        "op": "action",
        "data": {},
        "effected": [],
    }


def _seed_inconsistent(orders_db: str, inventory_db: str, payment_db: str) -> None:
    o, i, p = dbs.connect(orders_db), dbs.connect(inventory_db), dbs.connect(payment_db)
    try:
        with Session(o) as s, s.begin():
            s.add_all(
                [
                    _order("a" * 32, "apple", 2, CONFIRMED),
                    _order("b" * 32, "apple", 1, PENDING),
                    _order("c" * 32, "pear", 1, CONFIRMED),
                    _order("d" * 32, "pear", 3, CANCELLED),
                ]
            )
            s.execute(
                sagas.insert(),
                [
                    _saga("a" * 32, State.COMPLETED),
                    _saga("b" * 32, State.RUNNING),
                    _saga("c" * 32, State.COMPLETED),
                    # d's saga completed, but the order says cancelled
                    _saga("d" * 32, State.COMPLETED),
                ],
            )
        with Session(p) as s, s.begin():
            s.add_all(
                [
                    # ann: 6 charged for a, but her balance paid twice
                    Account(customer="ann", initial=100, balance=88),
                    Charge(order_id="a" * 32, customer="ann", amount=6, state=CHARGED),
                    Charge(order_id="c" * 32, customer="ann", amount=3, state=CHARGED),
                ]
            )
        with Session(i) as s, s.begin():
            s.add_all(
                [
                    # apple: reserved once for order a, but stock taken twice
                    Stock(product="apple", initial=10, available=6, reserved=4),
                    # pear: fine sums, but order c has no reservation, d's stock is held,
                    # and e was reserved for an order that does not exist
                    Stock(product="pear", initial=10, available=6, reserved=4),
                    Reservation(order_id="a" * 32, product="apple", quantity=2, state=RESERVED),
                    Reservation(order_id="d" * 32, product="pear", quantity=3, state=RESERVED),
                    Reservation(order_id="e" * 32, product="pear", quantity=1, state=RESERVED),
                ]
            )
    finally:
        o.dispose()
        i.dispose()
        p.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_checker_finds_exactly_the_inconsistencies_seeded(backend: str, tmp_path: Path) -> None:
    with databases(backend, tmp_path) as (orders_db, inventory_db, payment_db):
        for service, url in (
            ("orders", orders_db),
            ("inventory", inventory_db),
            ("payment", payment_db),
        ):
            dbs.upgrade(service, url)
        healthy = check(orders_db, inventory_db, payment_db)
        assert healthy.ok and healthy.problems == []  # empty books balance
        _seed_inconsistent(orders_db, inventory_db, payment_db)
        report = check(orders_db, inventory_db, payment_db)
    assert not report.ok
    b, c, d, e = (x * 32 for x in "bcde")
    assert report.problems == [
        f"1 order(s) still PENDING: {b}",
        f"1 saga(s) still RUNNING: {b}",
        "apple: reserved 4 but its reservations hold 2 (stock taken twice, or given back wrongly)",
        "ann: balance 88 + charged 9 != initial 100 (money taken twice, or given back wrongly)",
        f"1 order(s) CONFIRMED without its stock reserved and its charge: {c}",
        f"1 order(s) whose state disagrees with its saga's: {d}",
        f"1 order(s) CANCELLED but stock or money still held: {d}",
        f"1 order(s) reserved or charged for orders that do not exist (phantom commands): {e}",
    ]
    assert report.orders == {CONFIRMED: 2, PENDING: 1, CANCELLED: 1}
    assert report.reservations == {RESERVED: 3}
    assert report.sagas == {State.COMPLETED: 3, State.RUNNING: 1}


def front(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "examples.orders", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_a_person_places_and_looks_at_orders_through_the_front(
    tmp_path: Path, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker()
    orders_db, inventory_db, payment_db = (f"sqlite:///{tmp_path / f'{s}.db'}" for s in "oip")
    r = front("seed", "--db", inventory_db, "apple=3")
    assert r.returncode == 0, r.stderr
    r = front("seed-accounts", "--db", payment_db, "ann=100", "eve=0")
    assert r.returncode == 0 and "accounts: {'ann': 100, 'eve': 0}" in r.stdout, r
    r = front("seed-accounts", "--db", payment_db, "ann")
    assert r.returncode != 0 and "expected CUSTOMER=NUMBER, got 'ann'" in r.stderr, r
    dbs.upgrade("orders", orders_db)
    inventory = InventoryService(inventory_db, b.address)
    with (
        running_async(inventory),
        PaymentService(payment_db, b.address) as payment,
        OrderService(orders_db, b.address) as orders,
    ):
        assert orders.server is not None and payment.server is not None
        url = orders.server.url

        def place(*args: str) -> subprocess.CompletedProcess[str]:
            return front("place", "--url", url, "--product", "apple", *args)

        r = place("--quantity", "2", "--customer", "ann", "--wait", "20")
        assert r.returncode == 0 and '"state": "CONFIRMED"' in r.stdout, r
        assert '"amount": 6' in r.stdout, r.stdout  # 2 apples at 3
        # out of stock: refused at the first step, nothing to undo
        r = place("--quantity", "2", "--customer", "ann", "--wait", "20")
        assert '"state": "CANCELLED"' in r.stdout and "insufficient stock" in r.stdout, r
        # reserved, then the card is declined: the stock is released
        r = place("--quantity", "1", "--customer", "eve", "--wait", "20")
        assert '"state": "CANCELLED"' in r.stdout and "card declined" in r.stdout, r
        declined = json.loads(r.stdout)["id"]
        r = place("--quantity", "0", "--customer", "ann")
        assert r.returncode == 1 and "quantity must be between 1" in r.stdout, r
        r = front("orders", "--url", url, "--state", "cancelled")
        assert r.returncode == 0 and r.stdout.count('"state": "CANCELLED"') == 2, r.stdout
        r = front("orders", "--url", url)
        assert r.stdout.count('"state": "CONFIRMED"') == 1, r.stdout
        r = front("orders", "--url", url, "--state", "lost")
        assert r.returncode == 1 and "state must be PENDING" in r.stdout, r
        status, one = request(url, "GET", f"/orders/{declined}")
        assert status == 200 and one["saga"]["state"] == "COMPENSATED", one
        assert [(st["branch"], st["op"], st["event"]) for st in one["saga"]["steps"]] == [
            ("reserve-stock", "action", "sent"),
            ("reserve-stock", "action", "done"),
            ("charge", "action", "sent"),
            ("charge", "action", "refused"),
            ("reserve-stock", "compensation", "sent"),
            ("reserve-stock", "compensation", "done"),
        ]
        # a client's own id: a retried request cannot place the order twice
        again = {"product": "apple", "quantity": 1, "customer": "ann", "id": declined}
        assert request(url, "POST", "/orders", again) == (
            400,
            {"error": f"order {declined} exists already"},
        )
        for order, said in (
            ({"product": "apple", "quantity": 1}, "customer must be a name"),
            ({"product": "apple", "quantity": 1, "customer": ""}, "customer must be a name"),
            ({"product": "apple", "quantity": "2", "customer": "ann"}, "quantity must be a whole"),
            ({"product": "apple", "quantity": 1, "customer": "ann", "id": "X1"}, "id must be 32"),
            ({"product": "apple", "quantity": 1, "customer": "ann", "id": 7}, "id must be 32"),
        ):
            status, answer = request(url, "POST", "/orders", order)
            assert status == 400 and said in answer["error"], (order, answer)
        bad = urllib.request.Request(url + "/orders", data=b"{nope", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(bad, timeout=10)
        assert info.value.code == 400 and b"not JSON" in info.value.read()
        info.value.close()
        assert request(url, "GET", "/orders/" + "f" * 32) == (
            404,
            {"error": f"no order {'f' * 32}"},
        )
        assert request(url, "GET", "/nowhere")[0] == 404
        assert request(url, "POST", "/faults", {"crash": "sideways"})[0] == 400
        assert inventory.server is not None
        r = front("stock", "--url", inventory.server.url)
        assert r.returncode == 0, r
        assert '"available": 1' in r.stdout and '"reserved": 2' in r.stdout, r.stdout
        r = front("accounts", "--url", payment.server.url)
        assert '"balance": 94' in r.stdout, r.stdout
        # the same id placed twice at once: one order, the other request refused (a
        # product the inventory does not stock: the saga ends at its first step)
        twice = {"product": "quince", "quantity": 1, "customer": "ann", "id": "9" * 32}

        def place_twice(_: int) -> tuple[int, Any]:
            return request(url, "POST", "/orders?wait=20", twice)

        with ThreadPoolExecutor(2) as pool:
            answers = sorted(pool.map(place_twice, range(2)), key=lambda a: a[0])
        assert [status for status, _ in answers] == [201, 400], answers
        assert answers[0][1]["state"] == "CANCELLED", answers
        assert answers[1][1] == {"error": f"order {'9' * 32} exists already"}
    # a bad deadline: one line, before anything starts
    for deadline in ("0", "-5", "soon", "inf"):
        r = front(
            "order-service", "--db", orders_db, "--broker", b.address, "--charge-deadline", deadline
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r
        assert "number of seconds" in r.stderr.splitlines()[-1], r.stderr
    r = front("check", "--orders-db", orders_db, "--inventory-db", inventory_db)
    assert r.returncode == 2 and "--payment-db" in r.stderr, r
    r = front(
        "check",
        "--orders-db",
        orders_db,
        "--inventory-db",
        inventory_db,
        "--payment-db",
        payment_db,
    )
    assert r.returncode == 0 and "BALANCED" in r.stdout, r


@pytest.mark.timeout(DEMO_BUDGET_S)
@pytest.mark.parametrize("layout", ["cluster", "secure"])  # one broker: the test above
def test_the_readme_demo_command_exits_0_with_the_summary(layout: str) -> None:
    """``secure``: the cluster with access control (a user per service) and mutual TLS on
    every port, and no request of the demo refused by them."""
    args = {"cluster": [], "single": ["--single-broker"], "secure": ["--secure"]}[layout]
    command = ["bash", "scripts/demo.sh", *args]
    try:
        r = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, timeout=DEMO_BUDGET_S - 20
        )
    except subprocess.TimeoutExpired as exc:  # where it was, in its own words
        seen = exc.stdout or b""
        out = seen.decode(errors="replace") if isinstance(seen, bytes) else seen
        pytest.fail(f"the demo did not end in {exc.timeout} s; its output:\n{out}")
    out = r.stdout
    lines = out.splitlines()
    # a failed fault's two lines (what, then why) first: the end of a long output is the
    # books, which balance after most failures
    failed = [f"{a}\n{b}" for a, b in zip(lines, [*lines[1:], ""], strict=True) if "[FAILED]" in a]
    assert r.returncode == 0, "\n".join(failed) + "\n...\n" + out[-3000:] + r.stderr[-3000:]
    assert "== txmq orders demo ==" in out
    assert "books:     BALANCED" in out and "result:    OK" in out
    assert out.count("  [ok] ") == len(default_faults(layout == "single")), out
    # it says what it does: 300 orders of load, announced so, and the faults' own orders
    # counted apart (issue 31, item 11: it announced 300 and counted some 470)
    assert "300 orders of load and" in out, out[:2000]
    said = re.search(
        r"^load:\s+(\d+) orders by \d+ clients, and (\d+) more placed by the faults: "
        r"(\d+) of the (\d+) accepted",
        out,
        re.M,
    )
    assert said is not None, out
    load, by_faults, _, requested = (int(g) for g in said.groups())
    assert load == 300 and requested == load + by_faults > load, said.group(0)
    assert "[FAILED]" not in out
    if layout == "secure":
        assert "ACL on every port" in out
        assert "users demo-operator, inventory-service, order-service, payment-service" in out
        assert "mutual TLS (CA " in out
        assert "access control: 0 requests refused by the servers" in out, out
    if layout != "single":
        assert "layout:    a cluster: name server 127.0.0.1:" in out, out
        assert re.search(r"carried: .* broker-a [1-9]\d*, broker-b [1-9]\d*$", out, re.M), out
        assert "[ok] broker-b SIGKILLed while orders flow" in out
        assert "[ok] broker-a's master SIGKILLed while orders flow" in out
        assert re.search(r"elected in \d+\.\d s: epoch \d+; .* failover time \d+\.\d s", out)
    else:
        assert "layout:    one broker on 127.0.0.1:" in out, out
        assert re.search(r"carried: .* broker-a [1-9]\d*$", out, re.M), out
        assert "[ok] broker SIGKILLed, orders placed while it is down" in out


def test_master_failover_needs_a_cluster() -> None:
    """Not chosen by default on one broker alone; asked for there, refused in one line."""
    assert "master-failover" not in default_faults(True)
    assert default_faults(False) == ALL_FAULTS
    config = DemoConfig(single_broker=True, faults=("master-failover",))
    with pytest.raises(ValueError, match="master-failover needs a cluster"):
        run_demo(config)


def test_a_port_taken_between_its_pick_and_the_start_is_picked_again(tmp_path: Path) -> None:
    """The demo picks its ports before its processes bind them; another program (a demo run
    beside it) may bind one meanwhile: the broker ends at once and the demo starts it on
    another pair of ports instead of failing."""
    demo = Demo(DemoConfig(single_broker=True), tmp_path, lambda line: None)
    node = next(iter(demo.brokers.values()))
    picked = node.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picked))
        squatter.listen()
        try:
            demo.start_brokers()
            assert node.port != picked and node.alive
            assert "already in use" in (tmp_path / "broker.log").read_text()
            assert demo.broker_address == f"127.0.0.1:{node.port}"
        finally:
            demo.close()
