"""The operator's side of transactional (half) messages, a part of
:class:`txmq.admin.client.AdminClient`: list the pending, parked and decided ones, and finish one
(COMMIT or ROLLBACK with a reason) or check a parked one back again (RECHECK)."""

from __future__ import annotations

import getpass
import socket
from typing import Literal

import msgspec

from txmq.admin.fanout import BrokerAddress, ClusterClient, merged
from txmq.protocol.wire import DecideTransaction, DecisionRow, GetTransactions, TransactionRow
from txmq.protocol.wire.errors import TransactionNotFound

__all__ = ["BrokerDecisionRow", "BrokerTransactionRow", "TransactionAdmin", "operator_name"]

Decision = Literal["COMMIT", "ROLLBACK", "RECHECK"]
#: how a broker that has no such half message says so
_NONE_HERE = "no half message"


class BrokerTransactionRow(TransactionRow, frozen=True, kw_only=True, omit_defaults=True):
    """A :class:`TransactionRow` and the broker set that holds the half message."""

    broker_name: str = ""


class BrokerDecisionRow(DecisionRow, frozen=True, kw_only=True, omit_defaults=True):
    """A :class:`DecisionRow` and the broker set that holds the half message."""

    broker_name: str = ""


def operator_name() -> str:
    """Who an operator's decision names by default: ``user@host`` of this process."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


class TransactionAdmin(ClusterClient):
    """Transactions, for :class:`txmq.admin.client.AdminClient`."""

    async def transactions(
        self,
        state: str = "pending",
        max: int = 100,
        *,
        group: str | None = None,
        broker: str | None = None,
    ) -> list[BrokerTransactionRow]:
        """Half messages still undecided (``"pending"``) or parked after the last check
        (``"parked"``), oldest first (parked ones with their ``parked_timestamp``), over
        every broker (each row naming its ``broker_name``; at most ``max`` in all)."""
        if state == "pending":
            request = GetTransactions(state="pending", max=max, group=group)
        elif state == "parked":
            request = GetTransactions(state="parked", max=max, group=group)
        else:
            raise ValueError("state must be 'pending' or 'parked' (decisions: decisions())")

        async def rows(target: BrokerAddress) -> list[BrokerTransactionRow]:
            answer = await self.ask(target, request)
            return [
                BrokerTransactionRow(**msgspec.structs.asdict(r), broker_name=target.broker_name)
                for r in answer.transactions
            ]

        found = await self._each(await self.brokers(broker=broker), rows)
        max = max if max > 0 else 1  # as a broker takes it
        if state == "parked":
            return merged([r for _, r in found], lambda r: r.parked_timestamp or 0, max)
        return merged([r for _, r in found], lambda r: r.born_timestamp, max)

    async def decisions(
        self, max: int = 100, *, group: str | None = None, broker: str | None = None
    ) -> list[BrokerDecisionRow]:
        """The operators' decisions on half messages (:meth:`decide_transaction`), newest
        first, over every broker (at most ``max`` in all)."""
        request = GetTransactions(state="decided", max=max, group=group)

        async def rows(target: BrokerAddress) -> list[BrokerDecisionRow]:
            answer = await self.ask(target, request)
            return [_named(r, target) for r in answer.decisions]

        found = await self._each(await self.brokers(broker=broker), rows)
        return merged([r for _, r in found], lambda r: -r.decided_timestamp, max if max > 0 else 1)

    async def decide_transaction(
        self,
        decision: Decision,
        *,
        msg_id: str | None = None,
        transaction_offset: int | None = None,
        all: bool = False,
        group: str | None = None,
        reason: str = "",
        operator: str | None = None,
        broker: str | None = None,
    ) -> list[BrokerDecisionRow]:
        """Finish a transaction as an operator: ``"COMMIT"`` or ``"ROLLBACK"`` the half
        message ``msg_id`` (pending, or parked after the last check-back) with a
        ``reason``, or ``"RECHECK"`` a parked one (``all=True``: every parked one, of
        ``group`` if given) so that its producer group is asked again from the first check.

        The broker records each decision durably (``decisions()`` lists them) and logs it.
        A half its producer already decided is refused (:class:`TransactionNotFound`,
        saying how it was resolved).  ``transaction_offset`` (a commit-log offset) names a
        half on one broker: in a cluster, say which broker set (``broker``)."""
        if decision not in ("COMMIT", "ROLLBACK", "RECHECK"):
            raise ValueError("decision must be COMMIT, ROLLBACK or RECHECK")
        if decision != "RECHECK" and not reason.strip():
            raise ValueError(f"{decision} by an operator needs a reason")
        if not all and not msg_id and transaction_offset is None:
            raise ValueError("say which half message: msg_id or transaction_offset (or all)")
        request = DecideTransaction(
            decision=decision,
            msg_id=msg_id or "",
            transaction_offset=transaction_offset,
            all=all,
            group=group,
            reason=reason,
            operator=operator or operator_name(),
        )
        targets = await self.brokers(broker=broker)
        if transaction_offset is not None and len(targets) > 1:
            raise ValueError("a commit-log offset names a half on one broker: say which (broker)")

        async def ask(target: BrokerAddress) -> list[BrokerDecisionRow]:
            answer = await self.ask(target, request)
            return [_named(r, target) for r in answer.decisions]

        if all:
            found = await self._all_or_raise(targets, ask, "re-checked")
            return [row for _, rows in found for row in rows]
        # the half is on one broker set; the others answer that they have none
        answers, errors = await self._gather(targets, ask)
        if answers:
            return [row for i in sorted(answers) for row in answers[i]]
        failed = [errors[i] for i in sorted(errors)]
        if len(failed) > 1 and any(isinstance(e, TransactionNotFound) for e in failed):
            # the broker that has the half says more than those that have none
            failed.sort(key=lambda e: str(e).startswith(_NONE_HERE))
        raise failed[0]


def _named(row: DecisionRow, target: BrokerAddress) -> BrokerDecisionRow:
    return BrokerDecisionRow(**msgspec.structs.asdict(row), broker_name=target.broker_name)
