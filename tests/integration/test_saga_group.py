"""The coordinator's group commit (async mode, txmq.saga.group): answers that queue up while
the coordinator's database is busy are decided in one local transaction, each as it would
have been alone; an answer delivered again finds its decision taken and sends its command
again; a group whose transaction fails is decided again answer by answer, so that one
answer's failure is its own.  On PostgreSQL and SQLite, over an in-process broker; the
answers are handed to the coordinator's listener directly, all at once (async: on the event
loop; sync: on threads, as the consumer's workers)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

import txmq
import txmq.sync
from tests.sqla_support import pg_schema
from txmq import ConsumeResult
from txmq.protocol.message import MessageExt
from txmq.saga import Coordinator, Ended, Saga, State, Step, command_topic
from txmq.saga.model import Reply, decode_command, encode, reply_topic
from txmq.sqla import SqlTransactionChecker
from txmq.sqla.tables import metadata as txmq_metadata
from txmq.sqla.tables import saga_steps, sagas
from txmq.testing import InProcessBroker

pytestmark = pytest.mark.anyio

SAGAS = 12
TWO_STEPS = Saga(
    "two-steps",
    [Step("reserve", "inventory", compensation="release"), Step("charge", "payment")],
)


@pytest.fixture(params=["postgresql", "sqlite"])
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The shop's database: (sync url, async url)."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            db = tmp_path / "shop.db"
            sync_url, async_url = f"sqlite:///{db}", f"sqlite+aiosqlite:///{db}"
        else:
            sync_url = async_url = stack.enter_context(pg_schema())
        engine = sa.create_engine(sync_url)
        with engine.begin() as conn:
            txmq_metadata.create_all(conn)
        engine.dispose()
        yield sync_url, async_url


@dataclass
class Shop:
    coordinator: Coordinator
    engine: sa.Engine
    broker: InProcessBroker
    #: on_end raises for these sagas
    refuse_end: set[str]

    def rows(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return {r.saga_id: r for r in conn.execute(sa.select(sagas))}

    def commands(self, service: str) -> list[tuple[str, str]]:
        """The (saga id, command id) of every command sent to ``service``."""
        out = []
        for msg in self.broker.messages(command_topic(service)):
            cmd = decode_command(msg.body)
            out.append((cmd.saga_id, cmd.command_id))
        return out

    async def start(self, saga_id: str) -> None:
        c = self.coordinator
        if c.is_async:
            async with c.sessions() as session, c.start(session, TWO_STEPS, {}, saga_id=saga_id):
                pass
        else:
            with c.sessions() as session, c.start(session, TWO_STEPS, {}, saga_id=saga_id):
                pass

    async def answer_all(self, replies: list[Reply]) -> list[Any]:
        """Hand every answer to the coordinator's listener at once (sync: each on a thread
        of its own, let go together); each one's result (or the exception it raised)."""
        results: list[Any] = [None] * len(replies)
        together = threading.Barrier(len(replies))

        def listen(msg: MessageExt) -> Any:
            together.wait(10)
            return self.coordinator.listener(msg)

        async def one(i: int, reply: Reply) -> None:
            msg = MessageExt(reply_topic("shop"), encode(reply), 0, 0, 0, 0, 0, 0)
            try:
                if self.coordinator.is_async:
                    results[i] = await self.coordinator.listen(msg)
                else:
                    results[i] = await anyio.to_thread.run_sync(listen, msg)
            except Exception as exc:
                results[i] = exc

        async with anyio.create_task_group() as tg:
            for i, reply in enumerate(replies):
                tg.start_soon(one, i, reply)
        return results


@pytest.fixture(params=["async", "sync"])
async def shop(
    request: pytest.FixtureRequest,
    urls: tuple[str, str],
    in_process_broker: Callable[..., InProcessBroker],
) -> AsyncIterator[Shop]:
    broker = in_process_broker()
    engine = sa.create_engine(urls[0])
    refuse_end: set[str] = set()

    def on_end(ended: Ended, session: Any) -> None:
        if ended.saga_id in refuse_end:
            raise RuntimeError(f"on_end refuses {ended.saga_id}")

    try:
        if request.param == "sync":
            with txmq.sync.TransactionProducer(
                group="shop-tx", listener=SqlTransactionChecker(engine)
            ) as producer:
                sessions = sessionmaker(engine, expire_on_commit=False)
                c = Coordinator("shop", producer, sessions, [TWO_STEPS], on_end=on_end)
                yield Shop(c, engine, broker, refuse_end)
            return
        aengine = create_async_engine(urls[1])
        try:
            async with txmq.TransactionProducer(
                group="shop-tx", listener=SqlTransactionChecker(aengine)
            ) as aproducer:
                asessions = async_sessionmaker(aengine, expire_on_commit=False)
                c = Coordinator("shop", aproducer, asessions, [TWO_STEPS], on_end=on_end)
                yield Shop(c, engine, broker, refuse_end)
        finally:
            await aengine.dispose()
    finally:
        engine.dispose()


def _done(row: Any) -> Reply:
    """The 'done' answer to the command ``row`` waits on."""
    return Reply(
        saga_id=row.saga_id, command_id=row.command_id, step=row.step, op=row.op, outcome="done"
    )


async def test_answers_that_queue_up_are_decided_together_each_as_alone(shop: Shop) -> None:
    ids = [f"s{i:02d}" for i in range(SAGAS)]
    for saga_id in ids:
        await shop.start(saga_id)
    group = shop.coordinator.group_commit
    assert group is not None and group.groups == 0
    first = shop.rows()
    results = await shop.answer_all([_done(first[i]) for i in ids])
    assert results == [ConsumeResult.SUCCESS] * SAGAS
    # the first answer leads alone; the others queued meanwhile and went together (threads
    # let go at once may still come a little apart)
    assert group.groups >= 1
    assert group.grouped >= (SAGAS - 1 if shop.coordinator.is_async else 2)
    rows = shop.rows()
    assert {(r.state, r.step) for r in rows.values()} == {(State.RUNNING, 1)}
    charges = shop.commands("payment")
    assert sorted(charges) == sorted((i, rows[i].command_id) for i in ids)

    # every answer again: each decision is found taken, and its command is sent again (the
    # same command id); nothing else changes
    before = rows
    results = await shop.answer_all([_done(first[i]) for i in ids])
    assert results == [ConsumeResult.SUCCESS] * SAGAS
    rows = shop.rows()
    assert {i: (r.state, r.step, r.command_id) for i, r in rows.items()} == {
        i: (r.state, r.step, r.command_id) for i, r in before.items()
    }
    assert sorted(shop.commands("payment")) == sorted(charges * 2)

    # the last answers: one saga's on_end raises; the group fails, each answer is decided
    # alone, and only that one fails (its answer would come again)
    shop.refuse_end.add(ids[3])
    results = await shop.answer_all([_done(rows[i]) for i in ids])
    assert isinstance(results[3], RuntimeError) and "refuses s03" in str(results[3])
    assert [r for k, r in enumerate(results) if k != 3] == [ConsumeResult.SUCCESS] * (SAGAS - 1)
    rows = shop.rows()
    assert rows[ids[3]].state == State.RUNNING
    assert {rows[i].state for i in ids if i != ids[3]} == {State.COMPLETED}
    with shop.engine.connect() as conn:
        logged = conn.execute(
            sa.select(saga_steps.c.saga_id, sa.func.count())
            .where(saga_steps.c.event == "done")
            .group_by(saga_steps.c.saga_id)
        )
        done = {saga_id: n for saga_id, n in logged}
    # each answer logged once: the repeats and the failed group left no row
    assert done == {i: 1 if i == ids[3] else 2 for i in ids}


async def test_a_leader_cancelled_in_its_group_hands_the_lead_on() -> None:
    """The queue and the lead alone (each answer decided on its own, as when a group is
    one): a leader cancelled while it decides settles its group with an error and hands
    the lead to the answer waiting behind it, which is decided; the next answer after
    that leads at once."""
    from txmq.saga.group import GroupCommit

    gate = anyio.Event()
    decided: list[str] = []

    async def alone(saga_id: str, choose: Any, answered: tuple[str, str]) -> ConsumeResult:
        if saga_id == "a":
            await gate.wait()  # never set: "a" is cancelled in here
        decided.append(saga_id)
        return ConsumeResult.SUCCESS

    group = GroupCommit(sessions=None, producer=None, service="shop", topic="t",
                        saga_of=lambda row: None, on_end=None, alone=alone)  # fmt: skip
    results: dict[str, Any] = {}

    async def one(saga_id: str) -> None:
        results[saga_id] = await group.decide(saga_id, None, ("c", "done"))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            leader = anyio.CancelScope()

            async def lead() -> None:
                with leader:
                    await one("a")

            tg.start_soon(lead)
            await anyio.wait_all_tasks_blocked()  # "a" leads, inside its decision
            tg.start_soon(one, "b")
            await anyio.wait_all_tasks_blocked()  # "b" waits behind it
            assert decided == [] and results == {}
            leader.cancel()
        assert results == {"b": ConsumeResult.SUCCESS} and decided == ["b"]
        assert await group.decide("c", None, ("c", "done")) is ConsumeResult.SUCCESS
    assert decided == ["b", "c"]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "32"])
def test_a_group_size_that_is_not_a_count_is_refused_in_one_line(bad: Any) -> None:
    sessions = sessionmaker(sa.create_engine("sqlite://"))
    with pytest.raises(ValueError, match=r"most answers decided in one transaction"):
        Coordinator("shop", None, sessions, [TWO_STEPS], group=bad)
