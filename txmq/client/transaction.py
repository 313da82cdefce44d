"""Transactional messages (RocketMQ's ``TransactionMQProducer``).

Two-phase commit between a local (database) transaction and a message::

    class Orders:
        async def execute_local_transaction(self, msg, arg):
            ...  # write the business rows and a transaction-log row in ONE db transaction
            return LocalTransactionState.COMMIT

        async def check_local_transaction(self, msg):
            ...  # look the transaction id up in the transaction log
            return LocalTransactionState.COMMIT  # or ROLLBACK, or UNKNOWN (ask again later)

    async with TransactionProducer(address, "orders-tx", listener=Orders()) as producer:
        await producer.send_message_in_transaction(Message("orders", body), arg=order)

1. ``send_half`` stores a *half message*: invisible to consumers until it is committed.
2. The listener runs the local transaction.
3. ``end_transaction`` commits (the broker delivers the message) or rolls back (it never
   is).  If the producer dies before that, or answers UNKNOWN, the broker asks a live
   producer of the same group (CHECK_TRANSACTION_STATE) every ``transaction_check_interval_s``
   until the checker answers COMMIT or ROLLBACK, at most ``transaction_check_max`` times;
   then the message is parked for an operator (``txmq admin transactions --parked``).

Listener methods may be coroutine functions (run on the client's event loop) or plain
functions (run in worker threads).  An exception in ``execute_local_transaction`` counts as
UNKNOWN: the half message stays pending, the broker's check-back decides, and the exception
is re-raised to the caller after the broker was told.  A failing ``check_local_transaction``
counts as UNKNOWN too (logged).  If the final END_TRANSACTION cannot reach the broker,
``send_message_in_transaction`` logs it and returns: the check-back will resolve it.
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, Unpack

import anyio
import anyio.to_thread

from txmq.client.caller import in_caller_thread
from txmq.client.producer import (
    Producer,
    QueueOptions,
    SendOptions,
    SendResult,
    not_yet_safe,
    send_result,
)
from txmq.observability import hooks as observe
from txmq.protocol.codec import decode_record
from txmq.protocol.message import Message, MessageExt, Prop, new_message_id
from txmq.protocol.wire import (
    CheckTransactionState,
    EndTransaction,
    Heartbeat,
    Request,
    UnregisterClient,
)
from txmq.protocol.wire.base import Response
from txmq.protocol.wire.errors import BrokerBusy, BrokerUnavailable, TxmqError
from txmq.transports.port import Calls

__all__ = [
    "LocalTransactionState",
    "TransactionListener",
    "TransactionProducer",
    "TransactionSendResult",
    "to_state",
]

#: how long a half message refused as BrokerBusy (a new master recovering its transactions)
#: waits before it is sent again
BUSY_RETRY_S = 0.1

log = logging.getLogger("txmq.transaction")

#: checks waiting for a free checker slot beyond this are dropped (the broker asks again)
MAX_QUEUED_CHECKS = 2000
_INSTANCES = itertools.count(1)


class LocalTransactionState(enum.StrEnum):
    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    UNKNOWN = "UNKNOWN"


class TransactionListener(Protocol):
    """Runs and checks the local transactions of a :class:`TransactionProducer`."""

    def execute_local_transaction(
        self, msg: Message, arg: Any
    ) -> LocalTransactionState | Awaitable[LocalTransactionState]:
        """Run the local transaction of a half message just stored; say how it ended."""
        ...

    def check_local_transaction(
        self, msg: MessageExt
    ) -> LocalTransactionState | Awaitable[LocalTransactionState]:
        """The state of the local transaction of ``msg`` (its TRANSACTION_ID property).

        ``msg`` is the half message with its real topic and queue; its
        TRANSACTION_CHECK_TIMES property counts the checks so far (this one included).
        Must not answer ROLLBACK while that transaction could still commit.
        """
        ...


@dataclass(frozen=True)
class TransactionSendResult:
    send_result: SendResult
    transaction_id: str
    local_state: LocalTransactionState


def to_state(value: object) -> LocalTransactionState:
    """A listener's answer as a state: a state or its name; anything else is UNKNOWN."""
    if isinstance(value, LocalTransactionState):
        return value
    if isinstance(value, str):
        try:
            return LocalTransactionState(value.upper())
        except ValueError:
            pass
    log.warning("a transaction listener answered %r; treated as UNKNOWN", value)
    return LocalTransactionState.UNKNOWN


class TransactionProducer(Producer):
    """A producer that sends transactional messages and answers the broker's check-backs.

    It heartbeats as a member of producer group ``group`` (at start, on every reconnect and
    every ``heartbeat_interval`` seconds) so that the broker can check back with it; at
    most ``check_concurrency`` checks run at once, never blocking sends.  ``listener`` may
    be set after construction.

    Through name servers it heartbeats the master of every broker set they know (asked
    again at every heartbeat), whether it has sent there or not: a producer restarted
    gets the check-backs of the halves its group left undecided on any broker set.
    """

    heartbeat_every_master = True

    def __init__(
        self,
        address: str | None = None,
        group: str = "DEFAULT_PRODUCER",
        *,
        listener: TransactionListener | None = None,
        check_concurrency: int = 16,
        heartbeat_interval: float = 30.0,
        instance_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if check_concurrency < 1:
            raise ValueError("check_concurrency must be at least 1")
        super().__init__(address, group, **kwargs)
        self.listener = listener
        self.check_concurrency = check_concurrency
        self.heartbeat_interval = heartbeat_interval
        name = instance_name or f"{os.getpid()}#{next(_INSTANCES)}"
        self.client_id = f"{socket.gethostname()}@{name}"
        self._check_limiter = anyio.CapacityLimiter(check_concurrency)
        self._checking: set[int] = set()

    # -- lifecycle and heartbeats -----------------------------------------------------------

    async def _on_start(self) -> None:
        await super()._on_start()  # connects
        await self._heartbeat()
        self._task_group().start_soon(self._heartbeat_loop)

    async def _on_stop(self) -> None:
        with anyio.move_on_after(3):
            await self._unregister(
                UnregisterClient(client_id=self.client_id, producer_groups=[self.group])
            )

    def _heartbeat_request(self) -> Heartbeat:
        return Heartbeat(client_id=self.client_id, producers=[self.group])

    # -- the two phases ---------------------------------------------------------------------

    async def send_half(
        self,
        msg: Message,
        *,
        transaction_id: str,
        check_immunity_s: float | None = None,
        **options: Unpack[SendOptions],
    ) -> SendResult:
        """Store ``msg`` as a half message of local transaction ``transaction_id``.

        Not retried on another broker set: a retry after the broker may have stored it would
        make a second half there (the same broker set answers a resend of the same message
        id with the first half: its dedupe window).
        ``check_immunity_s`` overrides the broker's ``transaction_timeout_s`` (no check-back
        before the half message is that old).

        A delayed message (``delay_level``, ``deliver_at`` or ``delay``) waits from its
        commit: a delay level counts from the commit, a delivery time (``delay`` from this
        send) is kept — or is the commit's moment when that is later.  The result's
        ``transaction_offset`` names the half message for :meth:`end_transaction`.
        """
        if not isinstance(transaction_id, str) or not transaction_id:
            raise ValueError("transaction_id must be a non-empty string")
        props = self._wire_properties(msg, options.get("sharding_key"))
        props[Prop.TRAN_MSG] = "true"
        props[Prop.PRODUCER_GROUP] = self.group
        props[Prop.TRANSACTION_ID] = transaction_id
        if check_immunity_s is not None:
            if not check_immunity_s >= 0:
                raise ValueError("check_immunity_s must not be negative")
            props[Prop.CHECK_IMMUNITY_TIME_IN_SECONDS] = repr(float(check_immunity_s))
        mq, _ = await self._pick(msg, options)
        body = bytes(msg.body)
        with observe.sending(msg.topic, self.group, [props], len(body), "transaction") as obs:
            request = self._send_request(msg.topic, mq.queue_id, props)
            # not retried (a second half), but a broker set that failed is left out of the next
            wait = options.get("timeout") or self.request_timeout
            deadline = time.monotonic() + wait
            repicked = False
            while True:
                try:
                    sent = await self._send_to(mq, request, body, options.get("timeout"))
                    break
                except BrokerBusy:
                    # refused before anything was stored (a new master still recovering its
                    # transactions after a failover): again, for up to the send's time-out
                    if time.monotonic() >= deadline:
                        raise
                    await anyio.sleep(BUSY_RETRY_S)
                except BrokerUnavailable as exc:
                    if exc.sent or repicked:
                        raise
                    # it never left (the master was gone: a failover?): once more, on a
                    # fresh route
                    repicked = True
                    mq, _ = await self._pick(msg, options)
                    request = self._send_request(msg.topic, mq.queue_id, props)
            obs.sent(sent.queue_id, mq.broker_name)
        return send_result(msg.topic, sent, mq.broker_name)

    async def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState | str,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        """Commit or roll back the half message of ``result``; the broker's answer:
        COMMITTED, ROLLED_BACK or ALREADY_RESOLVED (UNKNOWN sends nothing: UNKNOWN).

        ``wait=False`` sends the request without waiting for the answer (``"SENT"``), as
        RocketMQ's producer ends a transaction (``endTransactionOneway``): the local
        transaction is already decided, the broker's answer changes nothing for the caller,
        and should the request be lost the broker's check-back reads the decision from the
        local transaction — the caller does not wait for the broker to store (under
        SYNC_FLUSH: to fsync) the committed message."""
        if result.transaction_offset < 0:
            raise ValueError("end_transaction needs the result of send_half")
        to = self.remote(result.broker_name or None)
        if not wait:
            request = self._end_request(result.transaction_offset, result.msg_id, state, from_check)
            if request is None:
                return "UNKNOWN"
            await to.send_oneway(request)
            return "SENT"
        return await self._end(result.transaction_offset, result.msg_id, state, from_check, to)

    async def _end(
        self,
        offset: int,
        msg_id: str,
        state: LocalTransactionState | str,
        from_check: bool,
        to: Calls,
    ) -> str:
        """End a half message on the broker that stored it (``to``: its connection, or the
        connection its check-back came on)."""
        request = self._end_request(offset, msg_id, state, from_check)
        if request is None:
            return "UNKNOWN"
        return (await to.call(request, timeout=self.request_timeout)).header.result

    def _end_request(
        self, offset: int, msg_id: str, state: LocalTransactionState | str, from_check: bool
    ) -> EndTransaction | None:
        """The request that ends a half message (None: UNKNOWN, which sends nothing)."""
        state = LocalTransactionState(state)
        if state is LocalTransactionState.UNKNOWN:
            return None
        return EndTransaction(
            group=self.group,
            transaction_offset=offset,
            msg_id=msg_id,
            state="COMMIT" if state is LocalTransactionState.COMMIT else "ROLLBACK",
            from_check=from_check,
        )

    async def send_message_in_transaction(
        self,
        msg: Message,
        arg: Any = None,
        *,
        transaction_id: str | None = None,
        **options: Unpack[QueueOptions],
    ) -> TransactionSendResult:
        """Half message, then the listener's local transaction, then commit or roll back.

        ``arg`` goes to the listener; ``transaction_id`` defaults to a new unique id;
        ``options`` choose the queue as for :meth:`send` (a selector gets no ``arg``).
        """
        listener = self.listener
        if listener is None:
            raise ValueError("set a TransactionListener before sending in a transaction")
        tx_id = transaction_id or new_message_id()
        result = await self.send_half(msg, transaction_id=tx_id, **options)
        unsafe = not_yet_safe(result)
        if unsafe is not None:
            # RocketMQ's rule: a half message not yet on a slave is not safe to build on —
            # the local transaction does not run, and the half is rolled back
            log.warning("%s; the local transaction %s does not run", unsafe, tx_id)
            await self._end_after_local(result, tx_id, LocalTransactionState.ROLLBACK)
            return TransactionSendResult(result, tx_id, LocalTransactionState.ROLLBACK)
        try:
            state = await self._run(listener.execute_local_transaction, msg, arg)
        except Exception as exc:
            await self._end_after_local(result, tx_id, LocalTransactionState.UNKNOWN, exc)
            raise
        await self._end_after_local(result, tx_id, state)
        return TransactionSendResult(result, tx_id, state)

    async def _end_after_local(
        self,
        result: SendResult,
        tx_id: str,
        state: LocalTransactionState,
        error: BaseException | None = None,
    ) -> None:
        """End after the local transaction ran (or raised); failures are logged only."""
        if error is not None:
            log.warning(
                "local transaction %s (message %s) raised %r; the broker will check back",
                tx_id,
                result.msg_id,
                error,
            )
        try:
            await self.end_transaction(result, state, wait=False)
        except TxmqError as exc:
            log.warning(
                "local transaction %s is %s but ending message %s failed (%s); the broker "
                "will check back",
                tx_id,
                state.value,
                result.msg_id,
                exc,
            )

    async def _run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        limiter: anyio.CapacityLimiter | None = None,
    ) -> LocalTransactionState:
        """A listener method's answer as a state.  A coroutine function runs on the loop; a
        plain one runs in the thread of the blocking facade call that waits for it (a
        local transaction), else in a worker thread (check-backs: at most ``limiter``)."""
        if inspect.iscoroutinefunction(fn):
            if limiter is None:
                result = await fn(*args)
            else:
                async with limiter:
                    result = await fn(*args)
        elif limiter is None:
            result = await in_caller_thread(fn, *args)
        else:
            result = await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)
        if inspect.isawaitable(result):
            result = await result
        return to_state(result)

    # -- check-backs ------------------------------------------------------------------------

    def serve(self, request: Request[Any], body: bytes, origin: Calls) -> Response | None:
        """A check-back (whatever the transport: the half message's record as the body),
        answered by ending the transaction through ``origin``."""
        if isinstance(request, CheckTransactionState):
            self._check_later(request, body, origin)
            return None
        return super().serve(request, body, origin)

    def _check_later(self, check: CheckTransactionState, body: bytes, to: Calls) -> None:
        offset = check.transaction_offset
        if offset in self._checking:
            return  # the previous check of it is still running
        if len(self._checking) >= MAX_QUEUED_CHECKS:
            log.warning("too many transaction checks running; check of %d dropped", offset)
            return
        tg = self._tg
        if tg is None:
            return
        self._checking.add(offset)
        tg.start_soon(self._check_back, check, body, to)

    async def _check_back(self, check: CheckTransactionState, body: bytes, conn: Calls) -> None:
        offset, msg_id = check.transaction_offset, check.msg_id
        try:
            try:
                msg = decode_record(body, verify=True)
                props = msg.all_properties
                msg.topic = props.get(Prop.REAL_TOPIC, msg.topic)
                msg.queue_id = int(props.get(Prop.REAL_QID, msg.queue_id))
                if check.check_times:
                    props[Prop.TRANSACTION_CHECK_TIMES] = str(check.check_times)
                listener = self.listener
                if listener is None:
                    log.warning("the broker checks transaction %s but no listener is set", msg_id)
                    return
                state = await self._run(
                    listener.check_local_transaction, msg, limiter=self._check_limiter
                )
            except Exception:
                log.exception("checking the transaction of message %s failed (UNKNOWN)", msg_id)
                observe.checkback(self.group, "ERROR")
                return
            observe.checkback(self.group, state.value)
            if state is LocalTransactionState.UNKNOWN:
                return
            try:
                result = await self._end(offset, msg_id, state, True, conn)
            except TxmqError as exc:
                log.warning("ending message %s after a check failed: %s", msg_id, exc)
                return
            except Exception:  # the broker checks again; the producer goes on
                log.exception("ending message %s after a check failed unexpectedly", msg_id)
                return
            log.info("checked transaction of message %s: %s (%s)", msg_id, state.value, result)
        finally:
            self._checking.discard(offset)
