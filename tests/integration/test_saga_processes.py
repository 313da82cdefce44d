"""Sagas on real processes: a name server, a broker, and three services each in a process
of its own with its own database (``tests/saga_service.py``), on PostgreSQL and on SQLite:
a saga that completes, a business refusal, transient failures then success, retries
exhausted, a compensation that fails until an operator retries it from the command line,
TCC confirm and cancel, a step given up on at its deadline (its compensation null, its
late action suspended by the barrier), and the deadlines of answered steps recalled.
The books balance at the end: stock and money moved exactly as the outcomes say."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import ROOT, BrokerProcess, NamesrvProcess, Spawner, read_line, wait_for
from tests.saga_service import BALANCE, STOCK, accounts, stock, switches
from tests.sqla_support import pg_schema
from txmq.saga import SagaInfo, saga_info
from txmq.sqla.tables import sagas
from txmq.sync import AdminClient

#: first retry (level 3) at once, the second (level 4) 3 s later, the rest quick
LEVELS = "100ms 100ms 100ms 3s 100ms 100ms 100ms 100ms 100ms 100ms"
TOPICS = ("saga-inventory", "saga-payment", "saga-shop", "saga-shop-replies")


@contextmanager
def databases(backend: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    if backend == "sqlite":
        yield {r: f"sqlite:///{tmp_path / r}.db" for r in ("shop", "inventory", "payment")}
        return
    with ExitStack() as stack:
        yield {r: stack.enter_context(pg_schema()) for r in ("shop", "inventory", "payment")}


def _state(url: str, saga_id: str) -> str | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sagas.c.state).where(sagas.c.saga_id == saga_id)).scalar()
    finally:
        engine.dispose()


def _one(url: str, query: sa.Select[tuple[int, int]]) -> tuple[int, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(query).one()
            return int(row[0]), int(row[1])
    finally:
        engine.dispose()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_sagas_across_three_service_processes(
    backend: str,
    tmp_path: Path,
    namesrv_process: Callable[..., NamesrvProcess],
    broker_process: Callable[..., BrokerProcess],
    spawn: Spawner,
) -> None:
    ns = namesrv_process().start()
    broker = broker_process("--namesrv", ns.address, "--broker-name", "broker-a")
    broker.env["TXMQ_BROKER_MESSAGE_DELAY_LEVELS"] = LEVELS
    broker.start()
    with AdminClient(namesrv=ns.address) as admin:
        for topic in TOPICS:
            admin.create_topic(topic, 4)
    with databases(backend, tmp_path) as dbs:
        procs = {}
        for role in ("inventory", "payment", "shop"):
            procs[role] = spawn("-m", "tests.saga_service", role, "--db", dbs[role],
                                "--namesrv", ns.address, stdin=role == "shop")  # fmt: skip
            read_line(procs[role], "READY")
        pay = sa.create_engine(dbs["payment"])
        with pay.begin() as conn:  # every refund fails until it is cleared
            conn.execute(switches.insert().values(name="bank-down"))
        shop = procs["shop"]
        assert shop.stdin is not None
        base = {"product": "apple", "quantity": 1, "customer": "ann", "amount": 10}
        cases = {
            "ok": ("checkout", {}),
            "declined": ("checkout", {"decline": True}),
            "flaky": ("checkout", {"charge_fails": 2}),  # two retries, then it charges
            "broken": ("checkout", {"charge_fails": 100}),  # 1 + 3 retries: compensated
            "parked": ("checkout", {"confirm_refused": True}),  # its refund fails: parked
            "late": ("slow", {"charge_fails": 2}),  # its 1 s passes before the 3 s retry
            "held": ("hold", {}),
            "unheld": ("hold", {"decline": True}),
        }
        ids = {}
        for order, (name, extra) in cases.items():
            shop.stdin.write(f"start {name} {json.dumps({**base, **extra, 'order': order})}\n")
            shop.stdin.flush()
            ids[order] = read_line(shop, f"STARTED {order} ").split()[2]
        want = {
            "ok": "COMPLETED", "declined": "COMPENSATED", "flaky": "COMPLETED",
            "broken": "COMPENSATED", "parked": "PARKED", "late": "COMPENSATED",
            "held": "COMPLETED", "unheld": "COMPENSATED",
        }  # fmt: skip
        shop_db = dbs["shop"]
        seen: dict[str, str | None] = {}

        def settled() -> bool:
            seen.update({o: _state(shop_db, i) for o, i in ids.items()})
            return seen == want

        try:
            wait_for(settled, timeout=90)
        except AssertionError:
            raise AssertionError(f"the sagas are {seen}, not {want}") from None

        # the operator: the bank is back; retry the parked refund from the command line
        with pay.begin() as conn:
            conn.execute(switches.delete())
        r = subprocess.run(
            [sys.executable, "-m", "txmq.cli", "admin", "sagas", "retry", ids["parked"],
             "--reason", "bank is back", "--operator", "ops", "--db", shop_db,
             "--namesrv", ns.address],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _state(shop_db, ids["parked"]) == "COMPENSATED", timeout=60)

        def log(order: str) -> list[tuple[str, str, str]]:
            info = _info(shop_db, ids[order])
            return [(e.branch, e.op, e.event) for e in info.steps]

        late = log("late")
        assert ("charge", "action", "timeout") in late and (
            "charge",
            "compensation",
            "done",
        ) in late
        engine = sa.create_engine(shop_db)
        with engine.connect() as conn:
            detail = conn.execute(
                sa.text("SELECT detail FROM txmq_saga_steps WHERE saga_id = :s AND op = "
                        "'compensation' AND event = 'done'"), {"s": ids["late"]}
            ).scalar()  # fmt: skip
        engine.dispose()
        assert "null compensation" in (detail or "")
        assert ("charge", "action", "done") in log("flaky")
        assert ("charge", "action", "failed") in log("broken")
        assert ("charge", "operator", "retried") in log("parked")
        # the late charge's retry came after its compensation: the barrier stopped it
        wait_for(lambda: _one(dbs["payment"], sa.select(accounts.c.balance, accounts.c.held)
                              .where(accounts.c.customer == "ann")) == (BALANCE - 30, 0),
                 timeout=30)  # fmt: skip
        # completed: ok, flaky (checkout: reserved), held (TCC: shipped); the rest undone
        assert _one(dbs["inventory"], sa.select(stock.c.available, stock.c.reserved)
                    .where(stock.c.product == "apple")) == (STOCK - 3, 2)  # fmt: skip
        # answered steps' deadlines recalled (ok, declined, flaky, broken, parked): each
        # just after its coordinator's commit, so waited for
        with AdminClient(broker.address) as admin:
            topic = "RMQ_SYS_TIMER_RECALL"
            wait_for(lambda: sum(q.max_offset for q in admin.topic_stats(topic)) >= 5, timeout=30)
        pay.dispose()
        for proc in procs.values():
            proc.terminate()
            assert proc.wait(30) == 0


def _info(url: str, saga_id: str) -> SagaInfo:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            info = saga_info(conn, saga_id)
            assert info is not None
            return info
    finally:
        engine.dispose()
