"""The coordinator of sagas, in the service that starts them: their state lives in its
database.  A saga starts in the caller's local transaction with its first command as a
transactional message of it (the broker checks back with the transaction log when in
doubt); each answer's decision commits the saga's new state, then sends the command it
causes, then acknowledges the answer — an answer delivered again finds its decision taken
and sends the awaited command again (participants answer a repeat as they did the first).

::

    coordinator = Coordinator("orders", producer, async_sessionmaker(engine), [checkout])

    async with coordinator.start(session, checkout, {"order": order_id}) as saga:
        session.add(Order(id=order_id, saga_id=saga.saga_id))   # one local transaction

    consumer = txmq.PushConsumer(**coordinator.consumer_options())   # the replies
    consumer.subscribe(coordinator.topic)

``on_end(ended, session)`` (optional; a coroutine function in async mode) runs in the local
transaction that records a saga's end — COMPLETED or COMPENSATED — so what the service does
then (an order confirmed, or cancelled with the saga's error as its reason) commits with it
or not at all; if it raises, nothing commits and the answer is delivered again.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from txmq.client.producer import SendResult
from txmq.consumer.push import ConsumeResult
from txmq.protocol.message import Message, MessageExt
from txmq.protocol.wire.errors import TxmqError
from txmq.saga import decide
from txmq.saga.decide import Decision
from txmq.saga.group import MAX_GROUP, GroupCommit
from txmq.saga.model import REPLY_TOPIC, Saga, decode_reply
from txmq.saga.service import SagaService
from txmq.saga.views import saga_info
from txmq.saga.writes import (
    INSERT_SAGA,
    INSERT_STEPS,
    LAST,
    SELECT,
    STALE_TRIES,
    Ended,
    Stale,
    changed,
    committed,
    ended,
    not_recalled,
    outgoing,
    raise_if_not_safe,
    rows,
    taken,
    waits,
    writes,
)
from txmq.sqla.local import AsyncLocalTransaction, LocalTransaction, transaction

__all__ = ["Coordinator", "Ended", "SagaStart"]

log = logging.getLogger("txmq.saga")


class Coordinator(SagaService):
    """Starts sagas of the definitions ``sagas`` and drives them on their participants'
    answers (``producer`` and ``sessions``: see :class:`~txmq.saga.service.SagaService`;
    in async mode :meth:`retry` and :meth:`resolve` are coroutines)."""

    group_format = "saga-{}-coordinator"
    topic_format = REPLY_TOPIC

    def __init__(
        self,
        service: str,
        producer: Any,
        sessions: Any,
        sagas: Sequence[Saga] = (),
        *,
        on_end: Callable[[Ended, Any], Any] | None = None,
        group: int = MAX_GROUP,
    ) -> None:
        super().__init__(service, producer, sessions)
        self.on_end = on_end
        self.sagas = {s.name: s for s in sagas}
        if len(self.sagas) != len(sagas):
            raise ValueError("two sagas have the same name")
        #: each definition as stored with its sagas: a row that stores the same one is
        #: driven by the definition itself, not one rebuilt from the row every answer
        self._stored = {name: (s.to_dict(), s) for name, s in self.sagas.items()}
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(
                f"group is the most answers decided in one transaction (1 or more), not {group!r}"
            )
        #: answers that queue up are decided together, ``group`` at most in one local
        #: transaction (txmq.saga.group; 1: each answer in its own, all at once)
        self.group_commit = (
            GroupCommit(
                sessions=sessions,
                producer=producer,
                service=self.service,
                topic=self.topic,
                saga_of=self._saga_of,
                on_end=on_end,
                alone=self._alone_async if self.is_async else self._alone,
                max_group=group,
            )
            if group > 1
            else None
        )

    def definition(self, saga: Saga | str) -> Saga:
        name = saga.name if isinstance(saga, Saga) else saga
        found = self.sagas.get(name)
        if found is None:
            raise LookupError(
                f"no saga {name!r} in coordinator {self.service!r}: {sorted(self.sagas)}"
            )
        return found

    # -- starting ----------------------------------------------------------------------------

    def start(
        self,
        session: Session | AsyncSession,
        saga: Saga | str,
        data: dict[str, Any],
        *,
        saga_id: str | None = None,
    ) -> SagaStart:
        """Start a saga in ``session``'s local transaction (``with`` / ``async with``): the
        saga's row and its first command commit together with what the block writes; an
        exception in the block rolls all of it back."""
        definition = self.definition(saga)
        if not isinstance(data, dict):
            raise TypeError(f"a saga's data is a dict, not {type(data).__name__}")
        saga_id = saga_id or uuid.uuid4().hex
        if not 0 < len(saga_id) <= 64:
            raise ValueError("saga_id must be 1 to 64 characters")
        tx = transaction(self.producer, session)
        return SagaStart(tx, decide.first(definition, saga_id, data, self.service))

    # -- answers -----------------------------------------------------------------------------

    def listener(self, msg: MessageExt) -> Any:
        """The push consumer's listener of replies (a coroutine's result when async)."""
        try:
            reply = decode_reply(msg.body)
        except Exception as exc:
            log.error("saga reply %s is malformed (%s): dead-lettered", msg.msg_id, exc)
            return ConsumeResult.DEAD_LETTER

        def choose(saga: Saga | None, row: Any) -> Decision | None:
            if row is not None and saga is None:  # retried, then kept in the dead letters
                raise ValueError(f"saga {row.saga_id}: its definition cannot be read here")
            return None if saga is None else decide.on_reply(saga, row, reply, self.service)

        answered = (reply.command_id, reply.outcome)
        return self._decide(reply.saga_id, choose, answered=answered)

    # -- reading -----------------------------------------------------------------------------

    def saga(self, saga_id: str) -> Any:
        """The saga with its step log (:class:`~txmq.saga.views.SagaInfo`, None when there
        is none); a coroutine in async mode."""
        return self._read(lambda conn: saga_info(conn, saga_id))

    def state(self, saga_id: str) -> Any:
        """The saga's state (None when there is no such saga); a coroutine in async mode."""
        return self._read(lambda conn: getattr(saga_info(conn, saga_id), "state", None))

    def _read(self, read: Callable[[Connection], Any]) -> Any:
        if not self.is_async:
            with self.sessions() as session:
                return read(session.connection())

        async def reading() -> Any:
            async with self.sessions() as session:
                conn = await session.connection()
                return await conn.run_sync(read)

        return reading()

    # -- operators ---------------------------------------------------------------------------

    def retry(self, saga_id: str, *, operator: str, reason: str) -> Any:
        """Send a parked saga's failing compensation again."""
        return self._operate(saga_id, decide.operator_retry, operator, reason)

    def resolve(self, saga_id: str, *, operator: str, reason: str) -> Any:
        """A parked saga's failing compensation was done by hand: go on with the steps
        before it."""
        return self._operate(saga_id, decide.operator_resolve, operator, reason)

    def _operate(self, saga_id: str, how: Any, operator: str, reason: str) -> Any:
        def choose(saga: Saga | None, row: Any) -> Decision:
            if row is None or saga is None:
                raise LookupError(f"no saga {saga_id} of this coordinator's in its database")
            made: Decision = how(saga, row, operator, reason, self.service)
            return made

        # no answer to redeliver should this process die before the command left: the
        # command is a transactional message of the decision's transaction
        return self._decide(saga_id, choose, transactional=True)

    # -- one transaction of the coordinator -------------------------------------------------
    #
    # An answer's decision commits the saga's row and step log, then sends the command it
    # causes, and only then is the answer acknowledged.  Should the coordinator die in
    # between, the answer comes again; its decision is found taken (the step log's latest
    # answer is this one), and the command the saga waits on is sent again — the same
    # command, which the participant's barrier answers again if it ran already.  A start
    # and an operator's action have no answer to come again: their commands are
    # transactional messages of their transactions.

    def _decide(
        self,
        saga_id: str,
        choose: Any,
        *,
        answered: tuple[str, str] | None = None,
        transactional: bool = False,
    ) -> Any:
        """Read the saga's row, decide, write, then send; again (a few times) if the row
        changed between the read and the write."""
        group = self.group_commit
        if self.is_async:
            if answered is not None and group is not None:
                return group.decide(saga_id, choose, answered)
            return self._alone_async(saga_id, choose, answered, transactional)
        if answered is not None and group is not None:
            return group.decide_sync(saga_id, choose, answered)
        return self._alone(saga_id, choose, answered, transactional)

    def _alone(
        self,
        saga_id: str,
        choose: Any,
        answered: tuple[str, str] | None,
        transactional: bool = False,
    ) -> ConsumeResult:
        """An answer (or an operator's action) decided in a transaction of its own."""
        for _ in range(STALE_TRIES - 1):
            try:
                return self._apply(saga_id, choose, answered, transactional)
            except Stale as stale:
                log.info("%s: decided again", stale)
        return self._apply(saga_id, choose, answered, transactional)

    async def _alone_async(
        self,
        saga_id: str,
        choose: Any,
        answered: tuple[str, str] | None,
        transactional: bool = False,
    ) -> ConsumeResult:
        """An answer (or an operator's action) decided in a transaction of its own."""
        for _ in range(STALE_TRIES - 1):
            try:
                return await self._apply_async(saga_id, choose, answered, transactional)
            except Stale as stale:
                log.info("%s: decided again", stale)
        return await self._apply_async(saga_id, choose, answered, transactional)

    def _saga_of(self, row: Any) -> Saga | None:
        """The definition a saga started with (stored with it)."""
        if row is None:
            return None
        known = self._stored.get(row.name)
        if known is not None and known[0] == row.definition:
            return known[1]
        try:
            return Saga.from_dict(row.definition)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("saga %s has a definition this version cannot read: %s", row.saga_id, exc)
            return None

    async def _apply_async(
        self, saga_id: str, choose: Any, answered: tuple[str, str] | None, transactional: bool
    ) -> ConsumeResult:
        async with self.sessions() as session:
            # the row, locked; the decision's writes commit together, then its messages
            # leave (in one local transaction with them when ``transactional``)
            row = (await session.execute(SELECT, {"saga_id": saga_id})).first()
            saga = self._saga_of(row)
            decision = choose(saga, row)
            if decision is None:
                if answered is not None and waits(row):
                    last = (await session.execute(LAST, {"saga_id": saga_id})).first()
                    if taken(last, answered):
                        decision = decide.again(saga, row, self.service)  # type: ignore[arg-type]
                await session.rollback()
                if decision is not None:
                    await self._send_async(decision, saga_id)
                return ConsumeResult.SUCCESS
            msgs = outgoing(decision, self.service)
            end = ended(row, decision) if self.on_end is not None else None
            if msgs and transactional:
                async with transaction(self.producer, session) as tx:
                    for msg in msgs:
                        await tx.send(msg, sharding_key=saga_id)
                    for stmt, params, conditioned in writes(row, decision):
                        changed(await session.execute(stmt, params), conditioned, row)
                committed(row.name, decision, row.state)
            else:
                for stmt, params, conditioned in writes(row, decision):
                    changed(await session.execute(stmt, params), conditioned, row)
                if end is not None:
                    done = self.on_end(end, session)  # type: ignore[misc]
                    if inspect.isawaitable(done):
                        await done
                await session.commit()
                committed(row.name, decision, row.state)
                await self._send_async(decision, saga_id, msgs)
        if decision.recall is not None:
            try:
                await self.producer.recall(self.topic, decision.recall)
            except TxmqError as exc:
                not_recalled(decision.recall, exc)
        return ConsumeResult.SUCCESS

    async def _send_async(
        self, decision: Decision, saga_id: str, msgs: list[Message] | None = None
    ) -> None:
        for msg in outgoing(decision, self.service) if msgs is None else msgs:
            raise_if_not_safe(await self.producer.send(msg, sharding_key=saga_id))

    def _apply(
        self, saga_id: str, choose: Any, answered: tuple[str, str] | None, transactional: bool
    ) -> ConsumeResult:
        with self.sessions() as session:  # (as _apply_async)
            row = session.execute(SELECT, {"saga_id": saga_id}).first()
            saga = self._saga_of(row)
            decision = choose(saga, row)
            if decision is None:
                if answered is not None and waits(row):
                    last = session.execute(LAST, {"saga_id": saga_id}).first()
                    if taken(last, answered):
                        decision = decide.again(saga, row, self.service)  # type: ignore[arg-type]
                session.rollback()
                if decision is not None:
                    self._send(decision, saga_id)
                return ConsumeResult.SUCCESS
            msgs = outgoing(decision, self.service)
            end = ended(row, decision) if self.on_end is not None else None
            if msgs and transactional:
                with transaction(self.producer, session) as tx:
                    for msg in msgs:
                        tx.send(msg, sharding_key=saga_id)
                    for stmt, params, conditioned in writes(row, decision):
                        changed(session.execute(stmt, params), conditioned, row)
                committed(row.name, decision, row.state)
            else:
                for stmt, params, conditioned in writes(row, decision):
                    changed(session.execute(stmt, params), conditioned, row)
                if end is not None:
                    self.on_end(end, session)  # type: ignore[misc]
                session.commit()
                committed(row.name, decision, row.state)
                self._send(decision, saga_id, msgs)
        if decision.recall is not None:
            try:
                self.producer.recall(self.topic, decision.recall)
            except TxmqError as exc:
                not_recalled(decision.recall, exc)
        return ConsumeResult.SUCCESS

    def _send(self, decision: Decision, saga_id: str, msgs: list[Message] | None = None) -> None:
        for msg in outgoing(decision, self.service) if msgs is None else msgs:
            raise_if_not_safe(self.producer.send(msg, sharding_key=saga_id))


class SagaStart:
    """``with`` / ``async with coordinator.start(...)``: the local transaction a saga starts
    in (``session``, ``saga_id``)."""

    def __init__(self, tx: LocalTransaction | AsyncLocalTransaction, first: Decision) -> None:
        self._tx = tx
        self._first = first
        self.saga_id: str = first.values["saga_id"]
        #: what the broker said of the messages the start sent (its first command, then
        #: its deadline if the step has one): message ids, the broker set that stored them
        self.sent: list[SendResult] = []

    @property
    def session(self) -> Any:
        return self._tx.session

    def __enter__(self) -> SagaStart:
        tx = self._tx
        assert isinstance(tx, LocalTransaction), "a sync session needs 'with', not 'async with'"
        tx.__enter__()
        try:
            tx.session.execute(INSERT_SAGA, self._first.values)
            tx.session.execute(INSERT_STEPS, rows(self._first.log))
        except BaseException as exc:
            tx.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tx = self._tx
        assert isinstance(tx, LocalTransaction)
        if exc is None:
            try:
                for msg in outgoing(self._first, self._first.values["coordinator"]):
                    self.sent.append(tx.send(msg, sharding_key=self.saga_id))
            except BaseException as err:
                tx.__exit__(type(err), err, err.__traceback__)
                raise
        tx.__exit__(et, exc, tb)
        if exc is None:
            committed(self._first.values["name"], self._first)

    async def __aenter__(self) -> SagaStart:
        tx = self._tx
        assert isinstance(tx, AsyncLocalTransaction), "an AsyncSession needs 'async with'"
        await tx.__aenter__()
        try:
            await tx.session.execute(INSERT_SAGA, self._first.values)
            await tx.session.execute(INSERT_STEPS, rows(self._first.log))
        except BaseException as exc:
            await tx.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tx = self._tx
        assert isinstance(tx, AsyncLocalTransaction)
        if exc is None:
            try:
                for msg in outgoing(self._first, self._first.values["coordinator"]):
                    self.sent.append(await tx.send(msg, sharding_key=self.saga_id))
            except BaseException as err:
                await tx.__aexit__(type(err), err, err.__traceback__)
                raise
        await tx.__aexit__(et, exc, tb)
        if exc is None:
            committed(self._first.values["name"], self._first)
