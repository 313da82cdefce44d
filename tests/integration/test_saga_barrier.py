"""The sub-transaction barrier on its own, on PostgreSQL and SQLite: a repeated action or
compensation has no second effect, a compensation that comes first is a null compensation
and makes its late action a no-op (suspension), a compensation of an action that had no
effect does nothing, and two operations racing on a branch see each other."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from tests.sqla_support import pg_schema
from txmq.saga.barrier import Entry, enter, enter_async, record
from txmq.sqla.tables import metadata as txmq_metadata


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
