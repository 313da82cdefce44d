"""The acceptance test of "no duplicates from send retries": a broker SIGKILLed 30 times at
random moments under SYNC flush while 256 sends are in flight from a producer that retries
(``retry_times=2``, and the sender sends a failed message again, with the same id, until it
is acknowledged: as the outbox relay does).  Afterwards every acknowledged message is in
the topic exactly once, where its acknowledgement said, and no message is there twice."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import pytest

from tests.conftest import BrokerProcess, free_port
from tests.integration.test_dedupe import Resent, read_topic
from txmq import Producer, SendResult, TxmqError
from txmq.protocol.message import new_message_id

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TOPIC = "faults"
KILLS = 30
IN_FLIGHT = 256
#: a message not acknowledged within this long fails the test
SEND_DEADLINE_S = 60.0


@dataclass
class Outcome:
    acked: dict[str, SendResult] = field(default_factory=dict)
    #: sends the sender repeated after the producer gave up (its own retries not counted)
    resent: int = 0
    #: the producer's own retries (same message id, after a failed attempt)
    retried: int = 0
    stored: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    misplaced: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def run_kills(bp: BrokerProcess, kills: int, seed: int = 42) -> Outcome:
    """Send through ``kills`` SIGKILLs of ``bp`` (restarted each time); read the topic."""
    rng = random.Random(seed)
    out = Outcome()
    began = time.monotonic()

    class CountRetries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage():
                out.retried += 1

    counter = CountRetries()
    logging.getLogger("txmq.producer").addHandler(counter)
    try:
        stop = False
        count = 0
        async with Producer(bp.address, "faults", retry_times=2, send_timeout=3) as producer:

            async def sender() -> None:
                nonlocal count
                while not stop:
                    count += 1
                    msg = Resent(TOPIC, f"message {count} ".encode() * 8, msg_id=new_message_id())
                    deadline = time.monotonic() + SEND_DEADLINE_S
                    tries = 0
                    while True:
                        tries += 1
                        try:
                            result = await producer.send(msg)
                            break
                        except TxmqError as exc:
                            if not exc.retriable or time.monotonic() > deadline:
                                raise
                        await anyio.sleep(0.2)  # the broker is down: it comes back
                    out.resent += tries - 1
                    out.acked[msg.msg_id] = result

            async def progress(n: int) -> None:
                goal = len(out.acked) + n
                with anyio.fail_after(30):
                    for _ in range(3000):
                        if len(out.acked) >= goal:
                            return
                        await anyio.sleep(0.01)

            with anyio.fail_after(200):
                async with anyio.create_task_group() as tg:
                    for _ in range(IN_FLIGHT):
                        tg.start_soon(sender)
                    for _ in range(kills):
                        await progress(IN_FLIGHT)  # sending at full speed again
                        await anyio.sleep(rng.uniform(0, 0.5))
                        bp.kill()  # SIGKILL, by PID
                        await anyio.to_thread.run_sync(bp.start)
                    await progress(IN_FLIGHT)
                    stop = True
    finally:
        logging.getLogger("txmq.producer").removeHandler(counter)
    out.seconds = time.monotonic() - began
    stored = await read_topic(bp.address, TOPIC)
    out.stored = len(stored)
    copies = Counter(m.msg_id for m in stored)
    out.duplicated = [mid for mid, n in copies.items() if n > 1]
    where = {m.msg_id: (m.queue_id, m.queue_offset) for m in stored}
    out.lost = [mid for mid in out.acked if mid not in where]
    out.misplaced = [
        mid
        for mid, r in out.acked.items()
        if mid in where and where[mid] != (r.queue_id, r.queue_offset)
    ]
    return out


@pytest.mark.timeout(300)
async def test_30_sigkills_under_sync_flush_lose_nothing_and_duplicate_nothing(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process(
        "--flush", "sync", "--port", str(free_port()), "--segment-size", str(16 * 1024 * 1024)
    ).start()
    out = await run_kills(bp, KILLS)
    print(
        f"{KILLS} kills in {out.seconds:.0f} s: {len(out.acked)} acknowledged, {out.stored} "
        f"stored, {out.retried} retried by the producer and {out.resent} more sent again "
        f"by the sender after a failed send, {len(out.lost)} lost, "
        f"{len(out.duplicated)} duplicated"
    )
    assert bp.output().count("NOT clean") >= KILLS
    # sends did fail and went again with the same id: the producer's own retries (which wait
    # for a broker restarted within their time-out) or, after those, the sender's
    assert out.retried + out.resent > 0
    assert not out.lost, f"{len(out.lost)} acknowledged messages lost"
    assert not out.duplicated, f"{len(out.duplicated)} messages stored twice"
    assert not out.misplaced, f"{len(out.misplaced)} acknowledged at another place"
    assert out.stored == len(out.acked)
    assert bp.terminate() == 0
