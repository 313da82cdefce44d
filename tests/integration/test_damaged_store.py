"""A record damaged on disk under a running broker process (issue 16, item 7): the broker
checks each record it serves, skips and reports a damaged one, and no consumer dies of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from tests.conftest import BrokerProcess, wait_for
from tests.integration.test_cli import admin_json, txmq
from txmq import Message
from txmq.message import MessageExt
from txmq.sync import AdminClient, Producer, PullConsumer, PushConsumer

TOPIC = "bitrot"


def _flip_in_body(store: Path, body: bytes) -> None:
    """Change one byte of the stored record whose body is ``body``."""
    for seg in sorted((store / "commitlog").iterdir()):
        data = seg.read_bytes()
        at = data.find(body)
        if at >= 0:
            with seg.open("r+b") as f:
                f.seek(at + len(body) // 2)
                f.write(bytes([data[at + len(body) // 2] ^ 0x10]))
            return
    raise AssertionError(f"{body!r} is in no segment")


def test_a_damaged_record_is_skipped_and_reported_and_consumers_go_on(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    bp = broker_process().start()
    bodies = [b"record-%03d-" % i + b"x" * 200 for i in range(60)]
    with Producer(bp.address) as p:
        sent = [p.send(Message(TOPIC, body), queue_id=0) for body in bodies]
    victim = sent[20]
    _flip_in_body(tmp_path / "store", bodies[20])  # the broker reads it from the page cache

    with PullConsumer(bp.address) as c:
        one = c.pull(TOPIC, 0, victim.queue_offset, max_msgs=1, long_poll=0)
        assert one.messages == [] and one.next_offset == victim.queue_offset + 1
        got, offset = [], 0
        while offset < len(bodies):
            r = c.pull(TOPIC, 0, offset, long_poll=0)
            got += r.messages
            offset = r.next_offset
    assert [m.body for m in got] == bodies[:20] + bodies[21:]

    received: list[MessageExt] = []
    lock = threading.Lock()

    def listener(msg: MessageExt) -> None:
        with lock:
            received.append(msg)

    consumer = PushConsumer(
        bp.address, "bitrot-readers", listener=listener, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe(TOPIC)
    with consumer, Producer(bp.address) as p:
        wait_for(lambda: len(received) >= 59, timeout=30)
        later = [p.send(Message(TOPIC, b"later-%d" % i)).msg_id for i in range(8)]
        wait_for(lambda: {m.msg_id for m in received} >= set(later), timeout=30)
    assert {m.body for m in received} == set(bodies[:20] + bodies[21:]) | {
        b"later-%d" % i for i in range(8)
    }

    with AdminClient(bp.address) as admin:
        info = admin.runtime_info()
    assert info.store_damage_count == 1, info
    [line] = info.store_damage
    assert "corrupt record at commit-log offset" in line
    assert f"{TOPIC}/0 queue offset {victim.queue_offset}: CRC mismatch" in line
    assert bp.output().count("store damage: corrupt record") == 1
    shown = txmq("admin", "broker-info", "--broker", bp.address).stdout
    assert "store_damage_count" in shown and line in shown
    [as_json] = admin_json(bp.address, "broker-info")
    assert as_json["store_damage"] == [line]
    assert bp.terminate() == 0, bp.output()[-3000:]
