"""Ending transactional (half) messages, the broker's check-back, and the operators' list."""

from __future__ import annotations

from typing import Literal

from txmq.wire.base import Empty, Name, Request, Response
from txmq.wire.codes import RequestCode

__all__ = [
    "CheckTransactionState",
    "EndTransaction",
    "Ended",
    "GetTransactions",
    "TransactionList",
    "TransactionRow",
]


class Ended(Response, frozen=True, kw_only=True, omit_defaults=True):
    """COMMITTED (with where the message went), ROLLED_BACK, UNKNOWN, or
    ALREADY_RESOLVED (with how: COMMIT, ROLLBACK or PARKED)."""

    result: Literal["COMMITTED", "ROLLED_BACK", "UNKNOWN", "ALREADY_RESOLVED"]
    resolution: str | None = None
    queue_id: int | None = None
    queue_offset: int | None = None
    offset_msg_id: str | None = None


class EndTransaction(Request[Ended], frozen=True, kw_only=True, omit_defaults=True):
    """Commit or roll back the half message at ``transaction_offset``."""

    CODE = RequestCode.END_TRANSACTION
    group: Name
    transaction_offset: int
    state: Literal["COMMIT", "ROLLBACK", "UNKNOWN"]
    msg_id: str = ""
    from_check: bool = False


class CheckTransactionState(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """Broker to producer (oneway): how did the local transaction of this half message end?
    The frame's body is the half message's record; answer with END_TRANSACTION."""

    CODE = RequestCode.CHECK_TRANSACTION_STATE
    transaction_offset: int
    msg_id: str = ""
    transaction_id: str = ""
    group: str = ""
    topic: str = ""
    queue_id: int = 0
    check_times: int = 0


class TransactionRow(Response, frozen=True, kw_only=True, omit_defaults=True):
    msg_id: str
    transaction_id: str
    group: str
    topic: str
    queue_id: int
    transaction_offset: int
    born_timestamp: int
    check_times: int
    age_s: float
    parked_timestamp: int | None = None


class TransactionList(Response, frozen=True, kw_only=True, omit_defaults=True):
    transactions: list[TransactionRow]


class GetTransactions(Request[TransactionList], frozen=True, kw_only=True, omit_defaults=True):
    """Half messages still undecided (pending) or parked after the last check, oldest first."""

    CODE = RequestCode.GET_TRANSACTIONS
    state: Literal["pending", "parked"] = "pending"
    max: int = 100
    group: str | None = None
