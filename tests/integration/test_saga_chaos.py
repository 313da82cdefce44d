"""Chaos: 1,000 sagas across three service processes (``tests/saga_service.py``: the shop
that coordinates, inventory, payment), each process and the broker set's master SIGKILLed
at random moments (at least 20 kills), on PostgreSQL.  The broker set is a SYNC master and
a slave under the controller: a killed master's slave is elected in its place, and the old
master, started again, follows it as a slave (truncating what the new master never had).
Afterwards every saga is COMPLETED or COMPENSATED, none is stuck, and the books are exact:
the stock reserved and the money charged are those of the completed sagas, each once —
every effect applied at most once, every compensated effect undone."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import Spawner, read_line, wait_for
from tests.replicaset import ReplicaSet, replica_sets
from tests.saga_service import BALANCE, STOCK, accounts, stock
from tests.sqla_support import pg_schema
from txmq.sqla.db import with_connection
from txmq.sqla.tables import sagas
from txmq.sync import AdminClient

__all__ = ["replica_sets"]  # the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAGAS = 1000
KILLS = 24
ROLES = ("inventory", "payment", "shop")
#: quick retries; check-backs every second, never parked while a service restarts
BROKER_SETTINGS = {
    "message_delay_levels": "100ms 100ms 200ms 300ms 500ms 1s 1s 1s 1s 1s 1s 1s",
    "transaction_check_interval_s": 1,
    "transaction_timeout_s": 1,
    "transaction_check_max": 10000,
}


@pytest.fixture
def dbs() -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        yield {r: stack.enter_context(pg_schema()) for r in ROLES}


def _unfinished(url: str) -> list[tuple[Any, ...]]:
    """(saga id, state, step, op, command id) of up to 10 sagas not ended: where a stuck
    one stopped, for the failure's message."""
    c = sagas.c
    query = (
        sa.select(c.saga_id, c.state, c.step, c.op, c.command_id)
        .where(c.state.not_in(("COMPLETED", "COMPENSATED")))
        .limit(10)
    )
    return with_connection(url, lambda conn: [tuple(r) for r in conn.execute(query)])


def _scalar(url: str, query: sa.Select[tuple[int]]) -> int:
    return with_connection(url, lambda conn: int(conn.execute(query).scalar() or 0))


def test_a_thousand_sagas_through_process_and_master_kills(
    dbs: dict[str, str], replica_sets: Callable[..., ReplicaSet], spawn: Spawner
) -> None:
    # a new sequence of kills each run, said in every failure ($TXMQ_CHAOS_SEED repeats one)
    seed = int(os.environ.get("TXMQ_CHAOS_SEED") or time.time())
    rng = random.Random(seed)
    rs = replica_sets("sync", replicas=2, **BROKER_SETTINGS)
    ns = rs.namesrv
    with AdminClient(namesrv=ns.address) as admin:
        for topic in ("saga-inventory", "saga-payment", "saga-shop", "saga-shop-replies"):
            admin.create_topic(topic, 4)
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(role: str) -> None:
        procs[role] = spawn("-m", "tests.saga_service", role, "--db", dbs[role],
                            "--namesrv", ns.address, stdin=role == "shop")  # fmt: skip
        read_line(procs[role], "READY", timeout=60)

    for role in ROLES:
        start(role)
    flows = {}
    for i in range(SAGAS):
        data = {"order": f"o{i:04d}", "product": rng.choice(["apple", "pear"]),
                "quantity": rng.randint(1, 3), "customer": rng.choice(["ann", "bob"]),
                "amount": rng.randint(1, 50), "decline": rng.random() < 0.15}  # fmt: skip
        flows[data["order"]] = data
    pending = list(flows.values())
    kills: list[str] = []
    #: the master killed and the replica elected in its place, each time
    failovers: list[tuple[int, int]] = []
    next_kill = time.monotonic() + rng.uniform(0.3, 1.5)
    deadline = time.monotonic() + 420
    # feed the shop its sagas while processes die: a start lost with a killed shop is sent
    # again (the saga's id is the order's: one that did commit is refused, EXISTS)
    while pending or len(kills) < KILLS:
        assert time.monotonic() < deadline, f"seed {seed}: {len(pending)} not started, {kills}"
        if pending and procs["shop"].poll() is None:
            batch, pending = pending[:20], pending[20:]
            shop = procs["shop"]
            try:
                assert shop.stdin is not None
                for data in batch:
                    shop.stdin.write(f"start checkout {json.dumps(data)}\n")
                shop.stdin.flush()
                for _ in batch:
                    line = read_line(shop, "", timeout=30)
                    assert line.split()[0] in ("STARTED", "EXISTS"), line
            except (BrokenPipeError, AssertionError, ValueError, OSError):
                pending = batch + pending  # the shop died under it: again, once restarted
        if time.monotonic() >= next_kill and len(kills) < KILLS:
            victim = rng.choice([*ROLES, "broker"])
            if victim == "broker":
                # the master, once its set is whole again (both replicas in sync): its
                # slave is elected, then the old master comes back as a slave
                master = rs.wait_healthy(timeout=120)
                rs.kill(master)
                wait_for(lambda: rs.master() not in (-1, master), timeout=120)  # noqa: B023
                failovers.append((master, rs.master()))
                rs.restart(master)
            else:
                procs[victim].kill()
                procs[victim].wait(10)
                start(victim)
            kills.append(victim)
            next_kill = time.monotonic() + rng.uniform(0.3, 1.5)
        elif not pending:
            time.sleep(0.05)
    assert len(kills) >= 20 and set(kills) == {*ROLES, "broker"}, (seed, kills)
    assert failovers and all(old != new for old, new in failovers), (seed, failovers)

    shop_db = dbs["shop"]
    started = _scalar(shop_db, sa.select(sa.func.count()).select_from(sagas))
    assert started == SAGAS
    done = sa.select(sa.func.count()).select_from(sagas)
    ended = done.where(sagas.c.state.in_(("COMPLETED", "COMPENSATED")))
    limit = time.monotonic() + 240
    while _scalar(shop_db, ended) < SAGAS:
        stuck = _scalar(shop_db, done.where(sagas.c.state == "PARKED"))
        assert stuck == 0 and time.monotonic() < limit, (
            f"seed {seed}: {_scalar(shop_db, ended)} of {SAGAS} sagas ended ({stuck} parked); "
            f"not ended: {_unfinished(shop_db)}"
        )
        time.sleep(0.5)

    states = sa.select(sagas.c.saga_id, sagas.c.state)
    outcome = with_connection(shop_db, lambda conn: dict(conn.execute(states).all()))
    completed = [flows[o] for o, s in outcome.items() if s == "COMPLETED"]
    assert all(not f["decline"] for f in completed)
    assert all(outcome[o] == "COMPENSATED" for o, f in flows.items() if f["decline"])
    for product in ("apple", "pear"):
        want = sum(f["quantity"] for f in completed if f["product"] == product)
        got = sa.select(stock.c.available, stock.c.reserved).where(stock.c.product == product)
        e = sa.create_engine(dbs["inventory"])
        with e.connect() as conn:
            available, reserved = conn.execute(got).one()
        e.dispose()
        assert (available, reserved) == (STOCK - want, want), (seed, product)
    for customer in ("ann", "bob"):
        spent = sum(f["amount"] for f in completed if f["customer"] == customer)
        q = sa.select(accounts.c.balance).where(accounts.c.customer == customer)
        assert _scalar(dbs["payment"], q) == BALANCE - spent, (seed, customer)
    for proc in procs.values():
        proc.terminate()
        proc.wait(30)
