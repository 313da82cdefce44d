"""The outbox relay under crashes and concurrency (PostgreSQL and SQLite): a relay
SIGKILLed between sending and marking sends again — the broker drops the copies (its
dedupe window), and without it an idempotent consumer applies each message once; three
relays at once deliver 50 keys x 200 rows, every row, in key order."""

from __future__ import annotations

import contextlib
import re
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import txmq
from tests.conftest import Spawner, read_line
from tests.outbox_support import by_key, effects, make_db, read_topic, until
from txmq import AdminClient, ConsumeFrom, Message, MessageExt, PushConsumer, outbox
from txmq.broker.server import EmbeddedBroker

pytestmark = pytest.mark.anyio

BACKENDS = ["postgresql", "sqlite"]


@pytest.mark.parametrize(
    ("backend", "dedupe_window_s"), [("postgresql", 0), ("sqlite", 0), ("sqlite", 120)]
)
async def test_relay_killed_after_send_before_mark_resends_and_consumer_applies_once(
    backend: str,
    dedupe_window_s: float,
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    spawn: Spawner,
) -> None:
    # the broker drops a resend of a message id it stored in its dedupe window; off (0),
    # the copies reach the consumer, which applies each message once
    b = embedded_broker(dedupe_window_s=dedupe_window_s)
    copies = 2 if dedupe_window_s == 0 else 1
    topic = f"crash-{backend}"
    with make_db(backend, tmp_path) as orders_db, make_db(backend, tmp_path) as billing_db:
        with Session(orders_db.engine) as session, session.begin():
            for key, body in [("o1", "o1:created"), ("o1", "o1:paid"), ("o2", "o2:created")]:
                outbox.add(session, Message(topic, body.encode()), sharding_key=key)
            outbox.add(session, Message(topic, b"free"))
        aengine = create_async_engine(billing_db.aurl)
        deliveries: list[str] = []

        @txmq.idempotent(aengine, group="billing")
        async def apply(msg: MessageExt, session: AsyncSession) -> None:
            await session.execute(insert(effects).values(key=msg.msg_id, body=msg.body.decode()))

        async def counting(msg: MessageExt) -> object:
            deliveries.append(msg.msg_id)
            return await apply(msg)

        async with AdminClient(b.address) as admin:
            await admin.create_topic(topic, 4)
        consumer = PushConsumer(
            b.address,
            "billing",
            listener=counting,
            consume_from=ConsumeFrom.FIRST_OFFSET,
        )
        consumer.subscribe(topic)
        try:
            async with consumer:
                # SQLite: the dead relay's rows are leased; sent again when the lease ends
                args = ["--db", orders_db.url, "--broker", b.address, "--claim-lease", "2"]
                relay = spawn("tests/outbox_relay_proc.py", *args)
                sent = read_line(relay, "SENT ")
                assert len(sent.split()[1].split(",")) == 4
                # the broker has them and the consumer applied them; the rows are unmarked
                await until(lambda: len(billing_db.effects()) == 4)
                assert orders_db.count(state="pending") == 4
                relay.send_signal(signal.SIGKILL)
                relay.wait(10)
                async with outbox.OutboxRelay(orders_db.aurl, b.address, poll_interval=0.05):
                    await until(lambda: orders_db.count(state="sent") == 4)
                    await until(lambda: len(deliveries) == 4 * copies)
                    await anyio.sleep(0.5)  # (no more come)
        finally:
            spawn.kill_all()  # before the schema is dropped: a live relay holds its locks
            await aengine.dispose()
        applied = billing_db.effects()
        assert sorted(body for _, body in applied) == [
            "free",
            "o1:created",
            "o1:paid",
            "o2:created",
        ]
        assert Counter(deliveries) == Counter({msg_id: copies for msg_id, _ in applied})
        stored = by_key(await read_topic(b.address, topic))
        assert stored["o1"] == ["o1:created", "o1:paid"] * copies  # order kept, copies after
        assert stored["o2"] == ["o2:created"] * copies


@pytest.mark.parametrize("backend", BACKENDS)
async def test_three_relays_deliver_every_row_in_key_order(
    backend: str,
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    spawn: Spawner,
) -> None:
    keys, per_key = 50, 200
    b = embedded_broker()
    topic = f"three-{backend}"
    with make_db(backend, tmp_path) as db, contextlib.closing(spawn) as _:
        relays = [
            spawn(
                "-m", "txmq.cli", "outbox", "relay", "--db", db.url, "--broker", b.address,
                "--batch-size", "20", "--stats-interval", "0",
            )
            for _ in range(3)
        ]  # fmt: skip
        for r in relays:
            read_line(r, "txmq outbox relay: ")
        for seq in range(per_key):  # 200 transactions of one row per key, all relays running
            with Session(db.engine) as session, session.begin():
                for k in range(keys):
                    outbox.add(session, Message(topic, f"{seq}".encode()), sharding_key=f"key{k}")
        await until(lambda: db.count(state="sent") == keys * per_key, timeout=90)
        assert db.count() == keys * per_key
        sent_by = []
        for r in relays:
            r.send_signal(signal.SIGTERM)
            line = read_line(r, "txmq outbox relay stopped")
            sent_by.append(int(re.findall(r"sent (\d+) row", line)[0]))
            assert r.wait(10) == 0
    assert sum(sent_by) == keys * per_key  # no row sent twice
    assert all(n > 0 for n in sent_by), sent_by  # and all three took part
    stored = by_key(await read_topic(b.address, topic))
    assert set(stored) == {f"key{k}" for k in range(keys)}
    # at least once: a send that timed out on a loaded machine but was stored is sent
    # again; what an idempotent consumer sees (each row the first time) is in key order
    for k in range(keys):
        first_seen = list(dict.fromkeys(stored[f"key{k}"]))
        assert first_seen == [str(i) for i in range(per_key)], f"key{k}"
