"""Transactions an operator can finish: COMMIT / ROLLBACK a pending or parked half message
with a reason, RECHECK a parked one; every decision recorded durably and listed."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ROOT, BrokerProcess
from tests.integration.test_transactions import Listener, end_raw, pending, read_topic, until
from txmq import AdminClient, LocalTransactionState, Message, TransactionProducer
from txmq.broker.server import EmbeddedBroker
from txmq.broker.transactions.operator import OperatorDecisions
from txmq.client.producer import SendResult
from txmq.protocol.wire.errors import BadRequest, TransactionNotFound

pytestmark = pytest.mark.anyio

S = LocalTransactionState
#: check rounds every 0.1 s, a half checked once 0.2 s old, parked after 2 checks
PARK_FAST = {"transaction_check_interval_s": 0.1, "transaction_check_max": 2}


async def _park(address: str, group: str, topic: str, tx: str, listener: Listener) -> SendResult:
    """Send a half whose checks answer UNKNOWN (``listener``) and wait until it is parked."""
    async with TransactionProducer(address, group, listener=listener) as p:
        r = await p.send_half(Message(topic, tx.encode()), transaction_id=tx, check_immunity_s=0.2)

        async def parked() -> bool:
            return any(row["msg_id"] == r.msg_id for row in await pending(address, "parked"))

        await until(parked)
    return r


async def test_operator_commits_a_parked_half_once_and_the_decision_is_kept(
    embedded_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    store = tmp_path / "commit"
    b = embedded_broker(store=store, **PARK_FAST)
    r = await _park(b.address, "tx-op", "op-commit", "T1", Listener())
    async with AdminClient(b.address) as admin:
        [row] = await admin.decide_transaction(
            "COMMIT", msg_id=r.msg_id, reason="paid, see ticket 7", operator="alice"
        )
        assert (row.decision, row.was, row.reason, row.operator) == (
            "COMMIT",
            "parked",
            "paid, see ticket 7",
            "alice",
        )
        assert (row.msg_id, row.transaction_id, row.group, row.topic) == (
            r.msg_id,
            "T1",
            "tx-op",
            "op-commit",
        )
        assert row.address.startswith("127.0.0.1:")
        assert await admin.transactions("parked") == []
        # decided once: a second decision is refused, naming how it was resolved
        with pytest.raises(TransactionNotFound, match=r"resolved \(COMMIT\)"):
            await admin.decide_transaction("ROLLBACK", msg_id=r.msg_id, reason="again")
    [delivered] = await read_topic(b.address, "op-commit")
    assert (delivered.msg_id, delivered.body) == (r.msg_id, b"T1")
    async with TransactionProducer(b.address, "tx-op") as p:  # its producer, late
        assert await end_raw(p, r, "ROLLBACK") == {
            "result": "ALREADY_RESOLVED",
            "resolution": "COMMIT",
        }

    b.stop()
    b = embedded_broker(store=store, **PARK_FAST)  # kept across a restart
    async with AdminClient(b.address) as admin:
        [kept] = await admin.decisions()
        assert (kept.msg_id, kept.decision, kept.reason) == (
            r.msg_id,
            "COMMIT",
            "paid, see ticket 7",
        )
        assert await admin.transactions("parked") == []
        assert await admin.transactions("pending") == []
    assert [m.body for m in await read_topic(b.address, "op-commit")] == [b"T1"]


async def test_operator_rolls_back_a_parked_half_and_commits_a_pending_one(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker(**PARK_FAST)
    parked = await _park(b.address, "tx-op", "op-both", "R1", Listener())
    async with TransactionProducer(b.address, "tx-idle") as p:  # no listener: never answers
        waiting = await p.send_half(Message("op-both", b"P1"), transaction_id="P1")
    async with AdminClient(b.address) as admin:
        [rolled] = await admin.decide_transaction(
            "ROLLBACK", msg_id=parked.msg_id, reason="payment failed"
        )
        assert (rolled.decision, rolled.was) == ("ROLLBACK", "parked")
        assert "@" in rolled.operator  # user@host by default
        [done] = await admin.decide_transaction(
            "COMMIT", msg_id=waiting.msg_id, reason="the order service is gone"
        )
        assert (done.decision, done.was) == ("COMMIT", "pending")
        assert await admin.transactions("pending") == []
        assert await admin.transactions("parked") == []
        decided = await admin.decisions()
        assert [(d.msg_id, d.decision) for d in decided] == [
            (waiting.msg_id, "COMMIT"),  # newest first
            (parked.msg_id, "ROLLBACK"),
        ]
    assert [m.body for m in await read_topic(b.address, "op-both")] == [b"P1"]


async def test_recheck_asks_the_producer_again_and_its_answer_commits(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker(**PARK_FAST)
    listener = Listener()  # UNKNOWN until told otherwise
    first = await _park(b.address, "tx-re", "op-recheck", "C1", listener)
    second = await _park(b.address, "tx-re", "op-recheck", "C2", listener)
    listener.answers = {"C1": S.COMMIT, "C2": S.ROLLBACK}
    checks_before = len(listener.checks)
    async with TransactionProducer(b.address, "tx-re", listener=listener):
        async with AdminClient(b.address) as admin:
            with pytest.raises(BadRequest, match="for RECHECK only"):
                await admin.decide_transaction("COMMIT", all=True, reason="x")
            rows = await admin.decide_transaction("RECHECK", all=True, group="tx-re")
            assert sorted(r.msg_id for r in rows) == sorted([first.msg_id, second.msg_id])
            assert all(r.decision == "RECHECK" and r.recheck_offset for r in rows)
            assert await admin.transactions("parked") == []

            async def resolved() -> bool:
                return not await admin.transactions("pending")

            await until(resolved)
            assert await admin.transactions("parked") == []
            assert await admin.decide_transaction("RECHECK", all=True) == []  # none left
            # the message id names both copies: the newest one says how it ended
            with pytest.raises(TransactionNotFound, match=r"resolved \(COMMIT\)"):
                await admin.decide_transaction("ROLLBACK", msg_id=first.msg_id, reason="late")
            with pytest.raises(TransactionNotFound, match=r"resolved \(ROLLBACK\)"):
                await admin.decide_transaction("COMMIT", msg_id=second.msg_id, reason="late")
    assert len(listener.checks) > checks_before
    assert [m.body for m in await read_topic(b.address, "op-recheck")] == [b"C1"]


async def test_bad_decisions_are_refused_clearly(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    b = embedded_broker(**PARK_FAST)
    async with TransactionProducer(b.address, "tx-bad") as p:
        waiting = await p.send_half(Message("op-bad", b"W"), transaction_id="W")
        done = await p.send_half(Message("op-bad", b"D"), transaction_id="D")
        assert await p.end_transaction(done, S.COMMIT) == "COMMITTED"
    async with AdminClient(b.address) as admin:
        with pytest.raises(ValueError, match="needs a reason"):
            await admin.decide_transaction("COMMIT", msg_id=waiting.msg_id)
        with pytest.raises(TransactionNotFound, match="no half message NOPE"):
            await admin.decide_transaction("COMMIT", msg_id="NOPE", reason="r")
        with pytest.raises(TransactionNotFound, match=r"resolved \(COMMIT\)"):
            await admin.decide_transaction("ROLLBACK", msg_id=done.msg_id, reason="r")
        with pytest.raises(BadRequest, match="RECHECK is for parked ones"):
            await admin.decide_transaction("RECHECK", msg_id=waiting.msg_id)
        with pytest.raises(TransactionNotFound, match="no half message at commit-log offset"):
            await admin.decide_transaction("COMMIT", transaction_offset=10**12, reason="r")
        assert [t.msg_id for t in await admin.transactions("pending")] == [waiting.msg_id]
        assert await admin.decisions() == []


async def test_a_commit_cut_by_a_crash_is_finished_once_on_restart(
    embedded_broker: Callable[..., EmbeddedBroker],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A crash after an operator's COMMIT stored the real message but before its decision:
    the restarted broker records the decision and does not deliver the message again."""
    store = tmp_path / "cut"
    b = embedded_broker(store=store, **PARK_FAST)
    r = await _park(b.address, "tx-cut", "op-cut", "X1", Listener())
    record = OperatorDecisions._record

    def crash(self: OperatorDecisions, row: Any) -> None:
        raise RuntimeError("simulated crash before the decision record")

    monkeypatch.setattr(OperatorDecisions, "_record", crash)
    async with AdminClient(b.address) as admin:
        with pytest.raises(Exception, match="simulated crash"):
            await admin.decide_transaction("COMMIT", msg_id=r.msg_id, reason="cut")
    b.stop()
    monkeypatch.setattr(OperatorDecisions, "_record", record)

    caplog.set_level(logging.WARNING, "txmq.broker.transactions.service")
    b = embedded_broker(store=store, **PARK_FAST)
    assert "operator decision(s) finished after a crash" in caplog.text
    async with AdminClient(b.address) as admin:
        [kept] = await admin.decisions()
        assert (kept.msg_id, kept.decision) == (r.msg_id, "COMMIT")
        assert "after a crash" in kept.reason
        assert await admin.transactions("parked") == []
        with pytest.raises(TransactionNotFound, match=r"resolved \(COMMIT\)"):
            await admin.decide_transaction("COMMIT", msg_id=r.msg_id, reason="again")
    assert [m.body for m in await read_topic(b.address, "op-cut")] == [b"X1"]


async def test_cli_commit_and_decided_after_a_broker_sigkill(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\ntransaction_check_interval_s = 0.1\ntransaction_check_max = 2\n")
    bp = broker_process("--flush", "sync", "--config", str(config)).start()
    r = await _park(bp.address, "tx-cli", "op-cli", "K1", Listener())
    cli = [sys.executable, "-m", "txmq.cli", "admin", "transactions"]
    out = await anyio.run_process(
        [*cli, "commit", "--id", r.msg_id, "--reason", "ticket 9", "--broker", bp.address],
        cwd=ROOT,
    )
    table = out.stdout.decode()
    assert "COMMIT" in table and r.msg_id in table and "ticket 9" in table
    bp.kill()  # SIGKILL: the decision was acknowledged after a synchronous flush
    bp.start()
    out = await anyio.run_process([*cli, "--decided", "--json", "--broker", bp.address], cwd=ROOT)
    [shown] = json.loads(out.stdout)
    assert (shown["msg_id"], shown["decision"], shown["reason"]) == (r.msg_id, "COMMIT", "ticket 9")
    assert shown["decided_time"].endswith("Z")
    assert [m.body for m in await read_topic(bp.address, "op-cli")] == [b"K1"]
    refused = await anyio.run_process(
        [*cli, "commit", "--id", r.msg_id, "--reason", "again", "--broker", bp.address],
        cwd=ROOT,
        check=False,
    )
    assert refused.returncode != 0 and b"resolved (COMMIT)" in refused.stderr
    listed = await anyio.run_process([*cli, "--broker", bp.address], cwd=ROOT, check=False)
    assert listed.returncode == 1 and b"--pending, --parked or --decided" in listed.stderr
    assert bp.terminate() == 0
