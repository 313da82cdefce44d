"""Transactional (half) messages: commit, rollback, check-back, parking, crash safety."""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.conftest import ROOT, BrokerProcess, raw_request, wait_for
from txmq import (
    AdminClient,
    LocalTransactionState,
    Message,
    Producer,
    PullConsumer,
    PullStatus,
    PushConsumer,
    TransactionNotFound,
    TransactionProducer,
)
from txmq import sync as txsync
from txmq.broker.server import EmbeddedBroker
from txmq.broker.state.config import BrokerConfig
from txmq.broker.store import FlushMode
from txmq.broker.transactions.service import COMMIT, TransactionService
from txmq.client.producer import SendResult
from txmq.protocol.message import MessageExt, Prop, SysFlag
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import BatchEntry, Ended, RequestCode, SendBatchMessage, SendMessage, decode
from txmq.protocol.wire.errors import BadRequest, BrokerUnavailable
from txmq.security.client import ClientSecurity

pytestmark = pytest.mark.anyio

S = LocalTransactionState
#: short check-back settings: a round every 0.1 s, a half checked once 0.3 s old
FAST = {"transaction_check_interval_s": 0.1, "transaction_timeout_s": 0.3}


async def until(predicate: Callable[[], Awaitable[Any]], timeout: float = 20.0) -> Any:
    """Poll an async ``predicate`` until it returns something truthy; fail after ``timeout``."""
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(0.02)


async def read_topic(
    address: str, topic: str, security: ClientSecurity | None = None
) -> list[MessageExt]:
    out: list[MessageExt] = []
    async with PullConsumer(address, "reader", security=security) as consumer:
        for qid in await consumer.queues(topic):
            offset = 0
            while True:
                res = await consumer.pull(topic, qid, offset, max_msgs=256, long_poll=0)
                if res.status != PullStatus.FOUND:
                    break
                out.extend(res.messages)
                offset = res.next_offset
    return out


async def end_raw(p: TransactionProducer, r: SendResult, state: str) -> dict[str, Any]:
    """END_TRANSACTION with any state; the broker's answer as a map of what it says."""
    frame = await raw_request(
        p,
        RequestCode.END_TRANSACTION,
        {
            "group": p.group,
            "transaction_offset": r.transaction_offset,
            "msg_id": r.msg_id,
            "state": state,
        },
    )
    answer: dict[str, Any] = msgspec.to_builtins(decode(Ended, frame.header))
    return answer


async def pending(address: str, state: str = "pending") -> list[dict[str, Any]]:
    async with AdminClient(address) as admin:
        return [msgspec.to_builtins(t) for t in await admin.transactions(state)]


class Listener:
    """Answers checks from a table of transaction id -> state (UNKNOWN if absent)."""

    def __init__(self, execute: S = S.COMMIT, answers: dict[str, S] | None = None) -> None:
        self.execute = execute
        self.answers = answers or {}
        self.default = S.UNKNOWN
        self.checks: list[MessageExt] = []
        self.executed_in: list[int] = []

    async def execute_local_transaction(self, msg: Message, arg: Any) -> S:
        if isinstance(arg, Exception):
            raise arg
        return arg if isinstance(arg, S) else self.execute

    def check_local_transaction(self, msg: MessageExt) -> S:  # sync: runs in a worker thread
        self.checks.append(msg)
        return self.answers.get(msg.get_property(Prop.TRANSACTION_ID) or "", self.default)


def checked_ids(listener: Listener) -> list[str]:
    return [m.get_property(Prop.TRANSACTION_ID) or "" for m in listener.checks]


# -- commit and rollback ------------------------------------------------------------------------


async def test_commit_is_invisible_before_end_and_delivered_once_after(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker()
    async with (
        TransactionProducer(b.address, "tx-commit") as p,
        PullConsumer(b.address, "watcher") as c,
    ):
        msg = Message("tx-orders", b"order 1", tags="created", keys=["o-1"], properties={"a": "1"})
        r = await p.send_half(msg, transaction_id="T1", queue_id=2)
        assert r.transaction_offset >= 0 and r.queue_id == 2 and r.topic == "tx-orders"
        assert await read_topic(b.address, "tx-orders") == []
        [row] = await pending(b.address)
        assert row["transaction_id"] == "T1" and row["transaction_offset"] == r.transaction_offset
        assert (row["group"], row["topic"], row["queue_id"]) == ("tx-commit", "tx-orders", 2)

        async with anyio.create_task_group() as tg:
            woken: list[MessageExt] = []

            async def long_poll() -> None:  # waiting before the commit, woken by it
                res = await c.pull("tx-orders", 2, 0, long_poll=15)
                woken.extend(res.messages)

            tg.start_soon(long_poll)
            await anyio.sleep(0.2)
            assert not woken
            with anyio.fail_after(5):
                assert await p.end_transaction(r, S.COMMIT) == "COMMITTED"
        [m] = woken
        assert (m.body, m.msg_id, m.queue_id, m.tags, m.keys) == (
            b"order 1",
            r.msg_id,
            2,
            "created",
            ["o-1"],
        )
        assert m.properties == {"a": "1"}
        assert m.get_property(Prop.TRANSACTION_ID) == "T1"
        for gone in (Prop.TRAN_MSG, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.PRODUCER_GROUP):
            assert m.get_property(gone) is None
        assert SysFlag.transaction_value(m.sys_flag) == SysFlag.TRANSACTION_COMMIT_TYPE
        assert m.prepared_transaction_offset == r.transaction_offset

        assert await end_raw(p, r, "COMMIT") == {"result": "ALREADY_RESOLVED", "resolution": COMMIT}
        assert await p.end_transaction(r, S.ROLLBACK) == "ALREADY_RESOLVED"
        assert await p.end_transaction(r, "COMMIT") == "ALREADY_RESOLVED"
        assert [x.msg_id for x in await read_topic(b.address, "tx-orders")] == [r.msg_id]
        assert await pending(b.address) == []


async def test_rollback_is_never_visible(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    b = embedded_broker()
    async with TransactionProducer(b.address, "tx-rollback") as p:
        r = await p.send_half(Message("tx-rb", b"never"), transaction_id="R1")
        assert await p.end_transaction(r, S.ROLLBACK) == "ROLLED_BACK"
        answer = await end_raw(p, r, "ROLLBACK")
        assert answer == {"result": "ALREADY_RESOLVED", "resolution": "ROLLBACK"}
        assert (await end_raw(p, r, "COMMIT"))["resolution"] == "ROLLBACK"
        assert await p.end_transaction(r, S.UNKNOWN) == "UNKNOWN"
        assert await read_topic(b.address, "tx-rb") == []
        assert await pending(b.address) == []


async def test_unknown_leaves_the_half_pending(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker()
    async with TransactionProducer(b.address, "tx-unknown") as p:
        r = await p.send_half(Message("tx-unk", b"later"), transaction_id="U1")
        assert await end_raw(p, r, "UNKNOWN") == {"result": "UNKNOWN"}
        assert [t["msg_id"] for t in await pending(b.address)] == [r.msg_id]
        assert await p.end_transaction(r, S.COMMIT) == "COMMITTED"
        assert len(await read_topic(b.address, "tx-unk")) == 1


async def test_send_message_in_transaction(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    b = embedded_broker()
    listener = Listener()
    async with TransactionProducer(b.address, "tx-send", listener=listener) as p:
        ok = await p.send_message_in_transaction(Message("tx-st", b"yes"), S.COMMIT)
        assert ok.local_state is S.COMMIT and ok.transaction_id
        no = await p.send_message_in_transaction(
            Message("tx-st", b"no"), S.ROLLBACK, transaction_id="mine"
        )
        assert (no.local_state, no.transaction_id) == (S.ROLLBACK, "mine")
        with pytest.raises(ZeroDivisionError):
            await p.send_message_in_transaction(
                Message("tx-st", b"boom"), ZeroDivisionError("db down"), transaction_id="boom"
            )
        # the failed local transaction is left to the check-back
        [left] = await pending(b.address)
        assert left["transaction_id"] == "boom"
        assert [m.body for m in await read_topic(b.address, "tx-st")] == [b"yes"]
        p.listener = None
        with pytest.raises(ValueError, match="TransactionListener"):
            await p.send_message_in_transaction(Message("tx-st", b"x"))


@pytest.mark.parametrize("transport", [None, "loopback"])
async def test_under_sync_flush_a_oneway_end_asks_for_no_fsync_a_waited_one_waits_for_it(
    embedded_broker: Callable[..., EmbeddedBroker],
    monkeypatch: pytest.MonkeyPatch,
    transport: str | None,
) -> None:
    """The producer ends its transactions oneway (nobody waits for the answer): the broker
    stores the commit without asking for an fsync of its own (the next group commit takes
    it to disk).  An end that waits for the answer is answered once the commit is on disk.
    Over a connection and in process alike."""
    in_process = "127.0.0.2:19001" if transport == "loopback" else None
    b = embedded_broker(flush=FlushMode.SYNC, in_process=in_process)
    assert b.broker is not None
    store = b.broker.store
    asked: list[int] = []  # the end offsets whose fsync the broker waited for
    flush_future = store.flush_future

    def recording(end_offset: int) -> Any:
        asked.append(end_offset)
        return flush_future(end_offset)

    monkeypatch.setattr(store, "flush_future", recording)
    async with TransactionProducer(in_process or b.address, "tx-oneway", transport=transport) as p:
        first = await p.send_half(Message("tx-ow", b"one"), transaction_id="O1")
        assert asked and store.flushed_offset >= asked[-1] > first.transaction_offset
        before = len(asked)
        assert await p.end_transaction(first, S.COMMIT, wait=False) == "SENT"
        assert [m.body for m in await until(lambda: read_topic(b.address, "tx-ow"))] == [b"one"]
        assert await pending(b.address) == []  # its op record is stored too
        assert len(asked) == before  # neither waited for an fsync
        second = await p.send_half(Message("tx-ow", b"two"), transaction_id="O2")
        before = len(asked)
        assert await p.end_transaction(second, S.COMMIT) == "COMMITTED"
        assert len(asked) == before + 1 and store.flushed_offset >= asked[-1]


async def test_not_found_and_bad_requests(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    b = embedded_broker()
    async with (
        TransactionProducer(b.address, "tx-bad") as p,
        TransactionProducer(b.address, "tx-other") as other,
    ):
        r = await p.send_half(Message("tx-bad-topic", b"x"), transaction_id="B1")
        normal = await p.send(Message("tx-bad-topic", b"plain"))
        nowhere = SendResult("SEND_OK", "X", "X", "t", 0, 0, 0, transaction_offset=10**9)
        with pytest.raises(TransactionNotFound, match="no half message") as info:
            await p.end_transaction(nowhere, S.COMMIT)
        assert not info.value.retriable
        not_half = SendResult(
            "SEND_OK",
            normal.msg_id,
            "",
            "t",
            0,
            0,
            0,
            transaction_offset=int(normal.offset_msg_id, 16),
        )
        with pytest.raises(TransactionNotFound, match="not a half message"):
            await p.end_transaction(not_half, S.COMMIT)
        with pytest.raises(TransactionNotFound, match="belongs to producer group 'tx-bad'"):
            await other.end_transaction(r, S.COMMIT)
        wrong_id = SendResult(
            "SEND_OK", "WRONG", "", "t", 0, 0, 0, transaction_offset=r.transaction_offset
        )
        with pytest.raises(TransactionNotFound):
            await p.end_transaction(wrong_id, S.COMMIT)
        with pytest.raises(ValueError, match="send_half"):
            await p.end_transaction(normal, S.COMMIT)
        with pytest.raises(BadRequest, match="state"):
            await raw_request(
                p,
                RequestCode.END_TRANSACTION,
                {"group": "tx-bad", "transaction_offset": r.transaction_offset, "state": "MAYBE"},
            )
        half_props = {Prop.TRAN_MSG: "true", Prop.UNIQ_KEY: "H1"}
        with pytest.raises(BadRequest, match="'group'"):  # a half message needs its group
            await p.call(SendMessage(topic="tx-bad-topic", queue_id=0, properties=half_props), b"x")
        with pytest.raises(BadRequest, match="batch"):
            await p.call(
                SendBatchMessage(
                    topic="tx-bad-topic",
                    queue_id=0,
                    group="tx-bad",
                    messages=[BatchEntry(size=1, properties=half_props)],
                ),
                b"x",
            )
        with pytest.raises(BadRequest, match="not a time in ms"):  # a delayed half may be
            await p.call(  # sent (it waits from its commit), but with a time that is one
                SendMessage(
                    topic="tx-bad-topic",
                    queue_id=0,
                    group="tx-bad",
                    properties={**half_props, Prop.DELIVER_AT: "soon"},
                ),
                b"x",
            )
        with pytest.raises(BadRequest, match="out of range"):
            await p.send_half(Message("tx-bad-topic", b"x"), transaction_id="B2", queue_id=9)
        far = datetime.now(UTC) + timedelta(days=30)  # past timer_max_delay_s
        with pytest.raises(BadRequest, match="timer_max_delay_s"):
            await p.send_half(Message("tx-bad-topic", b"x", deliver_at=far), transaction_id="B3")
        with pytest.raises(ValueError, match="transaction_id"):
            await p.send_half(Message("tx-bad-topic", b"x"), transaction_id="")
        with pytest.raises(BadRequest, match="pending"):
            await raw_request(p, RequestCode.GET_TRANSACTIONS, {"state": "everything"})
        # the broker is fine and the half still resolvable
        assert await p.end_transaction(r, S.COMMIT) == "COMMITTED"


def test_config_validation() -> None:
    for bad in (
        {"transaction_check_max": 0},
        {"transaction_check_interval_s": 0.0},
        {"transaction_timeout_s": -1.0},
    ):
        with pytest.raises(SettingsError):
            BrokerConfig(**bad)  # type: ignore[arg-type]
    cfg = BrokerConfig.load(env={"TXMQ_BROKER_TRANSACTION_CHECK_MAX": "3"})
    assert (cfg.transaction_check_max, cfg.transaction_check_interval_s) == (3, 30.0)
    assert cfg.transaction_timeout_s == 6.0


# -- check-back -------------------------------------------------------------------------------


@pytest.fixture
def tx_producer_proc(
    tmp_path: Path,
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Any]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str) -> tuple[subprocess.Popen[bytes], Any]:
        cmd = [sys.executable, str(ROOT / "tests" / "tx_producer_proc.py"), *args]
        log = (tmp_path / f"txproducer{len(procs)}.stderr").open("ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        log.close()
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("READY "), f"producer did not start: {line!r}"
        return proc, json.loads(line[len("READY ") :])

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


async def test_check_back_goes_to_a_live_producer_after_the_first_is_killed(
    embedded_broker: Callable[..., EmbeddedBroker],
    tx_producer_proc: Callable[..., tuple[subprocess.Popen[bytes], Any]],
) -> None:
    b = embedded_broker(**FAST)
    group, topic = "tx-killed", "tx-check"
    proc, sent = tx_producer_proc(
        "--broker", b.address, "--group", group, "--topic", topic, "--count", "2"
    )
    by_tx = {s["transaction_id"]: s for s in sent}
    assert sorted(by_tx) == ["tx-0", "tx-1"]

    async def checked_by_first() -> bool:  # the live process is asked (it answers UNKNOWN)
        return all(t["check_times"] >= 1 for t in await pending(b.address))

    await until(checked_by_first)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"CHECK tx-")
    proc.kill()
    proc.wait(10)

    received: list[MessageExt] = []
    consumer = PushConsumer(
        b.address, "tx-check-consumer", listener=received.append, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe(topic)
    listener = Listener(answers={"tx-0": S.COMMIT, "tx-1": S.ROLLBACK})
    async with consumer, TransactionProducer(b.address, group, listener=listener):

        async def resolved() -> bool:
            return not await pending(b.address)

        await until(resolved)
        await until(lambda: _true(received))
        assert {m.msg_id for m in listener.checks} >= {by_tx["tx-0"]["msg_id"]}
        checked = listener.checks[0]
        assert checked.topic == topic and checked.get_property(Prop.TRANSACTION_ID) in by_tx
        # a few more check rounds: nothing else arrives, nothing is checked again
        rounds = b.broker.transaction_checker.rounds if b.broker else 0
        await until(lambda: _true(b.broker and b.broker.transaction_checker.rounds >= rounds + 5))
        assert [m.msg_id for m in received] == [by_tx["tx-0"]["msg_id"]]
        assert Counter(checked_ids(listener)) == {"tx-0": 1, "tx-1": 1}
    stored = await read_topic(b.address, topic)
    assert [(m.msg_id, m.body) for m in stored] == [(by_tx["tx-0"]["msg_id"], b"tx-0 body")]


async def _true(value: Any) -> bool:
    return bool(value)


async def test_undecided_half_is_parked_after_the_last_check(
    embedded_broker: Callable[..., EmbeddedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="txmq.broker")
    b = embedded_broker(transaction_check_interval_s=0.1, transaction_check_max=3)
    listener = Listener()  # checks answer UNKNOWN
    async with TransactionProducer(b.address, "tx-park", listener=listener) as p:
        r = await p.send_half(
            Message("tx-parked", b"stuck"), transaction_id="P1", check_immunity_s=0.2
        )

        async def parked() -> list[dict[str, Any]]:
            return await pending(b.address, "parked")

        [row] = await until(parked)
        assert (row["msg_id"], row["transaction_id"], row["group"]) == (r.msg_id, "P1", "tx-park")
        assert (row["topic"], row["transaction_offset"]) == ("tx-parked", r.transaction_offset)
        assert row["check_times"] == 3
        # said once, whole (a mismatched format made the check round fail instead)
        assert "checks; parked in TRANS_CHECK_MAX_TIME_TOPIC for an operator" in caplog.text
        assert "check round failed" not in caplog.text
        await until(lambda: _true(len(listener.checks) == 3))
        assert b.broker is not None
        rounds = b.broker.transaction_checker.rounds
        await until(lambda: _true(b.broker and b.broker.transaction_checker.rounds >= rounds + 5))
        assert len(listener.checks) == 3 and await pending(b.address) == []
        assert await end_raw(p, r, "COMMIT") == {
            "result": "ALREADY_RESOLVED",
            "resolution": "PARKED",
        }
        assert await read_topic(b.address, "tx-parked") == []

    cli = [sys.executable, "-m", "txmq.cli", "admin", "--broker", b.address, "transactions"]
    out = await anyio.run_process([*cli, "--parked", "--json"], cwd=ROOT)
    [shown] = json.loads(out.stdout)
    assert shown["msg_id"] == r.msg_id and shown["check_times"] == 3
    table = (await anyio.run_process([*cli, "--parked"], cwd=ROOT)).stdout.decode()
    assert table.splitlines()[0].split()[:3] == ["MSG_ID", "TRANSACTION_ID", "GROUP"]
    assert "P1" in table and "tx-parked/" in table
    empty = (await anyio.run_process([*cli, "--pending"], cwd=ROOT)).stdout.decode()
    assert empty.strip() == "(none)"


async def test_check_counts_survive_a_restart(
    embedded_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    store = tmp_path / "restarted"
    settings = {"transaction_check_interval_s": 0.3, "transaction_check_max": 4}
    b = embedded_broker(store=store, transaction_timeout_s=0.0, **settings)
    first = Listener()
    async with TransactionProducer(b.address, "tx-counts", listener=first) as p:
        r = await p.send_half(Message("tx-counted", b"c"), transaction_id="C1")
        await until(lambda: _true(len(first.checks) >= 2))
    b.stop()
    saved = json.loads((store / "config" / "transaction_offsets.json").read_text())
    before = saved["check_times"][str(r.transaction_offset)]
    assert before >= 2
    b = embedded_broker(store=store, transaction_timeout_s=0.0, **settings)
    second = Listener()
    async with TransactionProducer(b.address, "tx-counts", listener=second):

        async def parked() -> list[dict[str, Any]]:
            return await pending(b.address, "parked")

        [row] = await until(parked)
    assert row["check_times"] == 4
    assert len(second.checks) == 4 - before  # counting went on from the saved count


async def test_producer_reregisters_with_a_restarted_broker(
    embedded_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    store = tmp_path / "again"
    b = embedded_broker(store=store)  # no check before the restart (30 s interval)
    port = b.broker.port if b.broker else 0
    listener = Listener(answers={"R1": S.COMMIT})
    async with TransactionProducer(
        b.address, "tx-again", listener=listener, heartbeat_interval=0.1
    ) as p:
        await p.send_half(Message("tx-again", b"after restart"), transaction_id="R1")
        b.stop()
        b = embedded_broker(store=store, port=port, **FAST)

        async def delivered() -> list[MessageExt]:
            return await read_topic(b.address, "tx-again")

        [m] = await until(delivered)  # the heartbeat reconnected; the broker checked back
        assert m.body == b"after restart"
        [checked] = listener.checks
        assert checked.get_property(Prop.TRANSACTION_CHECK_TIMES) == "1"
    assert await pending(b.address) == []


async def test_a_failing_heartbeat_or_check_back_does_not_end_the_producer(
    embedded_broker: Callable[..., EmbeddedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    """Background work that fails in a way nobody foresaw (a bug: here a ValueError put
    into the heartbeat and into ending a checked transaction) is logged with its stack and
    tried again; the producer goes on (such a failure used to end its task group, and every
    later request failed "client is not started")."""
    b = embedded_broker(**FAST)
    listener = Listener(execute=S.UNKNOWN, answers={"B1": S.COMMIT})
    async with TransactionProducer(
        b.address, "tx-bug", listener=listener, heartbeat_interval=0.05
    ) as p:
        beats, ends = 0, 0
        heartbeat, end = p._heartbeat, p._end

        async def buggy_heartbeat() -> None:
            nonlocal beats
            beats += 1
            if beats == 1:
                raise ValueError("a bug in the heartbeat")
            await heartbeat()

        async def buggy_end(*args: Any) -> str:
            nonlocal ends
            from_check = args[3]
            ends += from_check
            if from_check and ends == 1:
                raise ValueError("a bug in ending a transaction")
            return await end(*args)

        p._heartbeat, p._end = buggy_heartbeat, buggy_end  # type: ignore[method-assign]
        await p.send_message_in_transaction(Message("tx-bug", b"checked"), transaction_id="B1")

        async def delivered() -> list[MessageExt]:
            return await read_topic(b.address, "tx-bug")

        [m] = await until(delivered)  # checked back twice: the second end went through
        assert m.body == b"checked" and ends >= 2 and beats >= 3
        late = await p.send_half(Message("tx-bug", b"still here"), transaction_id="B2")
        assert late.status == "SEND_OK"
    assert "heartbeat failed unexpectedly" in caplog.text
    assert "ending message" in caplog.text and "a bug in ending a transaction" in caplog.text


async def test_a_client_whose_background_work_failed_says_so(
    embedded_broker: Callable[..., EmbeddedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    """Should a background task fail after all (here one raising in the client's task
    group), the client logs it with its stack, every request says the client stopped and
    why (not "call start()", which its user did), and stop() still stops it."""
    b = embedded_broker()
    p = Producer(b.address)
    await p.start()

    async def broken() -> None:
        raise ValueError("a bug in background work")

    async def ended() -> bool:
        return p._tg is None

    p._task_group().start_soon(broken)
    await until(ended)
    with pytest.raises(BrokerUnavailable, match=r"client stopped: its background work failed"):
        await p.send(Message("stopped", b"x"))
    await p.stop()  # quietly: the failure was logged when it happened
    assert "stopped: a background task failed" in caplog.text
    assert "a bug in background work" in caplog.text
    # and a new start works
    await p.start()
    try:
        assert (await p.send(Message("stopped", b"again"))).status == "SEND_OK"
    finally:
        await p.stop()


async def test_several_halves_of_one_transaction_are_all_committed(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker(**FAST)
    listener = Listener(execute=S.UNKNOWN)  # the local transaction's outcome comes later
    async with TransactionProducer(b.address, "tx-multi", listener=listener) as p:
        results = [
            await p.send_message_in_transaction(
                Message("tx-multi", f"part {i}".encode()), transaction_id="ORDER-7"
            )
            for i in range(3)
        ]
        assert {r.transaction_id for r in results} == {"ORDER-7"}
        listener.answers["ORDER-7"] = S.COMMIT  # now the check-back finds it committed

        async def resolved() -> bool:
            return not await pending(b.address)

        await until(resolved)
    stored = await read_topic(b.address, "tx-multi")
    assert sorted(m.body for m in stored) == [b"part 0", b"part 1", b"part 2"]
    assert {m.msg_id for m in stored} == {r.send_result.msg_id for r in results}
    assert {m.get_property(Prop.TRANSACTION_ID) for m in stored} == {"ORDER-7"}


def test_sync_transaction_producer(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    b = embedded_broker(**FAST)
    caller = threading.get_ident()
    threads: list[int] = []

    class Plain:
        def execute_local_transaction(self, msg: Message, arg: Any) -> S:
            threads.append(threading.get_ident())
            return S(arg)

        def check_local_transaction(self, msg: MessageExt) -> S:
            return S.COMMIT

    with txsync.TransactionProducer(b.address, "tx-sync", listener=Plain()) as p:
        done = p.send_message_in_transaction(Message("tx-sync", b"one"), "COMMIT")
        assert done.local_state is S.COMMIT and threads == [caller]
        r = p.send_half(Message("tx-sync", b"two"), transaction_id="S2")
        assert p.end_transaction(r, S.UNKNOWN) == "UNKNOWN"
        with txsync.AdminClient(b.address) as admin:

            def settled() -> bool:
                return not admin.transactions("pending")

            wait_for(settled)
        assert p.end_transaction(r, S.ROLLBACK) == "ALREADY_RESOLVED"
    with txsync.PullConsumer(b.address, "tx-sync-reader") as c:
        bodies = []
        for q in range(4):
            res = c.pull("tx-sync", q, 0, long_poll=0)
            bodies += [m.body for m in res.messages]
    assert sorted(bodies) == [b"one", b"two"]


# -- crash safety -------------------------------------------------------------------------------


async def test_pending_halves_survive_a_broker_sigkill(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\ntransaction_check_interval_s = 0.1\ntransaction_timeout_s = 0.3\n")
    bp = broker_process("--flush", "sync", "--config", str(config)).start()
    async with TransactionProducer(bp.address, "tx-crash") as p:
        done = await p.send_half(Message("tx-crash", b"A"), transaction_id="A")
        gone = await p.send_half(Message("tx-crash", b"B"), transaction_id="B")
        assert await p.end_transaction(done, S.COMMIT) == "COMMITTED"
        assert await p.end_transaction(gone, S.ROLLBACK) == "ROLLED_BACK"
        left = [
            await p.send_half(Message("tx-crash", tx.encode()), transaction_id=tx)
            for tx in ("C", "D")
        ]
        bp.kill()  # SIGKILL with C and D pending

    bp.start()
    assert "NOT clean" in bp.output()
    listener = Listener(answers={tx: S.COMMIT for tx in "ABCD"})
    async with TransactionProducer(bp.address, "tx-crash", listener=listener) as p:

        async def resolved() -> bool:
            return not await pending(bp.address)

        await until(resolved)
        assert sorted(checked_ids(listener)) == ["C", "D"]  # the resolved ones are not asked
        assert (await end_raw(p, done, "COMMIT"))["resolution"] == "COMMIT"
        assert (await end_raw(p, gone, "COMMIT"))["resolution"] == "ROLLBACK"
        for r in left:
            assert (await end_raw(p, r, "ROLLBACK"))["resolution"] == "COMMIT"
    stored = await read_topic(bp.address, "tx-crash")
    assert sorted(m.body for m in stored) == [b"A", b"C", b"D"]
    assert bp.terminate() == 0


async def test_commit_cut_between_message_and_op_record_is_not_repeated(
    embedded_broker: Callable[..., EmbeddedBroker],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A crash after a COMMIT stored the real message but before its op record: the
    restarted broker finds the committed message and does not deliver it again."""
    store = tmp_path / "cut"
    b = embedded_broker(store=store)
    settle = TransactionService.settle

    def crash_before_op(self: TransactionService, half: Any, resolution: str) -> Any:
        if resolution == COMMIT:
            raise RuntimeError("simulated crash between the real message and its op record")
        return settle(self, half, resolution)

    monkeypatch.setattr(TransactionService, "settle", crash_before_op)
    async with TransactionProducer(b.address, "tx-cut") as p:
        r = await p.send_half(Message("tx-cut", b"once"), transaction_id="X1")
        with pytest.raises(Exception, match="simulated crash"):
            await p.end_transaction(r, S.COMMIT)
    b.stop()  # the half is still pending in the saved offsets, as after a crash
    monkeypatch.setattr(TransactionService, "settle", settle)

    caplog.set_level(logging.INFO, "txmq.broker.transactions.service")
    b = embedded_broker(store=store, **FAST)
    assert "was COMMIT before a crash but its op record is missing" in caplog.text
    listener = Listener(answers={"X1": S.COMMIT})
    async with TransactionProducer(b.address, "tx-cut", listener=listener) as p:
        assert await pending(b.address) == []
        assert await end_raw(p, r, "COMMIT") == {"result": "ALREADY_RESOLVED", "resolution": COMMIT}
        assert b.broker is not None
        rounds = b.broker.transaction_checker.rounds
        await until(lambda: _true(b.broker and b.broker.transaction_checker.rounds >= rounds + 3))
        assert listener.checks == []
    assert [m.body for m in await read_topic(b.address, "tx-cut")] == [b"once"]
    b.stop()
    b = embedded_broker(store=store)  # and the repaired op record holds on the next start
    assert await pending(b.address) == []
    async with Producer(b.address) as plain:
        await plain.send(Message("tx-cut", b"after"))
    assert [m.body for m in await read_topic(b.address, "tx-cut")] == [b"once", b"after"]
