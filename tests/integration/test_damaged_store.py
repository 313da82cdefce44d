"""A store damaged on disk, with a broker process (issue 16, items 7 and 8): the broker
checks each record it serves, skips and reports a damaged one, and no consumer dies of it;
a segment missing or cut short is a WARNING at start and shown by ``txmq admin
broker-info``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess, wait_for
from tests.integration.test_cli import admin_json, txmq
from txmq import Message
from txmq.protocol.message import MessageExt
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


#: a broker whose commit log rolls every 128 KiB, with no Parquet exports beside it
SMALL_SEGMENTS = {
    "TXMQ_BROKER_SEGMENT_SIZE": str(128 * 1024),
    "TXMQ_BROKER_MAX_MESSAGE_SIZE": str(64 * 1024),
    "TXMQ_BROKER_EXPORT_SEGMENTS": "false",
}


def _where(segments: list[Path], body: bytes) -> tuple[Path, int]:
    """The segment holding ``body``, and where in it."""
    for seg in segments:
        at = seg.read_bytes().find(body)
        if at >= 0:
            return seg, at
    raise AssertionError(f"{body[:20]!r} is in no segment")


def _read_queue(address: str, topic: str, queue_id: int) -> list[bytes]:
    bodies: list[bytes] = []
    with PullConsumer(address, "segment-check") as c:
        offset = c.min_offset(topic, queue_id)
        while offset < c.max_offset(topic, queue_id):
            got = c.pull(topic, queue_id, offset, max_msgs=64, long_poll=0)
            assert got.next_offset > offset
            bodies += [m.body for m in got.messages]
            offset = got.next_offset
    return bodies


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        ("newest deleted", "commit log short of checkpoint"),
        ("middle deleted", "missing segment"),
        ("middle cut short", "short segment"),
    ],
)
def test_a_missing_or_short_segment_is_a_warning_and_shown_by_broker_info(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path, damage: str, kind: str
) -> None:
    """Segments the checkpoint knew, deleted or cut after a clean stop: the broker starts,
    says so in one WARNING, lists it in ``txmq admin broker-info`` (table and JSON), and
    serves every record of the other segments (issue 16, item 8)."""
    bp = broker_process()
    bp.env = dict(SMALL_SEGMENTS)
    bp.start()
    bodies = [b"seg-%04d-" % i + b"z" * 1000 for i in range(500)]
    with Producer(bp.address) as p:
        for body in bodies:
            p.send(Message("segments", body), queue_id=0)
    assert bp.terminate() == 0, bp.output()[-3000:]  # a clean stop: the checkpoint knows all

    segments = sorted((tmp_path / "store" / "commitlog").iterdir())
    assert len(segments) >= 4, segments
    where = {body: _where(segments, body) for body in bodies}
    victim = segments[-1] if damage == "newest deleted" else segments[1]
    cut = victim.stat().st_size // 2 if damage == "middle cut short" else 0
    if cut:
        with victim.open("r+b") as f:
            f.truncate(cut)
    else:
        victim.unlink()
    # the records that must survive: wholly in another segment, or before the cut
    kept = [b for b in bodies if where[b][0] != victim or where[b][1] + len(b) + 200 < cut]
    lost = [b for b in bodies if where[b][0] == victim and where[b][1] >= cut]
    assert kept and lost

    logged = len(bp.output())
    bp.start()
    lines = bp.output()[logged:].splitlines()
    warnings = [line for line in lines if " WARNING " in line and "store damage: " in line]
    assert len(warnings) == 1, "\n".join(lines[-40:])
    assert f"store damage: {kind} at commit-log offset" in warnings[0]
    assert victim.name in warnings[0] or damage == "newest deleted", warnings[0]

    with AdminClient(bp.address) as admin:
        info = admin.runtime_info()
    assert info.store_damage_count == 1, info
    [entry] = info.store_damage
    assert f"{kind} at commit-log offset" in entry
    shown = txmq("admin", "broker-info", "--broker", bp.address).stdout
    assert "store_damage_count" in shown and entry in shown, shown
    [as_json] = admin_json(bp.address, "broker-info")
    assert as_json["store_damage_count"] == 1 and as_json["store_damage"] == [entry]

    read = _read_queue(bp.address, "segments", 0)
    assert set(kept) <= set(read) and not set(lost) & set(read)
    with Producer(bp.address) as p:  # and it takes new messages
        p.send(Message("segments", b"after the damage"), queue_id=0)
    assert _read_queue(bp.address, "segments", 0)[-1] == b"after the damage"
    print(f"{damage}: {len(read)} of {len(bodies)} records kept; {warnings[0]}")
    assert bp.terminate() == 0, bp.output()[-3000:]


@pytest.mark.parametrize("damage", ["newest deleted", "newest cut mid-record"])
def test_acknowledged_messages_lost_after_a_sigkill_are_counted_and_shown(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path, damage: str
) -> None:
    """A broker SIGKILLed, then its newest segment deleted or cut in the middle of a
    record (issue 32, item 6): the consume queues said those messages were stored, so the
    restarted broker says how many are gone, and where, in one WARNING line, and counts
    them in ``broker-info`` and the metrics."""
    bp = broker_process()
    bp.env = dict(SMALL_SEGMENTS)
    bp.start()
    bodies = [b"kill-%04d-" % i + b"k" * 1000 for i in range(400)]
    with Producer(bp.address) as p:
        for body in bodies:  # each acknowledged
            p.send(Message("segments", body), queue_id=0)
    bp.kill()  # SIGKILL: the page cache keeps every byte, the checkpoint is older

    segments = sorted((tmp_path / "store" / "commitlog").iterdir())
    assert len(segments) >= 3, segments
    victim = segments[-1]
    where = {body: _where(segments, body) for body in bodies}
    inside = sorted((at, b) for b, (seg, at) in where.items() if seg == victim)
    if damage == "newest deleted":
        victim.unlink()
        lost = [b for _, b in inside]
    else:  # cut in the middle of its fifth record
        cut = inside[4][0] + 300
        with victim.open("r+b") as f:
            f.truncate(cut)
        lost = [b for at, b in inside if at + len(b) > cut]
    assert lost

    logged = len(bp.output())
    bp.start()
    lines = bp.output()[logged:].splitlines()
    warnings = [line for line in lines if " WARNING " in line and "store damage: " in line]
    assert len(warnings) == 1, "\n".join(lines[-40:])
    said = f"acknowledged messages are lost, {len(lost)} known from the consume queues"
    assert said in warnings[0], warnings[0]
    assert "segments/0 queue offsets" in warnings[0]

    with AdminClient(bp.address) as admin:
        info = admin.runtime_info()
    assert info.store_damage_count == 1 and info.store_lost_messages == len(lost), info
    [as_json] = admin_json(bp.address, "broker-info")
    assert as_json["store_lost_messages"] == len(lost)
    read = _read_queue(bp.address, "segments", 0)
    assert read == bodies[: len(bodies) - len(lost)]
    assert bp.terminate() == 0, bp.output()[-3000:]
