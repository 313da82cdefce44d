"""Push consumers: allocation, exactly-once without failures, SIGKILL of a member,
orderly per-key order across a restart, broadcasting, long polling when idle."""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ROOT, wait_for
from txmq import AdminClient, Message, Producer
from txmq.broker.server import EmbeddedBroker
from txmq.consumer.push import PushConsumer
from txmq.protocol.message import MessageExt
from txmq.sync import Producer as SyncProducer
from txmq.sync import PushConsumer as SyncPushConsumer


@dataclass
class ConsumerProc:
    proc: subprocess.Popen[bytes]
    out: Path
    args: list[str]

    def lines(self) -> list[list[str]]:
        if not self.out.exists():
            return []
        return [ln.split(" ", 6) for ln in self.out.read_text().splitlines()]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def spawn_consumer(tmp_path: Path) -> Iterator[Callable[..., ConsumerProc]]:
    procs: list[ConsumerProc] = []

    def spawn(*args: str, out: Path | None = None) -> ConsumerProc:
        out = out or tmp_path / f"consumer{len(procs)}.log"
        cmd = [sys.executable, str(ROOT / "tests" / "consumer_proc.py"), "--out", str(out), *args]
        log = (tmp_path / f"consumer{len(procs)}.stderr").open("ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        log.close()
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline().strip() == b"READY", "consumer did not start"
        cp = ConsumerProc(proc, out, list(args))
        procs.append(cp)
        return cp

    yield spawn
    for cp in procs:
        if cp.proc.poll() is None:
            cp.proc.kill()
            cp.proc.wait(10)
        if cp.proc.stdout:
            cp.proc.stdout.close()


pytestmark = pytest.mark.anyio


def _held(consumer: PushConsumer, topic: str) -> int:
    return sum(1 for mq in consumer.queues_held if mq.topic == topic)


async def _create(address: str, topic: str, queues: int) -> None:
    async with AdminClient(address) as admin:
        await admin.create_topic(topic, queues)


async def test_three_members_split_8_queues_and_consume_exactly_once(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    await _create(eb.address, "split", 8)
    seen: Counter[str] = Counter()

    async def listener(msg: MessageExt) -> None:
        seen[msg.msg_id] += 1

    consumers = [
        PushConsumer(eb.address, "g-split", listener=listener, instance_name=f"c{i}")
        for i in range(3)
    ]
    for c in consumers:
        c.subscribe("split")
        await c.start()
    try:
        with anyio.fail_after(20):
            while sorted(_held(c, "split") for c in consumers) != [2, 3, 3]:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        held = [q for c in consumers for q in c.queues_held if q.topic == "split"]
        assert sorted((q.topic, q.queue_id) for q in held) == [("split", q) for q in range(8)]
        sent = set()
        async with Producer(eb.address) as producer:
            for i in range(400):
                sent.add((await producer.send(Message("split", f"m{i}".encode()))).msg_id)
        with anyio.fail_after(20):
            while set(seen) != sent:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert max(seen.values()) == 1, "a message was consumed twice with nothing failing"
    finally:
        for c in consumers:
            await c.stop()


async def test_failing_background_rounds_do_not_end_the_consumer(
    embedded_broker: Callable[..., EmbeddedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    """A rebalance, an offset persist and a lock renewal that fail in a way nobody
    foresaw (a bug: here a ValueError in the first round of each) are logged with their
    stack and run again at their next round; the consumer goes on consuming (such a
    failure used to end its task group, and with it every pull)."""
    eb = embedded_broker()
    await _create(eb.address, "rounds", 2)
    seen: list[bytes] = []

    async def listener(msg: MessageExt) -> None:
        seen.append(msg.body)

    c = PushConsumer(
        eb.address,
        "g-rounds",
        listener=listener,
        orderly=True,  # (its queues are locked, and their locks renewed)
        rebalance_interval=0.05,
        persist_interval=0.05,
        lock_renew_interval=0.05,
    )
    c.subscribe("rounds")
    rounds: Counter[str] = Counter()

    def failing_once(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(*args: Any) -> Any:
            rounds[name] += 1
            if rounds[name] == 1:
                raise ValueError(f"a bug in {name}")
            return await fn(*args)

        return wrapped

    await c.start()
    try:
        with anyio.fail_after(20):  # its queues held and locked: no lock is taken in a rebalance
            while _held(c, "rounds") < 2:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        pulling = c.pulling
        assert pulling is not None
        pulling.rebalance = failing_once("rebalance", pulling.rebalance)  # type: ignore[method-assign]
        c.offsets.persist = failing_once("persist", c.offsets.persist)  # type: ignore[method-assign]
        pulling.lock = failing_once("lock", pulling.lock)  # type: ignore[method-assign]
        with anyio.fail_after(20):
            while min(rounds[n] for n in ("rebalance", "persist", "lock")) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        async with Producer(eb.address) as producer:
            for i in range(5):
                await producer.send(Message("rounds", b"m%d" % i))
        with anyio.fail_after(20):
            while len(seen) < 5:  # noqa: ASYNC110
                await anyio.sleep(0.02)
    finally:
        await c.stop()
    assert sorted(seen) == [b"m%d" % i for i in range(5)]
    for what in ("rebalance", "persisting offsets", "renewing queue locks"):
        assert f"{what} failed unexpectedly" in caplog.text


def test_sigkill_of_a_member_moves_its_queues(
    embedded_broker: Callable[..., EmbeddedBroker],
    spawn_consumer: Callable[..., ConsumerProc],
) -> None:
    eb = embedded_broker()
    anyio.run(_create, eb.address, "kill", 8)
    common = [
        "--broker",
        eb.address,
        "--group",
        "g-kill",
        "--topic",
        "kill",
        "--rebalance-interval",
        "2",
        "--persist-interval",
        "0.5",
    ]
    procs = [spawn_consumer(*common, "--instance", f"k{i}") for i in range(3)]
    sent: list[str] = []
    killed_at = 0.0
    with SyncProducer(eb.address) as producer:
        for i in range(3000):
            sent.append(producer.send(Message("kill", f"m{i}".encode())).msg_id)
            if i == 1000:
                wait_for(lambda: len(procs[0].lines()) > 50)
                procs[0].kill()
                killed_at = time.time()
            if i % 100 == 0:
                time.sleep(0.05)  # a steady stream, not one burst
    survivors = procs[1:]

    def all_consumed() -> bool:
        got = {ln[1] for p in procs for ln in p.lines()}
        return got >= set(sent)

    wait_for(all_consumed, timeout=60)
    counts = Counter(ln[1] for p in procs for ln in p.lines())
    duplicates = sum(n - 1 for n in counts.values())
    print(f"duplicates after SIGKILL: {duplicates}")
    assert duplicates < 1000
    killed_queues = {int(ln[3]) for ln in procs[0].lines()}
    assert killed_queues
    for q in killed_queues:
        resumed = min(
            float(ln[0])
            for p in survivors
            for ln in p.lines()
            if int(ln[3]) == q and float(ln[0]) >= killed_at
        )
        assert resumed - killed_at < 2 + 3, f"queue {q} resumed {resumed - killed_at:.1f}s later"


def test_orderly_keeps_per_key_order_across_a_restart(
    embedded_broker: Callable[..., EmbeddedBroker],
    spawn_consumer: Callable[..., ConsumerProc],
) -> None:
    eb = embedded_broker(lock_expiry_s=3.0)
    anyio.run(_create, eb.address, "ordered", 8)
    common = [
        "--broker",
        eb.address,
        "--group",
        "g-order",
        "--topic",
        "ordered",
        "--orderly",
        "--rebalance-interval",
        "1",
        "--persist-interval",
        "0.5",
        "--lock-renew-interval",
        "1",
        "--consume-delay",
        "0.001",
    ]
    a = spawn_consumer(*common, "--instance", "oa")
    b = spawn_consumer(*common, "--instance", "ob")
    with SyncProducer(eb.address) as producer:
        for seq in range(50):
            for k in range(100):
                producer.send(Message("ordered", f"key{k}:{seq}".encode()), sharding_key=f"key{k}")
    wait_for(lambda: len(a.lines()) + len(b.lines()) > 1500, timeout=60)
    a.kill()
    a2 = spawn_consumer(*common, "--instance", "oa", out=a.out)

    def firsts() -> dict[str, list[int]]:
        order: dict[str, list[int]] = defaultdict(list)
        seen: set[str] = set()
        rows = sorted((float(ln[0]), ln[6]) for p in (a2, b) for ln in p.lines())
        for _, body in rows:
            if body not in seen:
                seen.add(body)
                key, seq = body.split(":")
                order[key].append(int(seq))
        return order

    wait_for(lambda: sum(len(v) for v in firsts().values()) == 5000, timeout=90)
    for key, seqs in firsts().items():
        assert seqs == list(range(50)), f"{key} consumed out of order: {seqs}"


async def test_broadcasting_every_member_gets_everything_and_offsets_survive(
    embedded_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    eb = embedded_broker()
    await _create(eb.address, "bcast", 4)
    got: dict[str, list[str]] = defaultdict(list)

    def make(name: str) -> PushConsumer:
        async def listener(msg: MessageExt) -> None:
            got[name].append(msg.body.decode())

        c = PushConsumer(
            eb.address,
            "g-bcast",
            listener=listener,
            message_model="BROADCASTING",
            instance_name=name,
            offset_dir=tmp_path / "offsets",
            consume_from="FIRST_OFFSET",
        )
        c.subscribe("bcast")
        return c

    consumers = {n: make(n) for n in ("b0", "b1", "b2")}
    for c in consumers.values():
        await c.start()
    async with Producer(eb.address) as producer:
        for i in range(100):
            await producer.send(Message("bcast", f"m{i}".encode()))
        with anyio.fail_after(20):
            while any(len(got[n]) < 100 for n in consumers):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert all(sorted(got[n]) == sorted(f"m{i}" for i in range(100)) for n in consumers)
        await consumers["b0"].stop()
        for i in range(100, 150):
            await producer.send(Message("bcast", f"m{i}".encode()))
    restarted = make("b0")
    await restarted.start()
    try:
        with anyio.fail_after(20):
            while len(got["b0"]) < 150 or len(got["b1"]) < 150:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert sorted(got["b0"]) == sorted(f"m{i}" for i in range(150)), "old messages replayed"
    finally:
        await restarted.stop()
        await consumers["b1"].stop()
        await consumers["b2"].stop()


async def test_idle_consumer_does_not_busy_poll_and_gets_messages_at_once(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    await _create(eb.address, "idle", 4)
    arrived = anyio.Event()
    received_at: list[float] = []

    async def listener(msg: MessageExt) -> None:
        received_at.append(time.perf_counter())
        arrived.set()

    consumer = PushConsumer(eb.address, "g-idle", listener=listener)
    consumer.subscribe("idle")
    pulls = 0
    real_pull = consumer.puller.pull

    async def counting_pull(*args: object, **kwargs: object) -> object:
        nonlocal pulls
        pulls += 1
        return await real_pull(*args, **kwargs)  # type: ignore[arg-type]

    consumer.puller.pull = counting_pull  # type: ignore[method-assign]
    async with consumer:
        with anyio.fail_after(10):
            while len(consumer.queues_held) < 5:  # noqa: ASYNC110 - 4 queues + retry topic
                await anyio.sleep(0.01)
        await anyio.sleep(2)
        idle_pulls = pulls
        assert idle_pulls <= 2 * 5, f"{idle_pulls} pulls in 2 s of idling"
        async with Producer(eb.address) as producer:
            sent_at = time.perf_counter()
            await producer.send(Message("idle", b"ping"))
        with anyio.fail_after(5):
            await arrived.wait()
    latency_ms = (received_at[0] - sent_at) * 1000
    assert latency_ms < 100, f"delivered {latency_ms:.1f} ms after send"


def test_sync_facade_with_a_plain_function_listener(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    got: list[bytes] = []
    all_in = threading.Event()

    def listener(msg: MessageExt) -> None:  # runs in a worker thread
        got.append(msg.body)
        if len(got) == 20:
            all_in.set()

    with SyncProducer(eb.address) as producer:
        for i in range(20):
            producer.send(Message("sync-topic", f"s{i}".encode()))
    consumer = SyncPushConsumer(
        eb.address, "g-sync", listener=listener, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("sync-topic")
    with consumer:
        assert all_in.wait(10)
        assert len(consumer.queues_held()) == 5
    assert sorted(got) == sorted(f"s{i}".encode() for i in range(20))


async def test_tag_subscription_filters_on_the_broker(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    await _create(eb.address, "tagged", 2)
    got: list[str] = []
    done = anyio.Event()

    async def listener(msg: MessageExt) -> None:
        got.append(f"{msg.tags}:{msg.body.decode()}")
        if len(got) == 20:
            done.set()

    consumer = PushConsumer(eb.address, "g-tags", listener=listener, consume_from="FIRST_OFFSET")
    consumer.subscribe("tagged", "paid || shipped")
    async with Producer(eb.address) as producer:
        for i in range(30):
            tag = ("created", "paid", "shipped")[i % 3]
            await producer.send(Message("tagged", str(i).encode(), tags=tag))
    async with consumer:
        with anyio.fail_after(10):
            await done.wait()
    assert sorted(got) == sorted(
        f"{('created', 'paid', 'shipped')[i % 3]}:{i}" for i in range(30) if i % 3
    )


@pytest.mark.parametrize("orderly", [False, True])
async def test_a_topic_created_after_subscribing_is_consumed_at_once(
    embedded_broker: Callable[..., EmbeddedBroker], orderly: bool
) -> None:
    """The broker tells a topic's subscribed groups when it appears (or changes its queue
    count), so its first consumers don't wait for their periodic rebalance (60 s here)."""
    b = embedded_broker()
    got = anyio.Event()

    async def listener(msg: MessageExt) -> None:
        got.set()

    consumer = PushConsumer(
        b.address,
        "late-topic",
        listener=listener,
        orderly=orderly,
        consume_from="FIRST_OFFSET",
        rebalance_interval=60.0,
    )
    consumer.subscribe("born-later")
    async with consumer:
        assert not any(mq.topic == "born-later" for mq in consumer.queues_held)
        async with Producer(b.address) as producer:
            await producer.send(Message("born-later", b"first"))  # auto-creates the topic
        with anyio.fail_after(10):
            await got.wait()
        async with AdminClient(b.address) as admin:
            await admin.create_topic("born-later", 6)  # more queues: taken at once too
        with anyio.fail_after(10):
            while len([q for q in consumer.queues_held if q.topic == "born-later"]) != 6:  # noqa: ASYNC110
                await anyio.sleep(0.02)


async def test_a_subscription_to_a_topic_with_no_route_warns_once(
    embedded_broker: Callable[..., EmbeddedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    b = embedded_broker()
    got = anyio.Event()

    async def listener(msg: MessageExt) -> None:
        got.set()

    consumer = PushConsumer(b.address, "unrouted-g", listener=listener,
                            consume_from="FIRST_OFFSET", rebalance_interval=60.0)  # fmt: skip
    consumer.subscribe("unrouted")

    def no_route_warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and "has no route" in r.getMessage()
        ]

    with caplog.at_level(logging.DEBUG, logger="txmq.consumer"):
        async with consumer:
            for _ in range(3):  # rebalance after rebalance finds no route: said once
                await consumer.rebalance()
            assert no_route_warnings() == [
                "topic unrouted has no route: no broker holds it (yet); group unrouted-g "
                "consumes it once one does"
            ]
            await _create(b.address, "unrouted", 2)
            await consumer.rebalance()
            assert _held(consumer, "unrouted") == 2
            async with Producer(b.address) as producer:
                await producer.send(Message("unrouted", b"at last"))
            with anyio.fail_after(10):
                await got.wait()
    assert len(no_route_warnings()) == 1
