"""The saga classes of the reconciliation job (issue 30, item 8): sagas reconciled across
the coordinator's database (txmq_sagas, txmq_saga_steps) and the participants'
(txmq_saga_barrier), on SQLite and on PostgreSQL.  Each class is shown found, and absent
for the healthy sagas beside it; a participant whose database is not given is no
evidence, and barrier rows are judged only when a coordinator's database is given."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, insert

from tests.sqla_support import pg_schema
from txmq.saga.model import Saga, State, Step, tcc
from txmq.spark.classify import CLASSES
from txmq.spark.job import main
from txmq.spark.sagas import ENDED, SAGA_CLASSES, STATES
from txmq.spark.sources import Database
from txmq.sqla import metadata
from txmq.sqla.tables import SAGA_STATES, saga_barrier, saga_steps, sagas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHECKOUT = Saga(
    "checkout",
    [
        Step("reserve-stock", "inventory", compensation="release-stock"),
        Step("charge-card", "payment", compensation="refund-card"),
        Step("send-receipt", "mail"),  # no compensation; mail's database is never given
    ],
)
BOOKING = tcc(
    "booking",
    [
        ("inventory", "hold", "commit-hold", "release-hold"),
        ("payment", "authorize", "capture", "void"),
    ],
)
NOW = datetime.now(UTC).replace(microsecond=0)
OLD = NOW - timedelta(hours=1)  # older than the SLA (10 minutes)
RECENT = NOW - timedelta(minutes=1)
A, C, F = "action", "compensation", "confirm"


@dataclass
class World:
    """The databases (URLs) of the coordinator and the participants, and which rows of each
    class the sagas planted in them should give."""

    orders: str
    inventory: str
    payment: str
    stuck: set[str] = field(default_factory=set)
    partly: set[str] = field(default_factory=set)
    unbarred: set[tuple[str, str, str]] = field(default_factory=set)
    orphans: set[str] = field(default_factory=set)


class _Saga:
    """One saga's rows: the coordinator's row and step log in ``orders``, its barrier rows
    in the participants' databases (by service)."""

    def __init__(self, conns: dict[str, Connection], saga_id: str, saga: Saga) -> None:
        self.conns, self.saga_id, self.saga = conns, saga_id, saga

    def row(
        self, state: str, step: int, op: str, *, effected: tuple[int, ...] = (), **kw: Any
    ) -> _Saga:
        values = {
            "saga_id": self.saga_id,
            "name": self.saga.name,
            "definition": self.saga.to_dict(),
            "coordinator": "orders",
            "state": state,
            "step": step,
            "op": op,
            "data": {},
            "effected": list(effected),
            "created_at": OLD - timedelta(minutes=5),
            "updated_at": OLD,
            **kw,
        }
        self.conns["orders"].execute(insert(sagas).values(**values))
        return self

    def log(self, step: int, op: str, event: str, at: datetime = OLD) -> _Saga:
        branch = self.saga.steps[step].action
        self.conns["orders"].execute(
            insert(saga_steps).values(
                saga_id=self.saga_id, step=step, branch=branch, op=op, event=event, at=at
            )
        )
        return self

    def barrier(self, step: int, op: str, reason: str, at: datetime = OLD) -> _Saga:
        s = self.saga.steps[step]
        barrier(self.conns[s.service], self.saga_id, s.action, op, reason, at)
        return self


def barrier(
    conn: Connection, saga_id: str, branch: str, op: str, reason: str, at: datetime
) -> None:
    conn.execute(
        insert(saga_barrier).values(
            saga_id=saga_id, branch=branch, op=op, reason=reason, created_at=at
        )
    )


def _plant(w: World) -> None:
    with ExitStack() as stack:
        conns = {}
        for name in ("orders", "inventory", "payment"):
            engine = create_engine(getattr(w, name))
            stack.callback(engine.dispose)
            metadata.create_all(engine)
            conns[name] = stack.enter_context(engine.begin())

        def saga(saga_id: str, definition: Saga = CHECKOUT) -> _Saga:
            return _Saga(conns, saga_id, definition)

        # -- healthy: none of these is in any class
        saga("done-ok").row(State.COMPLETED, 2, A, effected=(0, 1, 2)).log(0, A, "done").log(
            1, A, "done"
        ).log(2, A, "done").barrier(0, A, A).barrier(1, A, A)
        # running, its last change younger than the SLA
        saga("running-young").row(State.RUNNING, 1, A, effected=(0,), updated_at=RECENT).log(
            0, A, "done"
        ).barrier(0, A, A)
        # the payment refused: the stock reservation compensated
        saga("compensated-ok").row(State.COMPENSATED, 0, C).log(0, A, "done").log(
            1, A, "refused"
        ).log(0, C, "done").barrier(0, A, A).barrier(0, C, C).barrier(1, A, "refused")
        # its compensation kept failing: an operator undid it by hand (resolved)
        saga("resolved").row(State.COMPENSATED, 0, C).log(0, A, "done").log(1, A, "refused").log(
            0, C, "failed"
        ).log(0, "operator", "resolved").barrier(0, A, A).barrier(1, A, "refused")
        # TCC: every try, then every confirm
        saga("tcc-ok", BOOKING).row(State.COMPLETED, 1, F, effected=(0, 1)).log(0, A, "done").log(
            1, A, "done"
        ).log(0, F, "done").log(1, F, "done").barrier(0, A, A).barrier(1, A, A).barrier(
            0, F, F
        ).barrier(1, F, F)

        # -- stuck: running, unchanged for an hour
        saga("running-old").row(State.RUNNING, 1, A, effected=(0,)).log(0, A, "done").barrier(
            0, A, A
        )
        # ... and parked on a compensation: waits for an operator (stuck, not partly
        # compensated: none of its effects is undone yet)
        saga("parked-old").row(
            State.PARKED, 1, C, effected=(0, 1), error="refund-card failed: card expired"
        ).log(0, A, "done").log(1, A, "done").log(2, A, "refused").log(1, C, "failed").barrier(
            0, A, A
        ).barrier(1, A, A)
        w.stuck |= {"running-old", "parked-old"}

        # -- partly compensated: COMPENSATED, the stock reservation never undone (and the
        # step log says it was: its barrier row is missing)
        saga("compensated-partly").row(State.COMPENSATED, 0, C).log(0, A, "done").log(
            1, A, "done"
        ).log(2, A, "refused").log(1, C, "done").log(0, C, "done").barrier(0, A, A).barrier(
            1, A, A
        ).barrier(1, C, C)
        w.partly.add("compensated-partly")
        w.unbarred.add(("compensated-partly", "reserve-stock", C))
        # ... still compensating an hour later: the payment refunded, the stock not released
        saga("compensating-partly").row(State.COMPENSATING, 0, C, effected=(0,)).log(
            0, A, "done"
        ).log(1, A, "done").log(2, A, "refused").log(1, C, "done").log(0, C, "sent").barrier(
            0, A, A
        ).barrier(1, A, A).barrier(1, C, C)
        w.partly.add("compensating-partly")
        w.stuck.add("compensating-partly")
        # ... the payment's refund lost (in the payment database only)
        saga("payment-lost").row(State.COMPENSATED, 0, C).log(0, A, "done").log(1, A, "done").log(
            2, A, "refused"
        ).log(1, C, "done").log(0, C, "done").barrier(0, A, A).barrier(0, C, C).barrier(1, A, A)
        w.partly.add("payment-lost")
        w.unbarred.add(("payment-lost", "charge-card", C))

        # -- effect without barrier: the card charged, the payment database has no row
        saga("unbarred").row(State.COMPLETED, 2, A, effected=(0, 1, 2)).log(0, A, "done").log(
            1, A, "done"
        ).log(2, A, "done").barrier(0, A, A)
        w.unbarred.add(("unbarred", "charge-card", A))
        # ... a TCC confirm
        saga("tcc-unconfirmed", BOOKING).row(State.COMPLETED, 1, F, effected=(0, 1)).log(
            0, A, "done"
        ).log(1, A, "done").log(0, F, "done").log(1, F, "done").barrier(0, A, A).barrier(
            1, A, A
        ).barrier(0, F, F)
        w.unbarred.add(("tcc-unconfirmed", "authorize", F))

        # -- barrier rows without saga: old, of a branch the definitions know
        inventory = conns["inventory"]
        barrier(inventory, "ghost", "reserve-stock", A, A, OLD)
        barrier(inventory, "ghost", "reserve-stock", C, C, OLD + timedelta(minutes=1))
        w.orphans.add("ghost")
        # not: younger than the SLA, or of a branch no definition read has
        barrier(inventory, "ghost-young", "reserve-stock", A, A, RECENT)
        barrier(inventory, "ghost-other", "pack-parcel", A, A, OLD)


def _reconcile(
    spark: Any, tmp_path: Path, *dbs: str
) -> tuple[int, dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The job on an empty store and ``dbs``, as of a minute from :data:`NOW`."""
    store = tmp_path / "store"
    (store / "commitlog").mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    argv = ["--store", str(store), "--out", str(out), "--sla", "10m"]
    argv += ["--now", (NOW + timedelta(minutes=1)).isoformat()]
    for db in dbs:
        argv += ["--db", db]
    rc = main(argv, spark=spark)
    rows = {
        c: [r.asDict() for r in spark.read.parquet(str(out / c)).collect()] for c in SAGA_CLASSES
    }
    return rc, rows, json.loads((out / "summary.json").read_text())


def _named(rows: dict[str, list[dict[str, Any]]]) -> dict[str, set[Any]]:
    return {
        "stuck": {r["saga_id"] for r in rows["saga_stuck"]},
        "partly": {r["saga_id"] for r in rows["saga_partly_compensated"]},
        "unbarred": {
            (r["saga_id"], r["branch"], r["op"]) for r in rows["saga_effect_without_barrier"]
        },
        "orphans": {r["saga_id"] for r in rows["saga_barrier_without_saga"]},
    }


def _expected(w: World) -> dict[str, set[Any]]:
    return {"stuck": w.stuck, "partly": w.partly, "unbarred": w.unbarred, "orphans": w.orphans}


def _check_every_class(spark: Any, tmp_path: Path, w: World) -> None:
    _plant(w)
    name = {k: Database(getattr(w, k)).name for k in ("orders", "inventory", "payment")}
    rc, rows, summary = _reconcile(spark, tmp_path, w.orders, w.inventory, w.payment)
    assert _named(rows) == _expected(w), rows
    assert rc == 1
    counts = summary["counts"]
    assert {c: counts[c] for c in SAGA_CLASSES} == {
        "saga_stuck": 3,
        "saga_partly_compensated": 3,
        "saga_effect_without_barrier": 4,
        "saga_barrier_without_saga": 1,
    }
    assert set(counts) == set(CLASSES)
    facts = summary["facts"]
    assert facts["sagas"] == 12
    # the participants, deduced from the barrier rows (mail's database was not given)
    assert facts["saga_participants"] == {
        "inventory": [name["inventory"]],
        "payment": [name["payment"]],
    }

    parked = next(r for r in rows["saga_stuck"] if r["saga_id"] == "parked-old")
    assert (parked["state"], parked["step"], parked["branch"], parked["op"]) == (
        "PARKED",
        1,
        "charge-card",
        C,
    )
    assert parked["detail"].startswith("PARKED for 1:01:00, past the SLA: waits for an operator")
    assert parked["detail"].endswith("; refund-card failed: card expired")
    assert parked["age"] == "1:01:00"
    assert (parked["service"], parked["db"], parked["participant_db"]) == (
        "payment",
        name["orders"],
        name["payment"],
    )
    running = next(r for r in rows["saga_stuck"] if r["saga_id"] == "running-old")
    assert running["detail"] == (
        "RUNNING for 1:01:00 without a change, waiting on step 1 (charge-card), its action"
    )
    (partly,) = (
        r for r in rows["saga_partly_compensated"] if r["saga_id"] == "compensating-partly"
    )
    assert (partly["step"], partly["branch"], partly["op"], partly["participant_db"]) == (
        0,
        "reserve-stock",
        C,
        name["inventory"],
    )
    assert partly["detail"] == (
        "COMPENSATING: compensation undid 1 of the 2 steps that took effect; not undone (no "
        "compensation barrier row): reserve-stock (inventory)"
    )
    (unbarred,) = (r for r in rows["saga_effect_without_barrier"] if r["saga_id"] == "unbarred")
    assert (unbarred["step"], unbarred["service"], unbarred["participant_db"]) == (
        1,
        "payment",
        name["payment"],
    )
    assert unbarred["at"].replace(tzinfo=UTC) == OLD
    (ghost,) = rows["saga_barrier_without_saga"]
    assert (ghost["branch"], ghost["op"], ghost["service"], ghost["participant_db"]) == (
        "reserve-stock",
        "action, compensation",
        "inventory",
        name["inventory"],
    )
    assert ghost["at"].replace(tzinfo=UTC) == OLD and ghost["db"] is None
    # the summary shows the classes and their first rows
    assert summary["examples"]["saga_barrier_without_saga"][0]["saga_id"] == "ghost"


def test_every_saga_class_on_sqlite(spark: Any, tmp_path: Path) -> None:
    w = World(*(f"sqlite:///{tmp_path / n}.db" for n in ("orders", "inventory", "payment")))
    _check_every_class(spark, tmp_path, w)

    # without the payment database: its branches are no evidence either way
    rc, rows, summary = _reconcile(spark, tmp_path, w.orders, w.inventory)
    assert _named(rows) == {
        "stuck": w.stuck,
        # compensating-partly: only its undone step is judged now (none undone beside it)
        "partly": {"compensated-partly"},
        "unbarred": {("compensated-partly", "reserve-stock", C)},
        "orphans": w.orphans,
    }, rows
    assert rc == 1
    assert summary["facts"]["saga_participants"] == {"inventory": [w.inventory]}

    # no coordinator's database: barrier rows alone are not judged
    rc, rows, summary = _reconcile(spark, tmp_path, w.inventory, w.payment)
    assert _named(rows) == {"stuck": set(), "partly": set(), "unbarred": set(), "orphans": set()}
    assert rc == 0, summary
    assert summary["facts"]["sagas"] == 0


@pytest.fixture
def pg_world() -> Iterator[World]:
    with pg_schema() as orders, pg_schema() as inventory, pg_schema() as payment:
        yield World(orders, inventory, payment)


def test_every_saga_class_on_postgresql(spark: Any, tmp_path: Path, pg_world: World) -> None:
    _check_every_class(spark, tmp_path, pg_world)


def test_the_jobs_saga_states_are_the_sagas() -> None:
    assert STATES == SAGA_STATES == State.ALL
    assert set(ENDED) == State.ENDED
