"""Idempotent consumers with a real broker (PostgreSQL and SQLite): the same message
delivered three times to two racing consumers of one group is applied once; a consumer
killed inside its handler has the message retried and applied once (transaction mode and
mark mode)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import insert
from sqlalchemy import select as sql_select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import txmq
from tests.conftest import Spawner, read_line
from tests.outbox_support import Db, effects, make_db, until
from tests.sqla_support import PROCESS_TRANSPORTS, start_broker
from txmq import AdminClient, ConsumeFrom, Message, MessageExt, Producer, PushConsumer
from txmq.broker.server import EmbeddedBroker
from txmq.sqla.tables import consumed_keys

pytestmark = pytest.mark.anyio

#: quick retries: level 3 (the first retry) is 300 ms
LEVELS = "100ms 200ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms"


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    with make_db(request.param, tmp_path) as d:
        yield d


async def create_topic(address: str, topic: str) -> None:
    async with AdminClient(address) as admin:
        await admin.create_topic(topic, 4)


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_three_deliveries_two_racing_consumers_apply_once(
    db: Db, flavour: str, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker()
    topic = f"dup-{db.backend}-{flavour}"
    await create_topic(b.address, topic)
    aengine = create_async_engine(db.aurl)
    seen: dict[str, list[str]] = {"a": [], "b": []}

    if flavour == "sync":

        @txmq.idempotent(db.engine, group="stock")
        def apply(msg: MessageExt, session: Session) -> None:
            session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))
            time.sleep(0.2)  # keep the transaction open: the copies overlap

        def member(name: str) -> Any:
            def listener(msg: MessageExt) -> Any:
                seen[name].append(msg.keys[0])
                return apply(msg)

            return listener
    else:

        @txmq.idempotent(aengine, group="stock")
        async def apply_async(msg: MessageExt, session: AsyncSession) -> None:
            await session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))
            await anyio.sleep(0.2)

        def member(name: str) -> Any:
            async def listener(msg: MessageExt) -> Any:
                seen[name].append(msg.keys[0])
                return await apply_async(msg)

            return listener

    consumers = [
        PushConsumer(
            b.address,
            "stock",
            listener=member(name),
            consume_from=ConsumeFrom.FIRST_OFFSET,
            instance_name=f"member-{name}",
        )
        for name in ("a", "b")
    ]
    try:
        for c in consumers:
            c.subscribe(topic)
            await c.start()
        # both members hold two of the four queues before anything is sent
        await until(
            lambda: [len([q for q in c.queues_held if q[0] == topic]) for c in consumers] == [2, 2]
        )
        async with Producer(b.address) as producer:
            for event in ("evt-1", "evt-2"):
                for copy in range(3):  # round robin: the copies land on different queues
                    await producer.send(Message(topic, f"{event}#{copy}".encode(), keys=[event]))
        await until(lambda: len(seen["a"]) + len(seen["b"]) == 6)
        await until(lambda: all(pq.count == 0 for c in consumers for pq in c.queues_held.values()))
    finally:
        for c in consumers:
            await c.stop()
        await aengine.dispose()
    assert seen["a"] and seen["b"], seen  # both members got copies
    assert Counter(seen["a"] + seen["b"]) == {"evt-1": 3, "evt-2": 3}
    applied = db.effects()
    assert sorted(key for key, _ in applied) == ["evt-1", "evt-2"]  # once each


def key_states(db: Db) -> set[tuple[str, str]]:
    with db.engine.connect() as conn:
        t = consumed_keys
        return {(k, state) for k, state in conn.execute(sql_select(t.c.key, t.c.state))}


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
@pytest.mark.parametrize("mode", ["transaction", "mark"])
async def test_consumer_killed_inside_the_handler_is_retried_and_applied_once(
    db: Db,
    mode: str,
    transport: str,
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    spawn: Spawner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over gRPC the killed member's message comes back when its invisible time is over
    (1 s here), with its delivery attempt counted."""
    via = start_broker(embedded_broker, transport, message_delay_levels=LEVELS)
    b = via.broker
    # the consumer process and this one's clients (not admin: txmq's protocol only)
    monkeypatch.setenv("TXMQ_TRANSPORT", transport)
    monkeypatch.setenv("TXMQ_INVISIBLE_TIME_S", "1")
    topic = f"killed-{db.backend}-{mode}"
    group = f"g-{mode}"
    out = tmp_path / "sent-mails.txt"  # mark mode's effect outside the database
    await create_topic(b.address, topic)
    args = ["--broker", via.address, "--group", group, "--topic", topic, "--db", db.url]
    args += ["--mode", mode, "--hang-on", "hang", "--expiry", "2", "--out", str(out)]
    proc = spawn("tests/idempotent_consumer_proc.py", *args)
    try:
        read_line(proc, "READY")
        async with Producer(via.address) as producer:
            # "ok" is applied and its key done before "hang" arrives (a kill between an
            # outside effect and its "done" would repeat that effect: mark mode's contract)
            await producer.send(Message(topic, b"ok", keys=["evt-ok"]), sharding_key="order-7")
            await until(lambda: ("evt-ok", "done") in key_states(db))
            await producer.send(Message(topic, b"hang", keys=["evt-hang"]), sharding_key="order-7")
        assert read_line(proc, "ENTERED ") == "ENTERED hang"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        spawn.kill_all()

    # a new member of the group picks the message up again (async this time)
    aengine = create_async_engine(db.aurl)
    delivered: list[tuple[str, int]] = []

    @txmq.idempotent(aengine, group=group)
    async def apply(msg: MessageExt, session: AsyncSession) -> None:
        await session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))

    @txmq.idempotent(aengine, group=group, mode="mark", expiry=2)
    async def apply_outside(msg: MessageExt) -> None:
        with out.open("a") as f:
            f.write(f"{msg.keys[0]} {msg.body.decode()}\n")
        await anyio.sleep(0.5)  # still running when the test, seeing the effect, stops it

    async def listener(msg: MessageExt) -> Any:
        delivered.append((msg.body.decode(), msg.reconsume_times))
        return await (apply if mode == "transaction" else apply_outside)(msg)

    def applied() -> Counter[str]:
        if mode == "transaction":
            return Counter(key for key, _ in db.effects())
        lines = out.read_text().splitlines() if out.exists() else []
        return Counter(line.split()[0] for line in lines)

    consumer = PushConsumer(via.address, group, listener=listener, consume_from="FIRST_OFFSET")
    consumer.subscribe(topic)
    try:
        async with consumer:
            await until(lambda: applied()["evt-hang"] == 1)
            await until(lambda: all(pq.count == 0 for pq in consumer.queues_held.values()))
    finally:
        await aengine.dispose()
    assert applied() == {"evt-ok": 1, "evt-hang": 1}
    # stopping let the running listener finish: its key is done (in mark mode the stop
    # comes while the listener still runs, its effect out but its key not recorded yet)
    assert ("evt-hang", "done") in key_states(db)
    if mode == "mark":
        # the dead consumer's mark was still valid: "later" until it expired, then taken over
        hang_tries = [times for body, times in delivered if body == "hang"]
        assert len(hang_tries) >= 2 and hang_tries[-1] >= 1, delivered
