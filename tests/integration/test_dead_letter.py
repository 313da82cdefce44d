"""Dead-letter on purpose: a listener returning ``ConsumeResult.DEAD_LETTER`` or raising
``txmq.DeadLetter(reason)`` sends the message to ``%DLQ%<group>`` at once (no retries), the
reason kept with it (``TXMQ_DLQ_REASON``) and shown by ``txmq admin dlq list``; concurrent
and orderly consumers, the sync facade, ``@txmq.idempotent``; re-sending drops the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import txmq
from tests.conftest import ROOT, wait_for
from tests.outbox_support import Db, effects, make_db
from txmq import AdminClient, ConsumeResult, DeadLetter, Message, MessageExt, Producer
from txmq import sync as txsync
from txmq.broker.server import EmbeddedBroker
from txmq.client.core import BrokerClient
from txmq.consumer.push import DEAD_LETTER_RESULT, PushConsumer
from txmq.protocol.message import MAX_DLQ_REASON, Prop
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.sqla.tables import consumed_keys

pytestmark = pytest.mark.anyio

LEVELS = "10ms 20ms 40ms 60ms 80ms 100ms 120ms 140ms 160ms 180ms 200ms 220ms 240ms 260ms"
ODD_REASON = "bad payload:\n  <script>alert('x')</script> & \"quotes\"\ttab"


async def dead_letters(admin: AdminClient, group: str, n: int = 1) -> list[MessageExt]:
    with anyio.fail_after(15):
        while len(dead := await admin.dlq_list(group)) < n:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return dead


async def retry_depth(admin: AdminClient, group: str) -> int:
    return sum(s.max_offset for s in await admin.topic_stats(f"%RETRY%{group}"))


def admin_cli(address: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "admin", "--broker", address, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return done.stdout


async def test_dead_letter_result_skips_the_retries_and_resend_revives_it(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    seen: list[tuple[str, int, str | None]] = []
    healthy = False
    revived = anyio.Event()

    async def listener(msg: MessageExt) -> ConsumeResult:
        seen.append((msg.body.decode(), msg.reconsume_times, msg.get_property(Prop.DLQ_REASON)))
        if msg.body == b"poison" and not healthy:
            return ConsumeResult.DEAD_LETTER
        if healthy:
            revived.set()
        return ConsumeResult.SUCCESS

    consumer = PushConsumer(eb.address, "g-dead", listener=listener)
    consumer.subscribe("dead-result")
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("dead-result", 1)
        async with consumer, Producer(eb.address) as producer:
            poison = await producer.send(Message("dead-result", b"poison", keys=["p-1"]))
            await producer.send(Message("dead-result", b"fine"))
            [dead] = await dead_letters(admin, "g-dead")
            assert (dead.msg_id, dead.body, dead.keys) == (poison.msg_id, b"poison", ["p-1"])
            assert dead.topic == "%DLQ%g-dead" and dead.get_property(Prop.RETRY_TOPIC) == (
                "dead-result"
            )
            assert dead.reconsume_times == 1  # RocketMQ's count: the send-back's attempt
            assert dead.dlq_reason == DEAD_LETTER_RESULT
            await anyio.sleep(1.0)  # no retry comes: the first retry level is 40 ms
            assert sorted(seen) == [("fine", 0, None), ("poison", 0, None)]
            assert await retry_depth(admin, "g-dead") == 0

            healthy = True
            assert await admin.dlq_resend("g-dead", [poison.msg_id]) == 1
            with anyio.fail_after(10):
                await revived.wait()
            # the re-sent copy is consumable again, without the reason (the DLQ keeps it)
            assert seen[-1] == ("poison", 0, None)
            [kept] = await admin.dlq_list("g-dead")
            assert kept.dlq_reason == DEAD_LETTER_RESULT


def test_dead_letter_exception_sync_facade_reason_in_cli(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    reasons = {b"bad": "bad payload", b"long": "x" * 5000, b"odd": ODD_REASON, b"bare": ""}
    seen: list[bytes] = []

    def listener(msg: MessageExt) -> None:  # runs in a worker thread
        seen.append(msg.body)
        raise txmq.DeadLetter(reasons[msg.body])

    with txsync.AdminClient(eb.address) as admin:
        admin.create_topic("dead-raise", 1)
        consumer = txsync.PushConsumer(eb.address, "g-raise", listener=listener)
        consumer.subscribe("dead-raise")
        with consumer, txsync.Producer(eb.address) as producer:
            for body in reasons:
                producer.send(Message("dead-raise", body, keys=[f"key-{body.decode()}"]))

            def all_dead() -> list[MessageExt] | None:
                found = admin.dlq_list("g-raise")
                return found if len(found) == 4 else None

            dead = wait_for(all_dead)
            time.sleep(0.5)
        assert sorted(seen) == sorted(reasons)  # each delivered once
    by_body = {m.body: m.dlq_reason for m in dead}
    assert by_body[b"bad"] == "bad payload"
    assert by_body[b"odd"] == ODD_REASON
    assert by_body[b"bare"] == DEAD_LETTER_RESULT
    long = by_body[b"long"]
    assert long is not None and len(long) == MAX_DLQ_REASON
    assert long == "x" * (MAX_DLQ_REASON - 1) + "…"

    rows = json.loads(admin_cli(eb.address, "dlq", "list", "--group", "g-raise", "--json"))
    assert {r["body"]: r["reason"] for r in rows} == {k.decode(): v for k, v in by_body.items()}
    assert all(r["reconsume_times"] == 1 for r in rows)
    table = admin_cli(eb.address, "dlq", "list", "--group", "g-raise").splitlines()
    assert table[0].split() == [
        "MSG_ID",
        "ORIGIN_TOPIC",
        "RECONSUME_TIMES",
        "KEYS",
        "STORE_TIME",
        "BODY",
        "REASON",
    ]
    assert len(table) == 2 + 4  # one line per dead letter, whatever its reason holds
    line = {key: next(t for t in table if f"key-{key}" in t) for key in ("bad", "odd", "long")}
    assert line["bad"].endswith("  bad payload")
    assert line["odd"].endswith("  bad payload:   <script>alert('x')</script> & \"quotes\" tab")
    assert line["long"].endswith("  " + "x" * 57 + "...")


async def test_orderly_dead_letter_moves_the_queue_on(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    """Orderly: DeadLetter goes to the DLQ at once (no local retries) and the queue goes on
    in order; a message that keeps failing goes there after its local retries, with its
    last error as the reason."""
    eb = embedded_broker(message_delay_levels=LEVELS)
    order: list[tuple[str, int]] = []
    done = anyio.Event()

    async def listener(msg: MessageExt) -> ConsumeResult:
        body = msg.body.decode()
        order.append((body, msg.reconsume_times))
        if body == "m1":
            raise DeadLetter("cannot parse m1")
        if body == "m3":
            return ConsumeResult.DEAD_LETTER
        if body == "m4":
            raise ValueError("m4 keeps failing")
        if body == "m6":
            done.set()
        return ConsumeResult.SUCCESS

    consumer = PushConsumer(
        eb.address,
        "g-orderly-dead",
        listener=listener,
        orderly=True,
        max_reconsume_times=1,
        suspend_time=0.05,
    )
    consumer.subscribe("dead-orderly")
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("dead-orderly", 1)
        async with consumer, Producer(eb.address) as producer:
            for i in range(7):
                await producer.send(Message("dead-orderly", f"m{i}".encode(), keys=[f"k{i}"]))
            with anyio.fail_after(20):
                await done.wait()
            dead = await dead_letters(admin, "g-orderly-dead", 3)
            await anyio.sleep(0.5)
            assert await retry_depth(admin, "g-orderly-dead") == 0
    assert order == [
        ("m0", 0),
        ("m1", 0),
        ("m2", 0),
        ("m3", 0),
        ("m4", 0),
        ("m4", 1),  # one local retry (max_reconsume_times=1), then the DLQ
        ("m5", 0),
        ("m6", 0),
    ]
    assert [(m.body, m.dlq_reason) for m in dead] == [
        (b"m1", "cannot parse m1"),
        (b"m3", DEAD_LETTER_RESULT),
        (b"m4", "max reconsume times (1) used up: ValueError: m4 keeps failing"),
    ]


async def test_used_up_retries_keep_the_last_error(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    tries: list[int] = []

    async def listener(msg: MessageExt) -> ConsumeResult:
        tries.append(msg.reconsume_times)
        if msg.body == b"later":
            return ConsumeResult.RECONSUME_LATER
        raise KeyError(f"no customer {msg.reconsume_times}")

    consumer = PushConsumer(eb.address, "g-used-up", listener=listener, max_reconsume_times=2)
    consumer.subscribe("used-up")
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("used-up", 1)
        async with consumer, Producer(eb.address) as producer:
            await producer.send(Message("used-up", b"raise"))
            await producer.send(Message("used-up", b"later"))
            dead = await dead_letters(admin, "g-used-up", 2)
    assert sorted(tries) == [0, 0, 1, 1, 2, 2]
    assert {m.body: (m.reconsume_times, m.dlq_reason) for m in dead} == {
        b"raise": (3, "max reconsume times (2) used up: KeyError: 'no customer 2'"),
        b"later": (3, "max reconsume times (2) used up"),
    }


async def test_broker_bounds_the_reason(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    """The broker cuts a long reason itself (whatever the client sent), and drops it when the
    message's properties leave no room for it (the dead letter is kept)."""
    eb = embedded_broker()
    pad = "p" * 32_000  # properties near RocketMQ's 32767-byte limit
    async with Producer(eb.address) as producer:
        plain = await producer.send(Message("bounds", b"plain"), queue_id=0)
        full = await producer.send(Message("bounds", b"full", properties={"pad": pad}), queue_id=0)
    async with txmq.PullConsumer(eb.address, "g-bounds") as c, BrokerClient(eb.address) as raw:
        msgs = (await c.pull("bounds", 0, 0, long_poll=0)).messages
        for m in msgs:
            await raw.call(
                ConsumerSendMsgBack(
                    group="g-bounds",
                    commit_log_offset=m.commit_log_offset,
                    delay_level=-1,
                    origin_msg_id=m.msg_id,
                    reason="r" * 3000,
                )
            )
    async with AdminClient(eb.address) as admin:
        dead = {m.msg_id: m for m in await dead_letters(admin, "g-bounds", 2)}
    assert dead[plain.msg_id].dlq_reason == "r" * (MAX_DLQ_REASON - 1) + "…"
    assert dead[full.msg_id].dlq_reason is None
    assert dead[full.msg_id].properties["pad"] == pad


# -- idempotent consumers ---------------------------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    with make_db(request.param, tmp_path) as d:
        yield d


def key_rows(db: Db) -> list[tuple[str, str]]:
    with db.engine.connect() as conn:
        t = consumed_keys
        return [tuple(r) for r in conn.execute(select(t.c.key, t.c.state).order_by(t.c.key))]


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_idempotent_handler_dead_letters_with_nothing_applied(
    db: Db, flavour: str, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """A handler raising DeadLetter inside its transaction: its writes roll back, its key
    is not recorded, the message is dead-lettered; re-sent, it applies once."""
    eb = embedded_broker(message_delay_levels=LEVELS)
    topic, group = f"inv-{db.backend}-{flavour}", f"g-inv-{flavour}"
    accept = False
    aengine = create_async_engine(db.aurl)

    def body(msg: MessageExt) -> None:
        if msg.body == b"refuse" and not accept:
            raise DeadLetter("order 7 has no customer")

    if flavour == "sync":

        @txmq.idempotent(db.engine, group=group)
        def apply(msg: MessageExt, session: Session) -> None:
            session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))
            body(msg)

        listener: Any = apply
    else:

        @txmq.idempotent(aengine, group=group)
        async def apply_async(msg: MessageExt, session: AsyncSession) -> None:
            await session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))
            body(msg)

        listener = apply_async

    consumer = PushConsumer(eb.address, group, listener=listener)
    consumer.subscribe(topic)
    try:
        async with AdminClient(eb.address) as admin:
            await admin.create_topic(topic, 1)
            async with consumer, Producer(eb.address) as producer:
                refused = await producer.send(Message(topic, b"refuse", keys=["evt-7"]))
                await producer.send(Message(topic, b"take", keys=["evt-8"]))
                [dead] = await dead_letters(admin, group)
                assert dead.dlq_reason == "order 7 has no customer"
                with anyio.fail_after(10):
                    while key_rows(db) != [("evt-8", "done")]:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                await anyio.sleep(0.5)
                assert db.effects() == [("evt-8", "take")]  # nothing of evt-7
                assert key_rows(db) == [("evt-8", "done")]  # and no key for it

                accept = True
                assert await admin.dlq_resend(group, [refused.msg_id]) == 1
                with anyio.fail_after(10):
                    while len(key_rows(db)) < 2:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
    finally:
        await aengine.dispose()
    assert sorted(db.effects()) == [("evt-7", "refuse"), ("evt-8", "take")]
    assert key_rows(db) == [("evt-7", "done"), ("evt-8", "done")]


@pytest.mark.parametrize("mode", ["transaction", "mark"])
async def test_idempotent_dead_letter_result_rolls_back(db: Db, mode: str) -> None:
    """Returning DEAD_LETTER (no broker needed): rolled back, the key left free."""
    calls: list[str] = []

    def message(key: str) -> MessageExt:
        props = {Prop.UNIQ_KEY: f"ID-{key}", Prop.KEYS: key}
        return MessageExt("t", b"x", 0, 0, 0, 0, 0, 0, all_properties=props)

    if mode == "transaction":

        @txmq.idempotent(db.engine, group="dl")
        def apply(msg: MessageExt, session: Session) -> ConsumeResult:
            calls.append(msg.keys[0])
            session.execute(insert(effects).values(key=msg.keys[0], body="x"))
            return ConsumeResult.DEAD_LETTER

        listener: Any = apply
    else:

        @txmq.idempotent(db.engine, group="dl", mode="mark")
        def send(msg: MessageExt) -> ConsumeResult:
            calls.append(msg.keys[0])
            return ConsumeResult.DEAD_LETTER

        listener = send

    assert listener(message("a")) is ConsumeResult.DEAD_LETTER
    assert key_rows(db) == [] and db.effects() == []
    with pytest.raises(DeadLetter):  # raised: the same, and raised on to the consumer
        _raising(db, mode)(message("b"))
    assert key_rows(db) == [] and db.effects() == []
    assert listener(message("a")) is ConsumeResult.DEAD_LETTER  # not a duplicate: runs again
    assert calls == ["a", "a"]


def _raising(db: Db, mode: str) -> Callable[[MessageExt], Any]:
    if mode == "transaction":

        @txmq.idempotent(db.engine, group="dl-raise")
        def apply(msg: MessageExt, session: Session) -> None:
            session.execute(insert(effects).values(key=msg.keys[0], body="x"))
            raise DeadLetter("no")

        return apply

    @txmq.idempotent(db.engine, group="dl-raise", mode="mark")
    def send(msg: MessageExt) -> None:
        raise DeadLetter("no")

    return send
