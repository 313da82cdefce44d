"""The operators' decisions are listed newest first, also two made in one millisecond (the
order they were made in decides; a CI run listed them the other way round)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from txmq.broker.transactions.check import TransactionChecker
from txmq.protocol.wire import GetTransactions
from txmq.protocol.wire.transactions import DecisionRow


def _row(msg_id: str, offset: int, at: int) -> DecisionRow:
    return DecisionRow(
        msg_id=msg_id, transaction_id=msg_id, group="g", topic="t", transaction_offset=offset,
        decision="COMMIT", was="pending", reason="", operator="op", address="a",
        decided_timestamp=at,
    )  # fmt: skip


def test_decisions_in_one_millisecond_are_listed_newest_first() -> None:
    service = SimpleNamespace(check_ready=lambda: None, decided={})
    for msg_id, offset, at in [("old", 10, 5), ("first", 30, 7), ("second", 20, 7)]:
        service.decided[offset] = _row(msg_id, offset, at)  # in the order they were made
    checker: Any = SimpleNamespace(service=service)
    listed = TransactionChecker.list_transactions(
        checker,
        GetTransactions(state="decided", max=10),
        None,  # type: ignore[arg-type]
    )
    assert [r.msg_id for r in listed.decisions] == ["second", "first", "old"]
