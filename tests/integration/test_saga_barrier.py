"""The sub-transaction barrier on its own, on PostgreSQL and SQLite: a repeated action or
compensation has no second effect, a compensation that comes first is a null compensation
and makes its late action a no-op (suspension), a compensation of an action that had no
effect does nothing, and two operations racing on a branch see each other."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import sessionmaker

from tests.sqla_support import pg_schema
from txmq.consumer.push import ConsumeResult
from txmq.protocol.message import MessageExt
from txmq.saga import Coordinator, Saga, State, Step, decide
from txmq.saga.barrier import Entry, enter, enter_async, record
from txmq.saga.model import Reply, encode
from txmq.sqla.tables import metadata as txmq_metadata
from txmq.sqla.tables import sagas


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'p.db'}"
        return
    with pg_schema() as u:
        yield u


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    e = sa.create_engine(url)
    with e.begin() as conn:
        txmq_metadata.create_all(conn)
    yield e
    e.dispose()


def _enter(engine: sa.Engine, saga: str, op: str, *, commit: bool = True) -> Entry:
    with engine.connect() as conn:
        entry = enter(conn, saga, "b", op)
        conn.commit() if commit else conn.rollback()
    return entry


def test_an_action_runs_once(engine: sa.Engine) -> None:
    assert _enter(engine, "s1", "action") is Entry.RUN
    assert _enter(engine, "s1", "action") is Entry.DUPLICATE
    assert _enter(engine, "s1", "compensation") is Entry.RUN  # it took effect: undo it
    assert _enter(engine, "s1", "compensation") is Entry.DUPLICATE


def test_a_rolled_back_action_leaves_nothing_behind(engine: sa.Engine) -> None:
    assert _enter(engine, "s2", "action", commit=False) is Entry.RUN
    assert _enter(engine, "s2", "action") is Entry.RUN  # the retry runs


def test_a_compensation_before_its_action_is_null_and_suspends_the_action(
    engine: sa.Engine,
) -> None:
    assert _enter(engine, "s3", "compensation") is Entry.NULL
    assert _enter(engine, "s3", "action") is Entry.SUSPENDED
    assert _enter(engine, "s3", "compensation") is Entry.DUPLICATE


def test_a_compensation_of_an_action_without_effect_does_nothing(engine: sa.Engine) -> None:
    for saga, reason in (("s4", "refused"), ("s5", "failed")):
        with engine.begin() as conn:
            assert record(conn, saga, "b", reason)
            assert not record(conn, saga, "b", reason)  # answered once
        assert _enter(engine, saga, "action") is Entry.DUPLICATE
        assert _enter(engine, saga, "compensation") is Entry.NULL


def test_a_compensation_racing_its_action_waits_for_it(engine: sa.Engine) -> None:
    """The action's transaction is open when the compensation arrives: the compensation
    waits for it and then undoes it (PostgreSQL's key lock; SQLite's one writer)."""
    seen: list[Entry] = []
    with engine.connect() as action:
        assert enter(action, "s6", "b", "action") is Entry.RUN
        t = threading.Thread(target=lambda: seen.append(_enter(engine, "s6", "compensation")))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not seen  # waiting on the action's row
        action.commit()
    t.join(10)
    assert seen == [Entry.RUN]


@pytest.mark.anyio
async def test_the_async_barrier_decides_the_same(url: str, engine: sa.Engine) -> None:
    aurl = url.replace("sqlite://", "sqlite+aiosqlite://")
    aengine = create_async_engine(aurl)
    try:
        async with aengine.connect() as conn:
            assert await enter_async(conn, "a1", "b", "compensation") is Entry.NULL
            assert await enter_async(conn, "a1", "b", "action") is Entry.SUSPENDED
            assert await enter_async(conn, "a2", "b", "action") is Entry.RUN
            assert await enter_async(conn, "a2", "b", "action") is Entry.DUPLICATE
            await conn.commit()
    finally:
        await aengine.dispose()


def test_an_answer_the_coordinator_cannot_place_is_ignored_or_kept(engine: sa.Engine) -> None:
    """An answer to a saga this database does not have is acknowledged and ignored; one to a
    saga whose stored definition this code cannot read is refused (retried, then kept in the
    dead letters) rather than dropped; a body that is not a command or an answer goes to the
    dead letters at once."""
    from sqlalchemy.orm import sessionmaker

    from txmq import ConsumeResult
    from txmq.protocol.message import MessageExt
    from txmq.saga import Coordinator, Participant
    from txmq.saga.model import Reply, encode
    from txmq.sqla.tables import sagas

    coordinator = Coordinator("shop", object(), sessionmaker(engine))
    with engine.begin() as conn:
        conn.execute(
            sagas.insert().values(
                saga_id="s9", name="old", definition={"steps": "?"}, coordinator="shop",
                state="RUNNING", step=0, op="action", command_id="c1", data={}, effected=[],
            )
        )  # fmt: skip

    def answer(saga_id: str) -> MessageExt:
        reply = Reply(saga_id=saga_id, command_id="c1", step=0, op="action", outcome="done")
        return MessageExt("saga-shop-replies", encode(reply), 0, 0, 0, 0, 0, 0)

    assert coordinator.listener(answer("unknown")) is ConsumeResult.SUCCESS
    garbled = MessageExt("saga-shop-replies", b"{not json", 0, 0, 0, 0, 0, 0)
    assert coordinator.listener(garbled) is ConsumeResult.DEAD_LETTER
    participant = Participant("shop", object(), sessionmaker(engine))
    assert participant.listener(garbled) is ConsumeResult.DEAD_LETTER
    with pytest.raises(ValueError, match="definition cannot be read"):
        coordinator.listener(answer("s9"))
    with engine.connect() as conn:  # nothing changed
        assert conn.execute(sa.select(sagas.c.state)).scalar_one() == "RUNNING"


def test_an_answer_decided_on_a_row_that_changed_meanwhile_is_decided_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite has no row locks (its SELECT ... FOR UPDATE locks nothing until the first
    write): another answer's transaction can change a saga between a coordinator's read and
    its write.  The write is conditioned on the row as read, so the late decision is not
    applied over the other one: the answer is decided again on the new row — here, found
    stale and ignored.  (Seen in the orders demo: a charge's late 'done' overwrote the
    compensation its deadline had started, and the order was confirmed after its refund.)"""
    url = f"sqlite:///{tmp_path / 'orders.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")  # a reader does not block a writer
        txmq_metadata.create_all(conn)
        saga = Saga("s", [Step("a", "inventory", compensation="undo-a")])
        conn.execute(
            sagas.insert().values(
                saga_id="g1",
                name="s",
                definition=saga.to_dict(),
                coordinator="orders",
                state=State.RUNNING,
                step=0,
                op="action",
                command_id="c1",
                data={},
                effected=[],
            )
        )
    coordinator = Coordinator("orders", object(), sessionmaker(engine), [saga])
    real, calls = decide.on_reply, []

    def on_reply(*args: Any) -> Any:
        calls.append(args[1].command_id)
        if len(calls) == 1:  # another answer's transaction commits in between
            with engine.begin() as other:
                other.execute(
                    sagas.update()
                    .where(sagas.c.saga_id == "g1")
                    .values(state=State.COMPENSATING, command_id="c2")
                )
        return real(*args)

    monkeypatch.setattr(decide, "on_reply", on_reply)
    refused = Reply(saga_id="g1", command_id="c1", step=0, op="action", outcome="refused")
    msg = MessageExt("saga-orders-replies", encode(refused), 0, 0, 0, 0, 0, 0)
    assert coordinator.listener(msg) is ConsumeResult.SUCCESS
    assert calls == ["c1", "c2"]  # decided again, on the row as it is now: stale
    with engine.connect() as conn:
        row = conn.execute(sa.select(sagas).where(sagas.c.saga_id == "g1")).one()
    assert (row.state, row.command_id) == (State.COMPENSATING, "c2")
    engine.dispose()
