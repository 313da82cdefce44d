"""examples/orders end to end (PostgreSQL and SQLite; on a local cluster of a name server
with the failover controller and two broker sets — broker-a a master and a slave, broker-b
one broker — and on one broker alone): a load of orders while, in turn, the order service is
SIGKILLed mid-transaction (before and after its database commit), a broker set is SIGKILLed
and restarted while orders flow (in the cluster they move to the other set), in the cluster
broker-a's master is SIGKILLed and the controller elects its slave (the killed node rejoins
as a slave), the inventory consumer is SIGKILLed inside its handler, deliveries are
duplicated and a poison message arrives; after a bounded wait the books balance every time.
Also: the checker finds each kind of inconsistency seeded on purpose, a person can place and
look at orders through the front, and the README's demo command exits 0 with its summary in
both layouts."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from examples.orders import db as dbs
from examples.orders.checker import check
from examples.orders.demo import ALL_FAULTS, Demo, DemoConfig, default_faults, run_demo
from examples.orders.inventory_service import InventoryService
from examples.orders.models import (
    CANCELLED,
    CONFIRMED,
    PENDING,
    RESERVED,
    Order,
    Reservation,
    Stock,
)
from examples.orders.order_service import OrderService
from examples.orders.web import request
from tests.conftest import ROOT, running_async, wait_for
from tests.sqla_support import pg_schema
from txmq.broker.server import EmbeddedBroker

pytestmark = pytest.mark.slow

SMALL_STOCK = {"apple": 25, "fig": 25, "kiwi": 25, "pear": 25, "plum": 25}


@contextlib.contextmanager
def databases(backend: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The two services' databases: two SQLite files, or two fresh PostgreSQL schemas."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'orders.db'}", f"sqlite:///{tmp_path / 'inventory.db'}"
    else:
        with pg_schema() as orders_db, pg_schema() as inventory_db:
            yield orders_db, inventory_db


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("backend", "layout"),
    [("sqlite", "cluster"), ("postgresql", "cluster"), ("postgresql", "single")],
)
def test_every_fault_in_turn_and_the_books_balance(
    backend: str, layout: str, tmp_path: Path
) -> None:
    with databases(backend, tmp_path) as (orders_db, inventory_db):
        config = DemoConfig(
            orders=140,
            orders_db=orders_db,
            inventory_db=inventory_db,
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
    orders = result.report.orders
    assert orders[PENDING] == 0 and orders[CONFIRMED] > 0 and orders[CANCELLED] > 0
    # every accepted order exists, plus the one committed by the order service that was
    # killed before it could answer; the one killed before its commit does not
    assert sum(orders.values()) == result.accepted + 1
    assert sum(st["initial"] for st in result.report.stock) == 125
    assert result.inventory["duplicates_skipped"] >= 10
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


def _seed_inconsistent(orders_db: str, inventory_db: str) -> None:
    o, i = dbs.connect(orders_db), dbs.connect(inventory_db)
    try:
        with Session(o) as s, s.begin():
            s.add_all(
                [
                    Order(id="a" * 32, product="apple", quantity=2, state=CONFIRMED),
                    Order(id="b" * 32, product="apple", quantity=1, state=PENDING),
                    Order(id="c" * 32, product="pear", quantity=1, state=CONFIRMED),
                    Order(id="d" * 32, product="pear", quantity=3, state=CANCELLED),
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


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_checker_finds_exactly_the_inconsistencies_seeded(backend: str, tmp_path: Path) -> None:
    with databases(backend, tmp_path) as (orders_db, inventory_db):
        dbs.upgrade("orders", orders_db)
        dbs.upgrade("inventory", inventory_db)
        healthy = check(orders_db, inventory_db)
        assert healthy.ok and healthy.problems == []  # empty books balance
        _seed_inconsistent(orders_db, inventory_db)
        report = check(orders_db, inventory_db)
    assert not report.ok
    assert report.problems == [
        f"1 order(s) still PENDING: {'b' * 32}",
        "apple: reserved 4 but its reservations hold 2 (stock taken twice, or given back wrongly)",
        f"1 order(s) CONFIRMED without a reservation: {'c' * 32}",
        f"1 order(s) CANCELLED but its stock is held or it was never seen: {'d' * 32}",
        f"1 order(s) reservations for orders that do not exist (phantom messages): {'e' * 32}",
    ]
    assert report.orders == {CONFIRMED: 2, PENDING: 1, CANCELLED: 1}
    assert report.reservations == {RESERVED: 3}


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
    orders_db, inventory_db = f"sqlite:///{tmp_path / 'o.db'}", f"sqlite:///{tmp_path / 'i.db'}"
    r = front("seed", "--db", inventory_db, "apple=3")
    assert r.returncode == 0, r.stderr
    dbs.upgrade("orders", orders_db)
    inventory = InventoryService(inventory_db, b.address)
    with running_async(inventory):
        with OrderService(orders_db, b.address) as orders:
            assert orders.server is not None
            url = orders.server.url
            r = front("place", "--url", url, "--product", "apple", "--quantity", "2")
            assert r.returncode == 0 and '"state": "PENDING"' in r.stdout, r
            r = front("place", "--url", url, "--product", "apple", "--quantity", "2")
            assert r.returncode == 0, r
            r = front("place", "--url", url, "--product", "apple", "--quantity", "0")
            assert r.returncode == 1 and "quantity must be between 1" in r.stdout, r
            wait_for(lambda: check(orders_db, inventory_db).pending == 0)
            r = front("orders", "--url", url, "--state", "cancelled")
            assert r.returncode == 0, r
            assert r.stdout.count('"state": "CANCELLED"') == 1, r.stdout
            assert '"CONFIRMED"' not in r.stdout and '"insufficient stock"' in r.stdout
            r = front("orders", "--url", url)
            assert r.stdout.count('"state": "CONFIRMED"') == 1, r.stdout
            r = front("orders", "--url", url, "--state", "lost")
            assert r.returncode == 1 and "state must be PENDING" in r.stdout, r
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
    r = front("check", "--orders-db", orders_db, "--inventory-db", inventory_db)
    assert r.returncode == 0 and "BALANCED" in r.stdout, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["cluster", "single", "secure"])
def test_the_readme_demo_command_exits_0_with_the_summary(layout: str) -> None:
    """``secure``: the cluster with access control (a user per service) and mutual TLS on
    every port, and no request of the demo refused by them."""
    args = {"cluster": [], "single": ["--single-broker"], "secure": ["--secure"]}[layout]
    command = ["bash", "scripts/demo.sh", *args]
    try:
        r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=280)
    except subprocess.TimeoutExpired as exc:  # where it was, in its own words
        seen = exc.stdout or b""
        out = seen.decode(errors="replace") if isinstance(seen, bytes) else seen
        pytest.fail(f"the demo did not end in {exc.timeout} s; its output:\n{out}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "== txmq orders demo ==" in out
    assert "books:     BALANCED" in out and "result:    OK" in out
    assert out.count("  [ok] ") == len(default_faults(layout == "single")), out
    assert "[FAILED]" not in out
    if layout == "secure":
        assert "ACL on every port" in out and "users demo-operator, inventory-service" in out
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
