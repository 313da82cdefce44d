"""Shared by the console's tests: a broker process with data of every kind the pages show
(messages with a ``<script>`` body, JSON, binary and huge bodies; a consumer group with
offsets; a dead letter; an undecided and a parked half message), and the console served by
``txmq console`` in a process of its own (for the browser)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ROOT, BrokerProcess, free_port
from txmq import (
    AdminClient,
    LocalTransactionState,
    Message,
    MessageExt,
    Producer,
    PullConsumer,
    PullStatus,
    TransactionProducer,
)
from txmq.client.core import BrokerClient
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.protocol.wire.errors import TopicNotFound

#: why the console's tests skip (until pyproject.toml's dev extra installs the console extra)
NO_EXTRA = "the console extra is not installed: pip install 'txmq[console]'"

SCRIPT_BODY = b"<script>alert('pwned')</script>"
JSON_BODY = b'{"order": 42, "items": ["a<b>", "c&d"]}'
BINARY_BODY = bytes(range(256))
BIG_BODY = b"y" * 200_000
#: the broker checks undecided halves quickly and parks them after one check
FAST_PARKING = {
    "TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "0.2",
    "TXMQ_BROKER_TRANSACTION_CHECK_MAX": "1",
}


class Unknown:
    """A transaction listener that never knows (so halves stay undecided)."""

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN


@dataclass
class Seeded:
    address: str
    script_id: str
    json_id: str
    binary_id: str
    big_id: str
    #: a dead letter of consumer group "billing" (first sent to "invoices")
    dead_id: str
    #: an undecided half of producer group "tx-console" (topic "payments")
    pending_id: str
    #: a parked half of producer group "tx-parking" (topic "payments")
    parked_id: str
    #: the broker's process
    broker: BrokerProcess | None = None


async def _seed(address: str) -> Seeded:
    async with Producer(address) as p:
        script = await p.send(Message("orders", SCRIPT_BODY, keys=["evil<key>"]), queue_id=0)
        as_json = await p.send(Message("orders", JSON_BODY, keys=["order-42"]), queue_id=0)
        binary = await p.send(Message("orders", BINARY_BODY, keys=["bin"]), queue_id=1)
        big = await p.send(Message("orders", BIG_BODY, keys=["big"]), queue_id=1)
        await p.send(Message("invoices", b"invoice 7", keys=["inv-7"]), queue_id=0)
    async with PullConsumer(address, "shipping") as c:
        await c.commit_offset("orders", 0, 1)  # consumed the <script> one, not the JSON one
        await c.commit_offset("orders", 1, 0)
    async with PullConsumer(address, "billing") as c, BrokerClient(address) as raw:
        [dead] = (await c.pull("invoices", 0, 0, long_poll=0)).messages
        await raw.call(
            ConsumerSendMsgBack(
                group="billing",
                commit_log_offset=dead.commit_log_offset,
                delay_level=-1,
                max_reconsume_times=16,
                origin_msg_id=dead.msg_id,
            )
        )
    async with TransactionProducer(address, "tx-console", listener=Unknown()) as tp:
        pending = await tp.send_half(
            Message("payments", b"payment 9", keys=["pay-9"]),
            transaction_id="T-9",
            check_immunity_s=3600,
        )
    async with TransactionProducer(address, "tx-parking", listener=Unknown()) as tp:
        parked = await tp.send_half(
            Message("payments", b"stuck payment", keys=["stuck"]),
            transaction_id="T-P",
            check_immunity_s=0.1,
        )
        async with AdminClient(address) as admin:
            for _ in range(400):
                if await admin.transactions("parked"):
                    break
                await anyio.sleep(0.05)
            else:
                raise AssertionError("the half message was not parked")
    return Seeded(
        address=address,
        script_id=script.msg_id,
        json_id=as_json.msg_id,
        binary_id=binary.msg_id,
        big_id=big.msg_id,
        dead_id=dead.msg_id,
        pending_id=pending.msg_id,
        parked_id=parked.msg_id,
    )


def read_topic(address: str, topic: str, group: str = "reader") -> list[MessageExt]:
    """Every message of ``topic`` as a consumer of ``group`` pulls it."""

    async def go() -> list[MessageExt]:
        out: list[MessageExt] = []
        async with PullConsumer(address, group) as consumer:
            try:
                queues = await consumer.queues(topic)
            except TopicNotFound:
                return out
            for qid in queues:
                offset = 0
                while True:
                    res = await consumer.pull(topic, qid, offset, max_msgs=256, long_poll=0)
                    if res.status != PullStatus.FOUND:
                        break
                    out.extend(res.messages)
                    offset = res.next_offset
        return out

    return anyio.run(go)


@pytest.fixture
def seeded(broker_process: Callable[..., BrokerProcess]) -> Iterator[Seeded]:
    bp = broker_process()
    bp.env.update(FAST_PARKING)
    bp.start()
    seeded = anyio.run(_seed, bp.address)
    seeded.broker = bp
    yield seeded


@dataclass
class ConsoleProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def console_process(tmp_path: Path) -> Iterator[Callable[..., ConsoleProcess]]:
    """Factory: ``console_process(*cli_args)`` runs ``txmq console`` on a free port."""
    started: list[ConsoleProcess] = []

    def start(*args: str) -> ConsoleProcess:
        port = free_port()
        log_path = tmp_path / "console.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "txmq.cli", "console", "--port", str(port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        console = ConsoleProcess(f"http://127.0.0.1:{port}", proc, log_path)
        started.append(console)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"txmq console exited:\n{console.output()}")
            try:
                with urllib.request.urlopen(console.url + "/static/console.css", timeout=2):
                    return console
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"txmq console did not come up:\n{console.output()}"
                    ) from exc
                time.sleep(0.1)

    yield start
    for console in started:
        if console.proc.poll() is None:
            console.proc.send_signal(signal.SIGTERM)
            try:
                console.proc.wait(10)
            except subprocess.TimeoutExpired:
                console.proc.kill()
                console.proc.wait(10)
