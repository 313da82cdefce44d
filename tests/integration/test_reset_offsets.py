"""Resetting a consumer group's offsets to a time (RocketMQ's ``resetOffsetByTime``) against
real broker processes: a running push consumer consumes again from the time, the offsets
go to the end for a time in the future and to the oldest for one in the past, mistakes get
clear errors; ``txmq admin group reset-offset`` alone and over a cluster of two broker
sets."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from tests.conftest import BrokerProcess, NamesrvProcess, wait_for
from tests.integration.test_cli import txmq
from txmq import AdminClient, Message, Producer, PullConsumer
from txmq.consumer.push import PushConsumer
from txmq.protocol.message import MessageExt
from txmq.protocol.wire import SearchOffset
from txmq.protocol.wire.errors import GroupNotFound, TopicNotFound

TOPIC, GROUP = "replay", "g-replay"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def _committed(admin: AdminClient, group: str, topic: str) -> dict[tuple[str, int], int]:
    return {
        (o.broker_name, o.queue_id): o.offset
        for o in await admin.offsets()
        if (o.group, o.topic) == (group, topic)
    }


@pytest.mark.anyio
@pytest.mark.parametrize("orderly", [False, True], ids=["concurrently", "orderly"])
async def test_a_running_consumer_consumes_again_from_the_time(
    broker_process: Callable[..., BrokerProcess], orderly: bool
) -> None:
    bp = broker_process().start()
    seen: Counter[bytes] = Counter()
    order: dict[int, list[int]] = {0: [], 1: []}  # queue id -> offsets as consumed

    async def listener(msg: MessageExt) -> None:
        seen[msg.body] += 1
        order[msg.queue_id].append(msg.queue_offset)

    async with AdminClient(bp.address) as admin:
        await admin.create_topic(TOPIC, 2)
        consumer = PushConsumer(
            bp.address, GROUP, listener=listener, persist_interval=0.1, orderly=orderly
        )
        consumer.subscribe(TOPIC)
        await consumer.start()
        try:
            async with Producer(bp.address) as producer:
                first = [await producer.send(Message(TOPIC, b"m%d" % i)) for i in range(1, 11)]
                between = max(r.store_timestamp for r in first) + 1
                with anyio.fail_after(5):
                    while _now_ms() <= between:  # noqa: ASYNC110 (so message 11 is later)
                        await anyio.sleep(0.001)
                rest = [await producer.send(Message(TOPIC, b"m%d" % i)) for i in range(11, 31)]
            assert min(r.store_timestamp for r in rest) > between
            bodies = [b"m%d" % i for i in range(1, 31)]
            ends = {
                ("", q): sum(r.queue_id == q for r in first + rest) for q in (0, 1)
            }  # the max offset of each queue
            with anyio.fail_after(20):  # consumed, and committed up to the end
                while set(seen) != set(bodies) or await _committed(admin, GROUP, TOPIC) != ends:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            assert max(seen.values()) == 1

            # the broker's search by time, queue by queue
            for q in (0, 1):
                request = SearchOffset(topic=TOPIC, queue_id=q, timestamp_ms=between)
                found = await admin.call(request)
                assert found.offset == sum(r.queue_id == q for r in first)

            rows = await admin.reset_offsets(GROUP, TOPIC, between)
            assert [(r.queue_id, r.old_offset, r.new_offset) for r in rows] == [
                (q, ends[("", q)], sum(r.queue_id == q for r in first)) for q in (0, 1)
            ]
            # the running consumer gets messages 11..30 again (and 1..10 not), commits again
            with anyio.fail_after(20):
                while any(seen[b] < 2 for b in bodies[10:]):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            with anyio.fail_after(20):
                while await _committed(admin, GROUP, TOPIC) != ends:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            assert all(seen[b] == 1 for b in bodies[:10]), seen
            assert all(seen[b] == 2 for b in bodies[10:]), seen
            if orderly:  # each queue once in order, then again from the reset, in order
                for q, offsets in order.items():
                    end, back = ends[("", q)], sum(r.queue_id == q for r in first)
                    assert offsets == [*range(end), *range(back, end)], (q, offsets)
        finally:
            await consumer.stop()

        # the group stopped: a time before everything is the oldest message, a time in the
        # future the end; force=False only moves offsets back
        rows = await admin.reset_offsets(GROUP, TOPIC, 0)
        assert [(r.old_offset, r.new_offset) for r in rows] == [(ends[("", q)], 0) for q in (0, 1)]
        rows = await admin.reset_offsets(GROUP, TOPIC, between, force=False)
        assert [r.new_offset for r in rows] == [0, 0]
        rows = await admin.reset_offsets(GROUP, TOPIC, _now_ms() + 3_600_000)
        assert [r.new_offset for r in rows] == [ends[("", q)] for q in (0, 1)]
        assert await _committed(admin, GROUP, TOPIC) == ends

        # mistakes: clear errors, nothing changed
        with pytest.raises(TopicNotFound, match="'no-such-topic' does not exist"):
            await admin.reset_offsets(GROUP, "no-such-topic", between)
        with pytest.raises(GroupNotFound, match="'nobody'"):
            await admin.reset_offsets("nobody", TOPIC, between)
        with pytest.raises(ValueError, match="ms since the epoch"):
            await admin.reset_offsets(GROUP, TOPIC, -5)
        assert await _committed(admin, GROUP, TOPIC) == ends


def _cli(*args: str) -> Any:
    out = txmq("admin", "group", "reset-offset", *args, "--json", check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _one_line_error(*args: str) -> str:
    out = txmq("admin", "group", "reset-offset", *args, check=False)
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("txmq: error: "), out.stderr
    return lines[0]


def test_cli_reset_offset(broker_process: Callable[..., BrokerProcess]) -> None:
    bp = broker_process().start()

    async def seed() -> None:
        async with AdminClient(bp.address) as admin:
            await admin.create_topic("ledger", 1)
        async with Producer(bp.address) as producer:
            for i in range(5):
                await producer.send(Message("ledger", b"e%d" % i))
        async with PullConsumer(bp.address, "audit") as c:
            await c.commit_offset("ledger", 0, 5)

    anyio.run(seed)
    where = ("--group", "audit", "--topic", "ledger")
    # an hour ago (before every message): the oldest; options after the subcommand
    rows = _cli(*where, "--to", "-1h", "--broker", bp.address)
    assert [(r["queue_id"], r["old_offset"], r["new_offset"]) for r in rows] == [(0, 5, 0)]
    assert rows[0]["group"] == "audit" and rows[0]["to"] <= _now_ms() - 3_500_000
    assert "broker_name" not in rows[0] and rows[0]["to_time"].endswith("Z")
    # now, as a table
    out = txmq("admin", "group", "reset-offset", *where, "--to", "now", "--broker", bp.address)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("consumer group audit: offsets of ledger reset to ")
    assert lines[1].split() == ["QUEUE", "OLD", "NEW"] and lines[3].split() == ["0", "0", "5"]
    # ISO 8601 and ms since the epoch, --no-force only moves back
    rows = _cli(*where, "--to", "2000-01-01T00:00:00+01:00", "--no-force", "--broker", bp.address)
    assert rows[0]["new_offset"] == 0 and rows[0]["to"] == 946681200000
    rows = _cli(*where, "--to", str(_now_ms() + 60_000), "--no-force", "--broker", bp.address)
    assert rows[0]["new_offset"] == 0  # forward: not without force
    rows = _cli(*where, "--to", str(_now_ms() + 60_000), "--broker", bp.address)
    assert rows[0]["new_offset"] == 5

    said = _one_line_error(*where, "--to", "yesterday", "--broker", bp.address)
    assert "--to: not a time: 'yesterday'" in said
    said = _one_line_error(
        "--group", "audit", "--topic", "nope", "--to", "now", "--broker", bp.address
    )
    assert "topic 'nope' does not exist" in said
    said = _one_line_error(
        "--group", "ghost", "--topic", "ledger", "--to", "now", "--broker", bp.address
    )
    assert "consumer group 'ghost'" in said
    help_text = txmq("admin", "group", "reset-offset", "--help").stdout
    assert "examples:" in help_text and "--to -1h" in help_text


def test_cli_reset_offset_over_a_cluster(
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
) -> None:
    ns = namesrv_process("ns").start()
    a, b = (cluster_broker(f"broker-{x}", [ns.address]).start() for x in "ab")
    created = txmq("admin", "topic-create", "spread", "--queues", "2", "--namesrv", ns.address)
    assert created.returncode == 0, created.stderr

    def routed() -> bool:
        out = txmq("admin", "route", "spread", "--namesrv", ns.address, "--json", check=False)
        return out.returncode == 0 and len(json.loads(out.stdout)) == 2

    wait_for(routed, timeout=15, interval=0.1)

    async def seed() -> dict[str, int]:
        counts: Counter[str] = Counter()
        async with Producer(namesrv=ns.address) as producer:
            for i in range(12):
                counts[(await producer.send(Message("spread", b"s%d" % i))).broker_name] += 1
        async with PullConsumer(namesrv=ns.address, group="g-spread") as c:
            await c.route("spread")
            for broker in ("broker-a", "broker-b"):
                for q in (0, 1):
                    max_offset = await c.max_offset("spread", q, broker_name=broker)
                    await c.commit_offset("spread", q, max_offset, broker_name=broker)
        return dict(counts)

    counts = anyio.run(seed)
    assert set(counts) == {"broker-a", "broker-b"}
    rows = _cli("--group", "g-spread", "--topic", "spread", "--to", "0", "--namesrv", ns.address)
    assert [(r["broker_name"], r["queue_id"], r["new_offset"]) for r in rows] == [
        (x, q, 0) for x in ("broker-a", "broker-b") for q in (0, 1)
    ]
    assert {
        x: sum(r["old_offset"] for r in rows if r["broker_name"] == x) for x in counts
    } == counts
    # one broker set only
    rows = _cli(
        "--group", "g-spread", "--topic", "spread", "--to", "now",
        "--namesrv", ns.address, "--broker-name", "broker-b",
    )  # fmt: skip
    assert {r["broker_name"] for r in rows} == {"broker-b"}
    assert sum(r["new_offset"] for r in rows) == counts["broker-b"]
    assert a.alive() and b.alive()
