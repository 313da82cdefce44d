"""One local transaction: business rows, the transaction-log row and half messages.

::

    async with txmq.sqla.transaction(producer, session) as tx:
        session.add(Order(id=order_id, ...))
        await tx.send(Message("orders", body, keys=[order_id]), sharding_key=order_id)

The same without ``async`` for a ``Session`` and a ``txmq.sync.TransactionProducer``.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, Unpack, overload

import anyio
from sqlalchemy import Insert, insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

from txmq.client.producer import SendOptions, SendResult, not_yet_safe
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message
from txmq.sqla.tables import COMMITTED, transaction_log

__all__ = [
    "AsyncLocalTransaction",
    "AsyncTransactionalProducer",
    "LocalTransaction",
    "TransactionalProducer",
    "transaction",
]

log = logging.getLogger("txmq.sqla")

COMMIT = LocalTransactionState.COMMIT
ROLLBACK = LocalTransactionState.ROLLBACK
UNKNOWN = LocalTransactionState.UNKNOWN

#: built once: a statement made per transaction with ``.values()`` costs tens of
#: microseconds to build and to compute its cache key, every time
_LOG_INSERT: Insert = insert(transaction_log)


class AsyncTransactionalProducer(Protocol):
    """What :func:`transaction` needs of an async producer (``txmq.TransactionProducer``)."""

    async def send_half(
        self, msg: Message, *, transaction_id: str, **options: Unpack[SendOptions]
    ) -> SendResult: ...

    async def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str: ...


class TransactionalProducer(Protocol):
    """What :func:`transaction` needs of a blocking producer
    (``txmq.sync.TransactionProducer``)."""

    def send_half(
        self, msg: Message, *, transaction_id: str, **options: Unpack[SendOptions]
    ) -> SendResult: ...

    def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str: ...


P = TypeVar("P")
S = TypeVar("S", Session, AsyncSession)


class _Base(Generic[P, S]):
    """State and decisions shared by the sync and the async context manager."""

    _async: bool

    def __init__(
        self,
        producer: P,
        session: Any,
        *,
        group: str | None = None,
        transaction_id: str | None = None,
    ) -> None:
        send_half = getattr(producer, "send_half", None)
        if send_half is None or not hasattr(producer, "end_transaction"):
            raise TypeError(
                f"{type(producer).__name__} is not a transaction producer: it needs "
                "send_half() and end_transaction() (use txmq's TransactionProducer)"
            )
        if inspect.iscoroutinefunction(send_half) != self._async:
            want = "an async" if self._async else "a blocking"
            raise TypeError(
                f"{type(self).__name__} needs {want} producer "
                f"({'txmq' if self._async else 'txmq.sync'}.TransactionProducer); "
                f"got {type(producer).__module__}.{type(producer).__name__}"
            )
        if transaction_id is not None and not 0 < len(transaction_id) <= 64:
            raise ValueError("transaction_id must be 1 to 64 characters")
        self.producer = producer
        self.group: str = group or _group_of(producer)
        self.transaction_id: str = transaction_id or uuid.uuid4().hex
        self.results: list[SendResult] = []
        """One :class:`SendResult` per half message sent, in order."""
        self.state: LocalTransactionState | None = None
        """After the block: COMMIT, ROLLBACK, or UNKNOWN when the database commit failed
        in a way that leaves its outcome in doubt (then the broker's check-back decides)."""
        self._session_arg = session
        self._session: S | None = None
        self._root: SessionTransaction | None = None
        self._open = False

    @property
    def session(self) -> S:
        """The session the local transaction runs in (made by :func:`transaction` when it
        was given a session factory)."""
        if self._session is None:
            raise RuntimeError("the transaction has not started: use it as a context manager")
        return self._session

    def _log_row(self) -> dict[str, str]:
        """The parameters of :data:`_LOG_INSERT` for this transaction."""
        return {
            "transaction_id": self.transaction_id,
            "producer_group": self.group,
            "state": COMMITTED,
        }

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                f"transaction {self.transaction_id} is not open: send inside its 'with' block"
            )

    def _sync_session(self) -> Session:
        s = self.session
        return s.sync_session if isinstance(s, AsyncSession) else s

    def _started(self) -> None:
        self._root = self._sync_session().get_transaction()
        self._open = True

    def _ended_inside_block(self) -> bool:
        """True if user code committed or rolled back the session inside the block: then
        this context no longer knows the outcome, and leaves it to the check-back."""
        return self._sync_session().get_transaction() is not self._root

    def _misuse(self) -> RuntimeError:
        return RuntimeError(
            f"the session's transaction was committed or rolled back inside "
            f"txmq.sqla.transaction() (transaction {self.transaction_id}); let the block end "
            "instead. Its half messages are left to the broker's check-back, which decides "
            "from txmq_transaction_log."
        )

    def _after_failed_commit(self, exc: BaseException, flushed: bool) -> LocalTransactionState:
        """ROLLBACK when the failed commit surely did not commit, UNKNOWN when it may have."""
        if not flushed:
            return ROLLBACK  # COMMIT was never sent
        if not isinstance(exc, DBAPIError) or exc.connection_invalidated:
            return UNKNOWN  # cancelled or disconnected while COMMIT was on its way
        dialect = self._sync_session().get_bind().dialect.name
        if dialect == "sqlite":
            return ROLLBACK  # an error answer to COMMIT; the rollback that follows undoes it
        sqlstate = getattr(exc.orig, "sqlstate", None)
        if dialect == "postgresql" and isinstance(sqlstate, str):
            # The server answered COMMIT with an error: not committed — unless it is a
            # connection or shutdown error, after which nobody can be sure.
            return UNKNOWN if sqlstate.startswith(("08", "57P")) else ROLLBACK
        return UNKNOWN

    def _note_missing_table(self, exc: BaseException) -> None:
        text = str(exc)
        if transaction_log.name in text and ("does not exist" in text or "no such table" in text):
            exc.add_note(
                "txmq's tables are missing: run 'txmq db upgrade --url <database url>' or "
                "call txmq.sqla.upgrade(connection) from your alembic env.py"
            )

    def _ending_failed(
        self, result: SendResult, state: LocalTransactionState, exc: Exception
    ) -> None:
        log.warning(
            "could not end transaction %s with %s for message %s (%s); the broker's "
            "check-back will resolve it from %s",
            self.transaction_id,
            state,
            result.msg_id,
            exc,
            transaction_log.name,
        )

    def _left_to_check(self, why: str) -> None:
        if self.results:
            log.warning(
                "transaction %s: %s; its %d half message(s) are left to the broker's "
                "check-back, which decides from %s",
                self.transaction_id,
                why,
                len(self.results),
                transaction_log.name,
            )


class AsyncLocalTransaction(_Base[AsyncTransactionalProducer, AsyncSession]):
    """One local transaction in an :class:`AsyncSession`, with its half messages.

    On enter a transaction id is made and the log row (``COMMITTED``) is inserted through
    the session at once, so the row — and its primary-key lock — exists before any half
    message is sent. :meth:`send` sends a half message right away. When the block ends
    normally the session is committed, then every half message is committed at the broker
    (in send order). When the block raises, or the database commit fails, the session is
    rolled back, every half message is rolled back, and the exception propagates.

    If ending a half message fails after the database commit (the broker is unreachable)
    nothing is raised — the business transaction did commit: the failure is logged and the
    broker's check-back resolves the message (:class:`SqlTransactionChecker` answers
    COMMIT from the log row). A commit whose outcome is in doubt (the connection broke
    while COMMIT was on its way, or the task was cancelled then) ends nothing and
    re-raises; the check-back decides exactly from the log.
    """

    _async = True

    async def __aenter__(self) -> AsyncLocalTransaction:
        arg = self._session_arg
        self._session = arg() if isinstance(arg, async_sessionmaker) else arg
        session = self.session
        try:
            await session.execute(_LOG_INSERT, self._log_row())
        except BaseException as exc:
            self._note_missing_table(exc)
            with anyio.CancelScope(shield=True):
                await self._rollback()
                await self._close()
            raise
        self._started()
        return self

    async def send(self, msg: Message, **options: Unpack[SendOptions]) -> SendResult:
        """Send ``msg`` as a half message of this transaction (invisible to consumers
        until the block commits); returns the broker's :class:`SendResult`."""
        self._check_open()
        result = await self.producer.send_half(msg, transaction_id=self.transaction_id, **options)
        self.results.append(result)
        _raise_if_not_safe(result)
        return result

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        session = self.session
        # Shielded: once the block is over, the database and the broker must end the same
        # way, even if the surrounding task is being cancelled.
        with anyio.CancelScope(shield=True):
            try:
                if self._ended_inside_block():
                    self.state = UNKNOWN
                    await self._rollback()
                    self._left_to_check("the session was ended inside the block")
                    if exc is None:
                        raise self._misuse()
                    return
                if exc is not None:
                    await self._rollback()
                    await self._end_all(ROLLBACK)
                    return
                flushed = False
                try:
                    await session.flush()
                    flushed = True
                    await session.commit()
                except BaseException as err:
                    state = self._after_failed_commit(err, flushed)
                    await self._rollback()
                    await self._end_all(state)
                    raise
                await self._end_all(COMMIT)
            finally:
                await self._close()

    async def _end_all(self, state: LocalTransactionState) -> None:
        self.state = state
        if state is UNKNOWN:
            self._left_to_check("the database commit failed with its outcome in doubt")
            return
        for result in self.results:
            try:
                await self.producer.end_transaction(result, state, wait=False)
            except Exception as exc:
                self._ending_failed(result, state, exc)

    async def _rollback(self) -> None:
        if self._session is None:
            return
        try:
            await self._session.rollback()
        except Exception as exc:
            log.warning("transaction %s: session rollback failed: %s", self.transaction_id, exc)

    async def _close(self) -> None:
        if self._session is not None and isinstance(self._session_arg, async_sessionmaker):
            await self._session.close()


class LocalTransaction(_Base[TransactionalProducer, Session]):
    """One local transaction in a :class:`Session`, with its half messages — the blocking
    twin of :class:`AsyncLocalTransaction` (same semantics; see there)."""

    _async = False

    def __enter__(self) -> LocalTransaction:
        arg = self._session_arg
        self._session = arg() if isinstance(arg, sessionmaker) else arg
        session = self.session
        try:
            session.execute(_LOG_INSERT, self._log_row())
        except BaseException as exc:
            self._note_missing_table(exc)
            self._rollback()
            self._close()
            raise
        self._started()
        return self

    def send(self, msg: Message, **options: Unpack[SendOptions]) -> SendResult:
        """Send ``msg`` as a half message of this transaction; returns its result."""
        self._check_open()
        result = self.producer.send_half(msg, transaction_id=self.transaction_id, **options)
        self.results.append(result)
        _raise_if_not_safe(result)
        return result

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        session = self.session
        try:
            if self._ended_inside_block():
                self.state = UNKNOWN
                self._rollback()
                self._left_to_check("the session was ended inside the block")
                if exc is None:
                    raise self._misuse()
                return
            if exc is not None:
                self._rollback()
                self._end_all(ROLLBACK)
                return
            flushed = False
            try:
                session.flush()
                flushed = True
                session.commit()
            except BaseException as err:
                state = self._after_failed_commit(err, flushed)
                self._rollback()
                self._end_all(state)
                raise
            self._end_all(COMMIT)
        finally:
            self._close()

    def _end_all(self, state: LocalTransactionState) -> None:
        self.state = state
        if state is UNKNOWN:
            self._left_to_check("the database commit failed with its outcome in doubt")
            return
        for result in self.results:
            try:
                self.producer.end_transaction(result, state, wait=False)
            except Exception as exc:
                self._ending_failed(result, state, exc)

    def _rollback(self) -> None:
        if self._session is None:
            return
        try:
            self._session.rollback()
        except Exception as exc:
            log.warning("transaction %s: session rollback failed: %s", self.transaction_id, exc)

    def _close(self) -> None:
        if self._session is not None and isinstance(self._session_arg, sessionmaker):
            self._session.close()


def _group_of(producer: Any) -> str:
    for obj in (producer, getattr(producer, "aio", None)):
        group = getattr(obj, "group", None)
        if isinstance(group, str) and group:
            return group
    raise TypeError(f"cannot tell the producer group of {producer!r}: pass group=")


@overload
def transaction(
    producer: AsyncTransactionalProducer,
    session: AsyncSession | async_sessionmaker[AsyncSession],
    *,
    group: str | None = None,
    transaction_id: str | None = None,
) -> AsyncLocalTransaction: ...


@overload
def transaction(
    producer: TransactionalProducer,
    session: Session | sessionmaker[Session],
    *,
    group: str | None = None,
    transaction_id: str | None = None,
) -> LocalTransaction: ...


def transaction(
    producer: Any,
    session: Any,
    *,
    group: str | None = None,
    transaction_id: str | None = None,
) -> AsyncLocalTransaction | LocalTransaction:
    """A local transaction with transactional messages, as a context manager.

    ``async with transaction(producer, async_session) as tx`` for an :class:`AsyncSession`
    (or an ``async_sessionmaker``: a session is made, exposed as ``tx.session`` and closed
    afterwards) and a ``txmq.TransactionProducer``; ``with transaction(producer, session)``
    for a :class:`Session` (or a ``sessionmaker``) and a ``txmq.sync.TransactionProducer``.
    ``tx.send(message, ...)`` sends a half message; the block's end commits the database,
    then the messages — or rolls both back. See :class:`AsyncLocalTransaction`.

    ``group`` (default: the producer's group) is written to the log row;
    ``transaction_id`` (default: a fresh ``uuid4().hex``) must be unique forever.
    For the check-back to resolve messages whose ending was lost, give the producer a
    :class:`SqlTransactionChecker` on the same database as its ``listener``.
    """
    if isinstance(session, AsyncSession | async_sessionmaker):
        return AsyncLocalTransaction(producer, session, group=group, transaction_id=transaction_id)
    if isinstance(session, Session | sessionmaker):
        return LocalTransaction(producer, session, group=group, transaction_id=transaction_id)
    raise TypeError(
        f"expected a SQLAlchemy Session, AsyncSession or a session factory; got {session!r}"
    )


def _raise_if_not_safe(result: SendResult) -> None:
    """A half message stored on the master only (SYNC_MASTER without a slave's copy) is
    not safe to build on: raising ends the block, which rolls back the database and the
    half message alike (RocketMQ's producer does not run the local transaction then)."""
    unsafe = not_yet_safe(result)
    if unsafe is not None:
        raise unsafe
