"""Delayed delivery by level, consumer retries through %RETRY%, the dead-letter queue."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from tests.conftest import ROOT, BrokerProcess, raw_request, wait_for
from txmq import AdminClient, Message, Producer, PullConsumer, PullStatus
from txmq import sync as txsync
from txmq.broker.server import EmbeddedBroker
from txmq.client.core import BrokerClient
from txmq.protocol.message import MessageExt, Prop, new_message_id
from txmq.protocol.wire import (
    BatchEntry,
    ConsumerSendMsgBack,
    DlqResend,
    RequestCode,
    SendBack,
    SendBatchMessage,
    SendMessage,
)
from txmq.protocol.wire.errors import BadRequest, MessageNotFound

# level:   1     2     3      4      5      6
LEVELS = "20ms 40ms 300ms 350ms 400ms 450ms"
DELAY = {1: 20, 2: 40, 3: 300, 4: 350, 5: 400, 6: 450}
SLACK_MS = 1500  # how late a delivery may be on a loaded test machine


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll an async ``predicate`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await anyio.sleep(0.02)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def send_back(
    client: BrokerClient,
    group: str,
    msg: MessageExt,
    *,
    delay_level: int = 0,
    max_reconsume_times: int = 16,
) -> SendBack:
    return await client.call(
        ConsumerSendMsgBack(
            group=group,
            commit_log_offset=msg.commit_log_offset,
            delay_level=delay_level,
            max_reconsume_times=max_reconsume_times,
            origin_msg_id=msg.msg_id,
        )
    )


async def pull_at(
    consumer: PullConsumer, topic: str, queue_id: int, offset: int, long_poll: float = 5.0
) -> MessageExt:
    res = await consumer.pull(topic, queue_id, offset, long_poll=long_poll)
    assert res.status == PullStatus.FOUND, f"nothing at {topic}/{queue_id}@{offset}"
    return res.messages[0]


async def read_all(consumer: PullConsumer, topic: str, queue_id: int) -> list[MessageExt]:
    out: list[MessageExt] = []
    offset = 0
    while True:
        res = await consumer.pull(topic, queue_id, offset, max_msgs=256, long_poll=0)
        if res.status != PullStatus.FOUND:
            return out
        out.extend(res.messages)
        offset = res.next_offset


def assert_no_routing_props(msg: MessageExt) -> None:
    for name in (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.CQ_TAG_CODE):
        assert name not in msg.all_properties, name


# -- consumer retries ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_send_back_retries_with_growing_delay_then_dead_letters(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    async with (
        Producer(eb.address) as producer,
        PullConsumer(eb.address, "G") as consumer,
        BrokerClient(eb.address) as raw,
    ):
        sent = await producer.send(
            Message("orders", b"pay 1", tags="paid", keys=["o-1"], properties={"k": "v"}),
            queue_id=2,
        )
        original = await pull_at(consumer, "orders", 2, 0, long_poll=0)

        # 1st failure: level 3 + 0 into %RETRY%G
        began = now_ms()
        answer = await send_back(raw, "G", original, max_reconsume_times=2)
        assert answer.topic == "%RETRY%G" and answer.delay_level == 3
        first = await pull_at(consumer, "%RETRY%G", 0, 0)
        arrived = now_ms()
        assert first.store_timestamp >= began + DELAY[3]
        assert arrived - began < DELAY[3] + SLACK_MS
        assert first.reconsume_times == 1
        assert first.msg_id == sent.msg_id == original.msg_id  # same UNIQ_KEY
        assert first.get_property(Prop.RETRY_TOPIC) == "orders"
        assert first.get_property(Prop.ORIGIN_MESSAGE_ID) == original.msg_id
        assert (first.body, first.tags, first.keys, first.properties) == (
            b"pay 1",
            "paid",
            ["o-1"],
            {"k": "v"},
        )
        assert first.born_timestamp == original.born_timestamp
        assert_no_routing_props(first)

        # 2nd failure, consumed from the retry topic: level 3 + 1, origin kept
        began = now_ms()
        answer = await send_back(raw, "G", first, max_reconsume_times=2)
        assert answer.delay_level == 4
        second = await pull_at(consumer, "%RETRY%G", 0, 1)
        assert second.store_timestamp >= began + DELAY[4]
        assert second.reconsume_times == 2
        assert second.get_property(Prop.RETRY_TOPIC) == "orders"
        assert second.get_property(Prop.ORIGIN_MESSAGE_ID) == original.msg_id
        assert second.msg_id == original.msg_id

        # 3rd failure: max_reconsume_times (2) used up -> %DLQ%G at once
        answer = await send_back(raw, "G", second, max_reconsume_times=2)
        assert answer.topic == "%DLQ%G"
        dead = await pull_at(consumer, "%DLQ%G", 0, 0, long_poll=0)
        assert dead.reconsume_times == 3 and dead.body == b"pay 1"
        assert dead.get_property(Prop.RETRY_TOPIC) == "orders"
        assert dead.msg_id == original.msg_id
        assert_no_routing_props(dead)

        async with AdminClient(eb.address) as admin:
            topics = {t.topic: t for t in await admin.topics()}
        for name in ("%RETRY%G", "%DLQ%G"):
            assert topics[name].queue_nums == 1 and topics[name].system


@pytest.mark.anyio
async def test_send_back_levels_and_errors(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    async with (
        Producer(eb.address) as producer,
        PullConsumer(eb.address, "G2") as consumer,
        BrokerClient(eb.address) as raw,
    ):
        await producer.send(Message("orders", b"a"), queue_id=0)
        await producer.send(Message("orders", b"b"), queue_id=0)
        a, b = (await consumer.pull("orders", 0, 0, long_poll=0)).messages

        # delay level -1: straight to the DLQ, whatever the count
        assert (await send_back(raw, "G2", a, delay_level=-1)).topic == "%DLQ%G2"
        dead = await pull_at(consumer, "%DLQ%G2", 0, 0, long_poll=0)
        assert dead.msg_id == a.msg_id and dead.reconsume_times == 1

        # an explicit level is used as is; a level above the last is the last
        began = now_ms()
        assert (await send_back(raw, "G2", b, delay_level=1)).delay_level == 1
        quick = await pull_at(consumer, "%RETRY%G2", 0, 0)
        assert quick.store_timestamp >= began + DELAY[1]
        began = now_ms()
        assert (await send_back(raw, "G2", b, delay_level=40)).delay_level == 6
        slow = await pull_at(consumer, "%RETRY%G2", 0, 1)
        assert slow.store_timestamp >= began + DELAY[6]

        with pytest.raises(MessageNotFound):
            await raw.call(ConsumerSendMsgBack(group="G2", commit_log_offset=1 << 40))
        with pytest.raises(BadRequest):
            await raw_request(
                raw, RequestCode.CONSUMER_SEND_MSG_BACK, {"commit_log_offset": a.commit_log_offset}
            )
        # a client may not send to the retry or dead-letter topics itself
        with pytest.raises(Exception, match="system topic"):
            await producer.send(Message("%RETRY%G2", b"x"))


# -- delayed messages ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_delayed_send_wakes_a_long_polling_pull(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    assert eb.broker is not None
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("later", 2)
    async with PullConsumer(eb.address, "g") as consumer, Producer(eb.address) as producer:
        got: list[tuple[int, MessageExt]] = []

        async def pull() -> None:
            msg = await pull_at(consumer, "later", 1, 0, long_poll=10)
            got.append((now_ms(), msg))

        async with anyio.create_task_group() as tg:
            tg.start_soon(pull)
            with anyio.fail_after(5):  # wait until the broker holds the pull
                while not eb.broker.arrivals.waiting("later", 1):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            began = now_ms()
            sent = await producer.send(
                Message("later", b"in a while", tags="t", delay_level=3), queue_id=1
            )
            assert sent.queue_id == 1
        [(arrived, msg)] = got
        assert DELAY[3] <= arrived - began < DELAY[3] + SLACK_MS
        assert msg.store_timestamp >= began + DELAY[3]
        assert (msg.msg_id, msg.body, msg.tags, msg.topic, msg.queue_id) == (
            sent.msg_id,
            b"in a while",
            "t",
            "later",
            1,
        )
        assert msg.reconsume_times == 0
        assert_no_routing_props(msg)

        # a level above the last is clamped to the last (RocketMQ)
        began = now_ms()
        await producer.send(Message("later", b"clamped", delay_level=99), queue_id=0)
        plain = await producer.send(Message("later", b"plain"), queue_id=0)
        assert plain.queue_offset == 0  # not delayed: stored at once
        clamped = await pull_at(consumer, "later", 0, 1)
        assert clamped.body == b"clamped" and clamped.store_timestamp >= began + DELAY[6]

        with pytest.raises(BadRequest, match="DELAY"):
            await producer.call(
                SendMessage(topic="later", queue_id=0, properties={"DELAY": "soon"}), b"x"
            )


@pytest.mark.anyio
async def test_many_delayed_messages_across_levels_arrive_in_time(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    sent_at: dict[str, tuple[int, int]] = {}
    async with Producer(eb.address) as producer, PullConsumer(eb.address, "g") as consumer:
        for i in range(300):
            level = 1 + i % 4
            t = now_ms()
            r = await producer.send(Message("bulk", f"m{i}".encode(), delay_level=level))
            sent_at[r.msg_id] = (t, level)
        got: dict[str, MessageExt] = {}

        async def collect() -> bool:
            for qid in range(4):
                for m in await read_all(consumer, "bulk", qid):
                    got[m.msg_id] = m
            return len(got) >= len(sent_at)

        await until(collect, timeout=20)
    assert set(got) == set(sent_at)
    for msg_id, (t, level) in sent_at.items():
        late = got[msg_id].store_timestamp - (t + DELAY[level])
        assert 0 <= late < SLACK_MS, (msg_id, level, late)


@pytest.mark.anyio
async def test_delayed_entry_in_a_raw_batch(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    async with AdminClient(eb.address) as admin, PullConsumer(eb.address, "g") as consumer:
        await admin.create_topic("mixed", 1)
        now_id, later_id = new_message_id(), new_message_id()
        began = now_ms()
        batch = SendBatchMessage(
            topic="mixed",
            queue_id=0,
            messages=[
                BatchEntry(size=3, properties={Prop.UNIQ_KEY: now_id}),
                BatchEntry(size=5, properties={Prop.UNIQ_KEY: later_id, Prop.DELAY: "4"}),
            ],
        )
        answer = await admin.call(batch, b"nowlater")
        assert answer.msg_ids == [now_id, later_id]
        first = await pull_at(consumer, "mixed", 0, 0, long_poll=0)
        assert (first.msg_id, first.body) == (now_id, b"now")
        second = await pull_at(consumer, "mixed", 0, 1)
        assert (second.msg_id, second.body) == (later_id, b"later")
        assert second.store_timestamp >= began + DELAY[4]


@pytest.mark.parametrize("stop", ["terminate", "kill"])
@pytest.mark.anyio
async def test_pending_delayed_messages_survive_a_restart(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path, stop: str
) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        '[broker]\nmessage_delay_levels = "50ms 2s"\noffset_persist_interval_s = 0.2\n'
    )
    bp = broker_process("--config", str(config)).start()
    due: dict[str, int] = {}
    async with Producer(bp.address) as producer, PullConsumer(bp.address, "g") as consumer:
        for i in range(5):  # delivered before the restart
            t = now_ms()
            r = await producer.send(Message("restart", f"early {i}".encode(), delay_level=1))
            due[r.msg_id] = t + 50

        async def early_delivered() -> bool:
            return sum([len(await read_all(consumer, "restart", q)) for q in range(4)]) == 5

        await until(early_delivered)
        for i in range(20):  # still pending when the broker stops
            t = now_ms()
            r = await producer.send(Message("restart", f"late {i}".encode(), delay_level=2))
            due[r.msg_id] = t + 2000
    if stop == "terminate":
        assert bp.terminate() == 0
    else:
        bp.kill()

    bp.start()
    async with PullConsumer(bp.address, "g") as consumer:
        got: list[MessageExt] = []

        async def all_delivered() -> bool:
            nonlocal got
            got = [m for q in range(4) for m in await read_all(consumer, "restart", q)]
            return {m.msg_id for m in got} >= set(due)

        await until(all_delivered, timeout=20)
    assert {m.msg_id for m in got} == set(due)
    for m in got:
        assert m.store_timestamp >= due[m.msg_id], m.body
        assert_no_routing_props(m)
    if stop == "terminate":  # offsets saved at shutdown: nothing delivered twice
        assert len(got) == len(due)
    assert bp.terminate() == 0


# -- the dead-letter queue -----------------------------------------------------------------


async def _dead_letters(address: str, group: str, bodies: list[bytes]) -> list[MessageExt]:
    async with Producer(address) as producer, PullConsumer(address, group) as consumer:
        async with BrokerClient(address) as raw:
            for body in bodies:
                await producer.send(
                    Message("orders", body, keys=["k-" + body.decode()]), queue_id=0
                )
            msgs = (await consumer.pull("orders", 0, 0, long_poll=0)).messages
            for m in msgs:
                await send_back(raw, group, m, delay_level=-1)
    return msgs


@pytest.mark.anyio
async def test_dlq_list_and_resend(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    originals = await _dead_letters(eb.address, "DG", [b"one", b"two", b"three"])
    async with AdminClient(eb.address) as admin, PullConsumer(eb.address, "DG") as consumer:
        dead = await admin.dlq_list("DG")
        assert [m.body for m in dead] == [b"one", b"two", b"three"]
        assert [m.msg_id for m in dead] == [m.msg_id for m in originals]
        assert all(
            m.topic == "%DLQ%DG" and m.get_property(Prop.RETRY_TOPIC) == "orders" for m in dead
        )
        assert [m.body for m in await admin.dlq_list("DG", offset=1, max=1)] == [b"two"]
        assert await admin.dlq_list("DG", offset=3) == []
        assert await admin.dlq_list("nobody") == []

        assert await admin.dlq_resend("DG", [dead[1].msg_id]) == 1
        again = await pull_at(consumer, "%RETRY%DG", 0, 0, long_poll=0)  # at once, no delay
        assert (again.msg_id, again.body, again.reconsume_times) == (dead[1].msg_id, b"two", 0)
        assert dead[1].dlq_reason == "sent to the DLQ by its consumer" and again.dlq_reason is None
        assert again.get_property(Prop.RETRY_TOPIC) == "orders"
        assert again.keys == ["k-two"]

        assert await admin.dlq_resend("DG") == 3  # all; the DLQ keeps its copies
        assert len(await admin.dlq_list("DG")) == 3
        assert len(await read_all(consumer, "%RETRY%DG", 0)) == 4
        assert await admin.dlq_resend("DG", ["no-such-id"]) == 0
        assert await admin.dlq_resend("DG", []) == 0
        with pytest.raises(BadRequest):
            await admin.call(DlqResend(group="DG"))


def test_dlq_sync_admin_and_cli(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    originals = anyio.run(_dead_letters, eb.address, "CG", [b"alpha", b"beta"])
    with txsync.AdminClient(eb.address) as admin:
        assert [m.body for m in admin.dlq_list("CG")] == [b"alpha", b"beta"]
        assert admin.dlq_resend("CG", [originals[0].msg_id]) == 1

    def txmq(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "txmq.cli", "admin", "--broker", eb.address, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=True,
        )
        return done.stdout

    rows = json.loads(txmq("dlq", "list", "--group", "CG", "--json"))
    assert [(r["body"], r["origin_topic"], r["reconsume_times"]) for r in rows] == [
        ("alpha", "orders", 1),
        ("beta", "orders", 1),
    ]
    assert rows[0]["msg_id"] == originals[0].msg_id and rows[0]["topic"] == "%DLQ%CG"
    assert json.loads(txmq("--json", "dlq", "list", "--group", "CG", "--max", "1"))[0]["body"] == (
        "alpha"
    )
    table = txmq("dlq", "list", "--group", "CG").splitlines()
    assert table[0].split() == [
        "MSG_ID",
        "ORIGIN_TOPIC",
        "RECONSUME_TIMES",
        "KEYS",
        "STORE_TIME",
        "BODY",
        "REASON",
    ]
    assert originals[1].msg_id in table[3] and "orders" in table[3] and "k-beta" in table[3]
    assert table[3].endswith("  sent to the DLQ by its consumer")  # the reason: none was sent

    out = txmq("dlq", "resend", "--group", "CG", "--id", originals[1].msg_id)
    assert "re-sent 1 message(s) to %RETRY%CG" in out
    assert json.loads(txmq("dlq", "resend", "--group", "CG", "--all", "--json")) == [
        {"group": "CG", "resent": 2}
    ]
    with txsync.PullConsumer(eb.address, "CG") as consumer:
        wait_for(lambda: consumer.max_offset("%RETRY%CG", 0) == 4)
