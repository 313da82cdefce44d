"""A service that takes part in sagas: its steps' actions and compensations, each run behind
the barrier in the service's own local transaction; its reply to the coordinator leaves once
that transaction committed, and the command is acknowledged once the reply is stored.  A
command delivered again (the service died before its reply left) finds its barrier row and
is answered again as it was the first time, from what the row kept.

::

    inventory = Participant("inventory", producer, async_sessionmaker(engine))

    @inventory.action("reserve-stock")
    async def reserve(data: dict, session: AsyncSession) -> dict:
        ...                               # raise Refuse("out of stock") to say no
        return {"reservation": rid}       # merged into the saga's data

    @inventory.compensation("release-stock")
    async def release(data: dict, session: AsyncSession) -> None: ...

    consumer = txmq.PushConsumer(**inventory.consumer_options())
    consumer.subscribe(inventory.topic)

An action that raises (anything but :class:`Refuse`) is rolled back and retried on the delay
levels, its step's ``retries`` times; then it answers ``failed`` (recorded in the barrier:
it had no effect) and the saga compensates.  A compensation that raises is retried its
step's ``compensation_retries`` times, then answers ``failed`` and the saga is parked.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from txmq.client.producer import SendResult, not_yet_safe
from txmq.consumer.push import ConsumeResult
from txmq.protocol.message import Message, MessageExt
from txmq.saga import barrier
from txmq.saga.model import (
    ACTION,
    COMMAND_TOPIC,
    COMPENSATION,
    CONFIRM,
    Command,
    Outcome,
    Refuse,
    Reply,
    check_name,
    decode_command,
    encode,
)
from txmq.saga.service import SagaService

__all__ = ["NoHandler", "Participant"]

log = logging.getLogger("txmq.saga")

Handler = Callable[[dict[str, Any], Any], Any]


class NoHandler(LookupError):
    """A command names an action or compensation this service does not have (answered
    ``failed`` at once: a retry would not find it either)."""


class Participant(SagaService):
    """The steps a service runs for sagas (``producer`` and ``sessions``: see
    :class:`~txmq.saga.service.SagaService`)."""

    group_format = "saga-{}"
    topic_format = COMMAND_TOPIC

    def __init__(self, service: str, producer: Any, sessions: Any) -> None:
        super().__init__(service, producer, sessions)
        self.handlers: dict[tuple[str, str], Handler] = {}

    # -- registering handlers ----------------------------------------------------------------

    def action(self, name: str) -> Callable[[Handler], Handler]:
        """Register a step's action: ``handler(data, session)`` returns None or a dict (the
        saga's data is updated with it), or raises :class:`Refuse`."""
        return self._register(ACTION, name)

    def compensation(self, name: str) -> Callable[[Handler], Handler]:
        """Register a compensation: ``handler(data, session)`` undoes its action's effect."""
        return self._register(COMPENSATION, name)

    def confirm(self, name: str) -> Callable[[Handler], Handler]:
        """Register a TCC confirm: ``handler(data, session)`` makes its try final."""
        return self._register(CONFIRM, name)

    #: TCC's names: a try is an action, a cancel a compensation
    try_ = action
    cancel = compensation

    def _register(self, op: str, name: str) -> Callable[[Handler], Handler]:
        check_name(f"an {op}", name)

        def decorate(handler: Handler) -> Handler:
            if inspect.iscoroutinefunction(handler) != self.is_async:
                raise TypeError(
                    f"{handler.__qualname__} is {'a sync' if self.is_async else 'an async'} "
                    f"handler, but participant {self.service!r} runs "
                    f"{'async' if self.is_async else 'sync'} handlers (its sessions)"
                )
            if (op, name) in self.handlers:
                raise ValueError(f"{op} {name!r} is registered twice in {self.service!r}")
            self.handlers[op, name] = handler
            return handler

        return decorate

    # -- running commands --------------------------------------------------------------------

    def listener(self, msg: MessageExt) -> Any:
        """The push consumer's listener (a coroutine function's result when async)."""
        try:
            cmd = decode_command(msg.body)
        except Exception as exc:
            log.error("saga command %s is malformed (%s): dead-lettered", msg.msg_id, exc)
            return ConsumeResult.DEAD_LETTER
        return self._run_async(cmd, msg) if self.is_async else self._run(cmd, msg)

    def _handler(self, cmd: Command) -> Handler:
        handler = self.handlers.get((cmd.op, cmd.handler))
        if handler is None:
            raise NoHandler(f"service {self.service!r} has no {cmd.op} {cmd.handler!r}")
        return handler

    # An operation commits its barrier row and its effect in one local transaction; its
    # reply leaves after the commit, and the command is acknowledged after that.  Should
    # the service die in between, the command comes again, the barrier finds its row, and
    # the reply is sent again from what the row kept (the coordinator takes the first copy
    # of an answer and ignores the rest).

    async def _run_async(self, cmd: Command, msg: MessageExt) -> ConsumeResult:
        attempts = msg.reconsume_times + 1
        try:
            async with self.sessions() as session, session.begin():
                conn = await session.connection()
                entry = await barrier.enter_async(conn, cmd.saga_id, cmd.branch, cmd.op)
                if entry is barrier.Entry.RUN:
                    result = _result(await self._handler(cmd)(dict(cmd.data), session))
                    if result:
                        await barrier.keep_async(conn, cmd.saga_id, cmd.branch, result)
                    answer: Answer = (*_answer(entry), result)
                elif entry is barrier.Entry.DUPLICATE:
                    answer = _again(cmd, await _kept_async(conn, cmd))
                else:
                    answer = (*_answer(entry), None)
        except Exception as exc:
            no_effect = _no_effect(cmd, exc, attempts)
            if no_effect is None:
                raise
            answer = (*no_effect, None)
            if cmd.op == ACTION:
                async with self.sessions() as session, session.begin():
                    conn = await session.connection()
                    if not await barrier.record_async(conn, cmd.saga_id, cmd.branch, *no_effect):
                        answer = _again(cmd, await _kept_async(conn, cmd))
        sent = await self.producer.send(_reply(cmd, *answer, attempts), sharding_key=cmd.saga_id)
        _raise_if_not_safe(sent)
        return ConsumeResult.SUCCESS

    def _run(self, cmd: Command, msg: MessageExt) -> ConsumeResult:
        attempts = msg.reconsume_times + 1  # (as _run_async)
        try:
            with self.sessions() as session, session.begin():
                conn = session.connection()
                entry = barrier.enter(conn, cmd.saga_id, cmd.branch, cmd.op)
                if entry is barrier.Entry.RUN:
                    result = _result(self._handler(cmd)(dict(cmd.data), session))
                    if result:
                        barrier.keep(conn, cmd.saga_id, cmd.branch, result)
                    answer: Answer = (*_answer(entry), result)
                elif entry is barrier.Entry.DUPLICATE:
                    answer = _again(cmd, barrier.kept(conn, cmd.saga_id, cmd.branch))
                else:
                    answer = (*_answer(entry), None)
        except Exception as exc:
            no_effect = _no_effect(cmd, exc, attempts)
            if no_effect is None:
                raise
            answer = (*no_effect, None)
            if cmd.op == ACTION:
                with self.sessions() as session, session.begin():
                    conn = session.connection()
                    if not barrier.record(conn, cmd.saga_id, cmd.branch, *no_effect):
                        answer = _again(cmd, barrier.kept(conn, cmd.saga_id, cmd.branch))
        sent = self.producer.send(_reply(cmd, *answer, attempts), sharding_key=cmd.saga_id)
        _raise_if_not_safe(sent)
        return ConsumeResult.SUCCESS


#: a reply's outcome, detail and result
Answer = tuple[Outcome, str, dict[str, Any] | None]


async def _kept_async(conn: Any, cmd: Command) -> tuple[str, dict[str, Any]] | None:
    return await barrier.kept_async(conn, cmd.saga_id, cmd.branch)


def _again(cmd: Command, kept: tuple[str, dict[str, Any]] | None) -> Answer:
    """The answer to a repeat of an operation that ran before: as it was answered then, from
    what its action's barrier row kept."""
    log.info("%s %s of saga %s: a repeat, answered again", cmd.op, cmd.branch, cmd.saga_id)
    if cmd.op != ACTION:
        return "done", "", None  # a compensation or confirm that ran is done
    reason, answer = kept if kept is not None else (ACTION, {})
    if reason == COMPENSATION:
        return (*_answer(barrier.Entry.SUSPENDED), None)
    if reason in barrier.NO_EFFECT:
        return reason, str(answer.get("detail") or ""), None  # type: ignore[return-value]
    return "done", "", answer.get("result")


def _raise_if_not_safe(sent: SendResult) -> None:
    """A reply stored on a master but on no slave yet is not safe: the command is delivered
    again (and its reply sent again) rather than acknowledged on it."""
    unsafe = not_yet_safe(sent)
    if unsafe is not None:
        raise unsafe


def _result(value: Any) -> dict[str, Any] | None:
    if isinstance(value, Refuse):
        raise value
    if value is None or isinstance(value, dict):
        return value
    raise TypeError(
        f"a saga step returns None or a dict (merged into the saga's data), not {value!r}"
    )


def _answer(entry: barrier.Entry) -> tuple[Outcome, str]:
    """The outcome and detail of an operation the barrier let through (or suspended)."""
    if entry is barrier.Entry.NULL:
        return "done", "null compensation: its action never took effect"
    if entry is barrier.Entry.SUSPENDED:
        # its compensation came first: the saga is compensating (this answer is stale and
        # ignored) — or, should it still wait for this action, it must not count on it
        return "refused", "suspended: its compensation came first"
    return "done", ""


def _no_effect(cmd: Command, exc: Exception, attempts: int) -> tuple[Outcome, str] | None:
    """The answer of an operation that had no effect: refused (an action's business "no"),
    or failed once out of retries; None: retry it (the exception goes to the consumer)."""
    if isinstance(exc, Refuse) and cmd.op == ACTION:
        return "refused", exc.reason
    if attempts <= cmd.retries and not isinstance(exc, NoHandler):
        log.warning(
            "%s %s of saga %s failed (attempt %d of %d): %s",
            cmd.op, cmd.branch, cmd.saga_id, attempts, cmd.retries + 1, exc,
        )  # fmt: skip
        return None
    log.error(
        "%s %s of saga %s failed after %d attempt(s): %s",
        cmd.op, cmd.branch, cmd.saga_id, attempts, exc,
    )  # fmt: skip
    return "failed", f"{type(exc).__name__}: {exc}"


def _reply(
    cmd: Command, outcome: Outcome, detail: str, result: dict[str, Any] | None, attempts: int
) -> Message:
    reply = Reply(
        saga_id=cmd.saga_id,
        command_id=cmd.command_id,
        step=cmd.step,
        op=cmd.op,
        outcome=outcome,
        result=result,
        detail=detail,
        attempts=attempts,
        sent_ms=cmd.sent_ms,
    )
    key = f"{cmd.saga_id}/{cmd.step}/{cmd.op}"
    return Message(cmd.reply_to, encode(reply), tags=outcome, keys=[key])
