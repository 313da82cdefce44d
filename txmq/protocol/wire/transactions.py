"""Ending transactional (half) messages, the broker's check-back, and the operators' list
and decisions."""

from __future__ import annotations

from typing import Literal

from txmq.protocol.wire.base import Empty, Name, Request, Response
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "CheckTransactionState",
    "DecideTransaction",
    "Decided",
    "DecisionRow",
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
    #: the broker set that asks (RocketMQ 5's brokerName: a proxy answers it there)
    broker_name: str = ""


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


Decision = Literal["COMMIT", "ROLLBACK", "RECHECK"]


class DecisionRow(Response, frozen=True, kw_only=True, omit_defaults=True):
    """An operator's decision on a half message, as the broker records it (the body of a
    record in ``TXMQ_SYS_TRANS_DECISION``) and lists it."""

    msg_id: str
    transaction_id: str
    group: str
    topic: str
    #: the half's commit-log offset
    transaction_offset: int
    decision: Decision
    #: what the half was when decided: "pending" (its producer had not decided yet) or
    #: "parked" (undecided after the last check-back)
    was: Literal["pending", "parked"]
    reason: str
    #: who said so (as the client named its operator) and from where (the connection)
    operator: str
    address: str
    decided_timestamp: int
    #: RECHECK: the commit-log offset of the half's new copy, checked from then on
    recheck_offset: int | None = None


class TransactionList(Response, frozen=True, kw_only=True, omit_defaults=True):
    transactions: list[TransactionRow]
    #: for ``state="decided"``: the operators' decisions, newest first
    decisions: list[DecisionRow] = []


class GetTransactions(Request[TransactionList], frozen=True, kw_only=True, omit_defaults=True):
    """Half messages still undecided (pending) or parked after the last check, oldest first;
    or the operators' decisions (decided), newest first."""

    CODE = RequestCode.GET_TRANSACTIONS
    state: Literal["pending", "parked", "decided"] = "pending"
    max: int = 100
    group: str | None = None


class Decided(Response, frozen=True, kw_only=True, omit_defaults=True):
    """What an operator's request decided (none: nothing matched ``all``)."""

    decisions: list[DecisionRow]


class DecideTransaction(Request[Decided], frozen=True, kw_only=True, omit_defaults=True):
    """An operator finishes a transaction: COMMIT or ROLLBACK a half message that is
    pending or parked, or RECHECK a parked one (check-backs start again from zero).

    The half is named by ``msg_id`` or ``transaction_offset``; ``all`` (RECHECK only) takes
    every parked half (of ``group``, if given).  COMMIT and ROLLBACK need a ``reason``."""

    CODE = RequestCode.DECIDE_TRANSACTION
    decision: Decision
    msg_id: str = ""
    transaction_offset: int | None = None
    all: bool = False
    group: str | None = None
    reason: str = ""
    operator: str = ""
