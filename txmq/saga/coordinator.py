"""The coordinator of sagas, in the service that starts them: their state lives in its
database, and each change of it commits together with the command it causes (txmq's
transactional message: the broker checks back with the transaction log when in doubt).

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
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from txmq.client.producer import SendResult
from txmq.consumer.push import ConsumeResult
from txmq.observability import hooks as observe
from txmq.protocol.message import Message, MessageExt
from txmq.protocol.wire.errors import MessageNotFound, TxmqError
from txmq.saga import decide
from txmq.saga.decide import Decision
from txmq.saga.model import (
    REPLY_TOPIC,
    Command,
    Saga,
    State,
    command_topic,
    decode_reply,
    encode,
)
from txmq.saga.service import SagaService
from txmq.saga.views import saga_info
from txmq.sqla.local import AsyncLocalTransaction, LocalTransaction, transaction
from txmq.sqla.tables import saga_steps, sagas

__all__ = ["Coordinator", "Ended", "SagaStart"]

log = logging.getLogger("txmq.saga")


def _message(cmd: Command) -> Message:
    key = f"{cmd.saga_id}/{cmd.step}/{cmd.op}"
    return Message(command_topic(cmd.service), encode(cmd), tags=cmd.op, keys=[key])


@dataclass(frozen=True)
class Ended:
    """A saga that has just ended, as the coordinator's ``on_end`` sees it."""

    saga_id: str
    #: the saga's name (its definition's)
    name: str
    #: COMPLETED or COMPENSATED
    state: str
    #: the data it started with, merged with each step's result
    data: dict[str, Any]
    #: why it compensated: the step that said no, failed or timed out, and its words
    error: str | None


def _ended(row: Any, decision: Decision) -> Ended | None:
    state = decision.values.get("state")
    if state not in State.ENDED:
        return None
    values = decision.values
    return Ended(
        row.saga_id,
        row.name,
        state,
        dict(values.get("data", row.data)),
        values["error"] if "error" in values else row.error,
    )


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
    ) -> None:
        super().__init__(service, producer, sessions)
        self.on_end = on_end
        self.sagas = {s.name: s for s in sagas}
        if len(self.sagas) != len(sagas):
            raise ValueError("two sagas have the same name")

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

        return self._decide(reply.saga_id, choose)

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

        return self._decide(saga_id, choose)

    # -- one transaction of the coordinator -------------------------------------------------

    def _decide(self, saga_id: str, choose: Any) -> Any:
        """Read the saga's row, decide, write and send, in one local transaction; again
        (a few times) if the row changed between the read and the write."""
        if self.is_async:

            async def deciding() -> ConsumeResult:
                for _ in range(STALE_TRIES - 1):
                    try:
                        return await self._apply_async(saga_id, choose)
                    except _Stale as stale:
                        log.info("%s: decided again", stale)
                return await self._apply_async(saga_id, choose)

            return deciding()
        for _ in range(STALE_TRIES - 1):
            try:
                return self._apply(saga_id, choose)
            except _Stale as stale:
                log.info("%s: decided again", stale)
        return self._apply(saga_id, choose)

    def _select(self, saga_id: str) -> Any:
        return select(sagas).where(sagas.c.saga_id == saga_id).with_for_update()

    def _saga_of(self, row: Any) -> Saga | None:
        """The definition a saga started with (stored with it)."""
        if row is None:
            return None
        try:
            return Saga.from_dict(row.definition)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("saga %s has a definition this version cannot read: %s", row.saga_id, exc)
            return None

    async def _apply_async(self, saga_id: str, choose: Any) -> ConsumeResult:
        async with self.sessions() as session:
            # the row, locked; a decision that sends something makes this a local
            # transaction with its messages (its log row joins it), one that does not (the
            # saga ended, or waits for an operator) commits as it is
            row = (await session.execute(self._select(saga_id))).first()
            decision = choose(self._saga_of(row), row)
            if decision is None:
                await session.rollback()
                return ConsumeResult.SUCCESS
            outgoing = _outgoing(decision, self.service)
            ended = _ended(row, decision) if self.on_end is not None else None
            if outgoing:
                async with transaction(self.producer, session) as tx:
                    for msg in outgoing:
                        sent = await tx.send(msg, sharding_key=saga_id)
                        _sent_deadline(decision, msg, sent.msg_id)
                    for stmt, params in _writes(row, decision):
                        _changed(await session.execute(stmt, params), params, row)
            else:
                for stmt, params in _writes(row, decision):
                    _changed(await session.execute(stmt, params), params, row)
                if ended is not None:
                    done = self.on_end(ended, session)  # type: ignore[misc]
                    if inspect.isawaitable(done):
                        await done
                await session.commit()
        _committed(row.name, decision, row.state)
        if decision.recall is not None:
            try:
                await self.producer.recall(self.topic, decision.recall)
            except TxmqError as exc:
                _not_recalled(decision.recall, exc)
        return ConsumeResult.SUCCESS

    def _apply(self, saga_id: str, choose: Any) -> ConsumeResult:
        with self.sessions() as session:  # (as _apply_async)
            row = session.execute(self._select(saga_id)).first()
            decision = choose(self._saga_of(row), row)
            if decision is None:
                session.rollback()
                return ConsumeResult.SUCCESS
            outgoing = _outgoing(decision, self.service)
            ended = _ended(row, decision) if self.on_end is not None else None
            if outgoing:
                with transaction(self.producer, session) as tx:
                    for msg in outgoing:
                        sent = tx.send(msg, sharding_key=saga_id)
                        _sent_deadline(decision, msg, sent.msg_id)
                    for stmt, params in _writes(row, decision):
                        _changed(session.execute(stmt, params), params, row)
            else:
                for stmt, params in _writes(row, decision):
                    _changed(session.execute(stmt, params), params, row)
                if ended is not None:
                    self.on_end(ended, session)  # type: ignore[misc]
                session.commit()
        _committed(row.name, decision, row.state)
        if decision.recall is not None:
            try:
                self.producer.recall(self.topic, decision.recall)
            except TxmqError as exc:
                _not_recalled(decision.recall, exc)
        return ConsumeResult.SUCCESS


def _outgoing(decision: Decision, coordinator: str) -> list[Message]:
    """The messages a decision sends: its command, and the command's deadline (an answer
    to itself, delayed until then)."""
    out = [] if decision.command is None else [_message(decision.command)]
    if decision.deadline is not None:
        expired, seconds = decision.deadline
        key = f"{expired.saga_id}/{expired.step}/deadline"
        body = encode(expired)
        delay = timedelta(seconds=seconds)
        out.append(Message(REPLY_TOPIC.format(coordinator), body, tags="timeout", keys=[key],
                           delay=delay))  # fmt: skip
    return out


def _sent_deadline(decision: Decision, msg: Message, msg_id: str) -> None:
    if msg.tags == "timeout":
        decision.values["deadline_id"] = msg_id


def _not_recalled(msg_id: str, exc: TxmqError) -> None:
    """A deadline message its answer did not recall: delivered already (it finds the saga
    past its step and is ignored), or the broker could not be asked (then it comes, and is
    ignored the same way)."""
    if not isinstance(exc, MessageNotFound):
        log.warning(
            "could not recall deadline message %s (%s): it is ignored when due", msg_id, exc
        )


def _committed(name: str, decision: Decision, before: str | None = None) -> None:
    """Metrics of a decision, once its transaction committed (``before``: the saga's state
    until then; None: it started)."""
    state = decision.values.get("state")
    if state is not None and state != before:
        observe.saga_state(name, state)
    if decision.took is not None:
        observe.saga_step(name, *decision.took)


class _Stale(Exception):
    """The saga's row changed between this transaction's read and its write: another
    answer's transaction came in between (SQLite has no row locks: its SELECT ... FOR
    UPDATE locks nothing until the first write)."""


#: how many times an answer is decided on a row that changed meanwhile, before its
#: delivery fails (and comes again later)
STALE_TRIES = 5


def _writes(row: Any, decision: Decision) -> list[tuple[Any, Any]]:
    """The statements (and parameters) of a decision that changes a saga's row: the row's
    update only if it is still as read (every decision changes its state or the command it
    waits for), then the step log."""
    out: list[tuple[Any, Any]] = []
    if decision.values:
        values = {**decision.values, "updated_at": func.now()}
        c = sagas.c
        as_read = update(sagas).where(
            c.saga_id == row.saga_id,
            c.state == row.state,
            c.command_id.is_not_distinct_from(row.command_id),
        )
        out.append((as_read.values(**values), None))
    if decision.log:
        out.append((insert(saga_steps), decision.log))
    return out


def _changed(result: Any, params: Any, row: Any) -> None:
    """Raise :class:`_Stale` when the row's update (the statement without parameters)
    found the row no longer as read."""
    if params is None and result.rowcount != 1:
        raise _Stale(f"saga {row.saga_id} changed while an answer was decided")


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

    def _row(self) -> Any:
        return insert(sagas).values(**self._first.values)

    def _deadline(self, msg_id: str) -> Any:
        return update(sagas).where(sagas.c.saga_id == self.saga_id).values(deadline_id=msg_id)

    def __enter__(self) -> SagaStart:
        tx = self._tx
        assert isinstance(tx, LocalTransaction), "a sync session needs 'with', not 'async with'"
        tx.__enter__()
        try:
            tx.session.execute(self._row())
            tx.session.execute(insert(saga_steps), self._first.log)
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
                for msg in _outgoing(self._first, self._first.values["coordinator"]):
                    sent = tx.send(msg, sharding_key=self.saga_id)
                    self.sent.append(sent)
                    if msg.tags == "timeout":
                        tx.session.execute(self._deadline(sent.msg_id))
            except BaseException as err:
                tx.__exit__(type(err), err, err.__traceback__)
                raise
        tx.__exit__(et, exc, tb)
        if exc is None:
            _committed(self._first.values["name"], self._first)

    async def __aenter__(self) -> SagaStart:
        tx = self._tx
        assert isinstance(tx, AsyncLocalTransaction), "an AsyncSession needs 'async with'"
        await tx.__aenter__()
        try:
            await tx.session.execute(self._row())
            await tx.session.execute(insert(saga_steps), self._first.log)
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
                for msg in _outgoing(self._first, self._first.values["coordinator"]):
                    sent = await tx.send(msg, sharding_key=self.saga_id)
                    self.sent.append(sent)
                    if msg.tags == "timeout":
                        await tx.session.execute(self._deadline(sent.msg_id))
            except BaseException as err:
                await tx.__aexit__(type(err), err, err.__traceback__)
                raise
        await tx.__aexit__(et, exc, tb)
        if exc is None:
            _committed(self._first.values["name"], self._first)
