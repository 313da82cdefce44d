"""Crash safety: SIGKILL under SYNC flush, torn tails, and checkpointed clean restarts."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.conftest import BrokerProcess
from txmq import Message, Producer, PullConsumer, PullStatus, TxmqError
from txmq.protocol.message import MessageExt

pytestmark = pytest.mark.anyio


async def _read_topic(address: str, topic: str, group: str = "reader") -> list[MessageExt]:
    out: list[MessageExt] = []
    async with PullConsumer(address, group) as consumer:
        for qid in await consumer.queues(topic):
            offset = 0
            while True:
                # decode_records verifies every record's CRC: a corrupt one raises here
                res = await consumer.pull(topic, qid, offset, max_msgs=512, long_poll=0)
                if res.status != PullStatus.FOUND:
                    break
                out.extend(res.messages)
                offset = res.next_offset
    return out


async def test_sigkill_under_sync_flush_loses_no_acknowledged_message(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process("--flush", "sync", "--segment-size", str(8 * 1024 * 1024)).start()
    acked: dict[str, bytes] = {}
    target = 4000
    enough = anyio.Event()

    async with Producer(bp.address, retry_times=0, send_timeout=5) as producer:

        async def worker(w: int) -> None:
            i = 0
            while True:
                body = f"worker {w} message {i} ".encode() * 8
                try:
                    r = await producer.send(Message("crash", body, keys=[f"w{w}-{i}"]))
                except TxmqError:
                    return
                acked[r.msg_id] = body
                if len(acked) >= target:
                    enough.set()
                i += 1

        async with anyio.create_task_group() as tg:
            for w in range(16):
                tg.start_soon(worker, w)
            with anyio.fail_after(60):
                await enough.wait()
            bp.kill()  # SIGKILL while the 16 workers are still sending
    assert len(acked) >= target

    bp.start()
    assert "NOT clean" in bp.output()
    stored = await _read_topic(bp.address, "crash")
    by_id = {m.msg_id: m.body for m in stored}
    missing = [mid for mid in acked if mid not in by_id]
    assert not missing, f"{len(missing)} acknowledged messages lost"
    assert all(by_id[mid] == body for mid, body in acked.items())
    assert bp.terminate() == 0


def _last_segment(store: Path) -> Path:
    return sorted((store / "commitlog").iterdir())[-1]


async def test_torn_tail_is_truncated_with_a_log_line(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    async with Producer(bp.address) as producer:
        for i in range(200):
            await producer.send(Message("torn", f"m{i}".encode()), queue_id=0)
    assert bp.terminate() == 0

    seg = _last_segment(bp.store)
    size = seg.stat().st_size
    with seg.open("ab") as fh:
        fh.write(os.urandom(1000))
    bp.start()
    assert re.search(r"truncat\w* 1000 bytes", bp.output(), re.I), bp.output()
    msgs = await _read_topic(bp.address, "torn")
    assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(200)]
    assert bp.terminate() == 0
    assert seg.stat().st_size == size

    # flip one byte inside the last record and lose the checkpoint (as a crash between a
    # write and its checkpoint would): recovery scans from the start, the CRC fails on the
    # last record, and it alone is cut off
    with seg.open("r+b") as fh:
        fh.seek(size - 10)
        b = fh.read(1)
        fh.seek(size - 10)
        fh.write(bytes([b[0] ^ 0xFF]))
    (bp.store / "checkpoint").unlink()
    bp.start()
    assert re.search(r"CRC", bp.output()), bp.output()
    msgs = await _read_topic(bp.address, "torn")
    assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(199)]
    async with Producer(bp.address) as producer:
        r = await producer.send(Message("torn", b"after"), queue_id=0)
    assert r.queue_offset == 199
    assert bp.terminate() == 0


async def test_clean_restart_uses_the_checkpoint(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    async with Producer(bp.address) as producer:
        for i in range(500):
            await producer.send(Message("ckpt", f"m{i}".encode(), keys=[f"k{i}"]), queue_id=i % 4)
    async with PullConsumer(bp.address, "g1") as c:
        await c.commit_offset("ckpt", 0, 42)
    assert bp.terminate() == 0

    bp.start()
    last_open = bp.output().rsplit("store ", 1)[-1]
    assert "previous stop clean" in last_open and "re-dispatched 0 records" in last_open, last_open
    async with PullConsumer(bp.address, "g1") as c:
        assert await c.fetch_offset("ckpt", 0) == 42
        assert [await c.max_offset("ckpt", q) for q in range(4)] == [125, 125, 125, 125]
    async with Producer(bp.address) as producer:
        r = await producer.send(Message("ckpt", b"next"), queue_id=3)
    assert r.queue_offset == 125
    assert len(await _read_topic(bp.address, "ckpt")) == 501
    assert bp.terminate() == 0
