"""The coordinator's decisions, apart from its I/O: given a saga's row and an answer (or an
operator's action), what the row becomes, what the step log records and which command goes
out — all committed together in one local transaction by :mod:`txmq.saga.coordinator`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from txmq.protocol.message import new_message_id
from txmq.saga.model import (
    ACTION,
    COMPENSATION,
    CONFIRM,
    Command,
    Op,
    Reply,
    Saga,
    State,
    reply_topic,
)

__all__ = ["Decision", "again", "first", "on_reply", "operator_resolve", "operator_retry"]


@dataclass
class Decision:
    """What one transaction of the coordinator writes and sends."""

    #: the saga row's new values (txmq_sagas)
    values: dict[str, Any]
    #: rows for txmq_saga_steps
    log: list[dict[str, Any]] = field(default_factory=list)
    #: the command to send (None: the saga ended, or waits for an operator)
    command: Command | None = None
    #: the answer it took: (branch, operation, outcome, seconds since its command was sent)
    took: tuple[str, str, str, float] | None = None
    #: the command's deadline: the answer the coordinator sends itself, delayed that long
    #: (seconds), and its message's id
    deadline: tuple[Reply, float, str] | None = None
    #: the delayed deadline message to recall once this commits (its answer came first)
    recall: str | None = None


def _command(
    saga: Saga, saga_id: str, index: int, op: Op, data: dict[str, Any], coordinator: str
) -> Command:
    step = saga.steps[index]
    retries = step.retries if op == ACTION else step.compensation_retries
    handler = {ACTION: step.action, COMPENSATION: step.compensation, CONFIRM: step.confirm}[op]
    assert handler is not None
    return Command(
        saga_id=saga_id,
        saga=saga.name,
        step=index,
        service=step.service,
        branch=step.action,
        op=op,
        handler=handler,
        command_id=uuid.uuid4().hex,
        sent_ms=int(time.time() * 1000),
        data=data,
        reply_to=reply_topic(coordinator),
        retries=retries,
    )


def _sent(cmd: Command) -> dict[str, Any]:
    return {
        "saga_id": cmd.saga_id,
        "step": cmd.step,
        "branch": cmd.branch,
        "op": cmd.op,
        "event": "sent",
        "command_id": cmd.command_id,
        "attempts": None,
        "detail": None,
        "at": datetime.now(UTC),
    }


def _expired(cmd: Command, timeout: float) -> Reply:
    """The answer a command's deadline gives: no answer within ``timeout`` seconds."""
    return Reply(
        saga_id=cmd.saga_id,
        command_id=cmd.command_id,
        step=cmd.step,
        op=cmd.op,
        outcome="timeout",
        detail=f"no answer within {timeout:g} s",
        sent_ms=cmd.sent_ms,
    )


def _go(decision: Decision, cmd: Command, state: str, timeout: float | None = None) -> Decision:
    decision.values.update(state=state, step=cmd.step, op=cmd.op, command_id=cmd.command_id)
    decision.values.update(deadline_at=None, deadline_id=None)
    decision.command = cmd
    decision.log.append(_sent(cmd))
    if timeout is not None and cmd.op == ACTION:
        # its message's id, chosen now: recorded with the decision, kept if it is sent again
        msg_id = new_message_id()
        decision.deadline = (_expired(cmd, timeout), timeout, msg_id)
        decision.values["deadline_at"] = datetime.fromtimestamp(cmd.sent_ms / 1000 + timeout, UTC)
        decision.values["deadline_id"] = msg_id
    return decision


def _act(saga: Saga, saga_id: str, index: int, data: dict[str, Any], coordinator: str) -> Command:
    return _command(saga, saga_id, index, ACTION, data, coordinator)


def first(saga: Saga, saga_id: str, data: dict[str, Any], coordinator: str) -> Decision:
    """A new saga: its row, and the command of its first action."""
    cmd = _act(saga, saga_id, 0, data, coordinator)
    values: dict[str, Any] = {
        "saga_id": saga_id,
        "name": saga.name,
        "definition": saga.to_dict(),
        "coordinator": coordinator,
        "data": data,
        "effected": [],
        "error": None,
    }
    return _go(Decision(values), cmd, State.RUNNING, saga.steps[0].timeout)


def _compensate_next(
    saga: Saga,
    row: Any,
    data: dict[str, Any],
    effected: list[int],
    decision: Decision,
    coordinator: str,
) -> Decision:
    """Compensate the last step that took effect and has a compensation; COMPENSATED when
    none is left (steps without a compensation have nothing to undo)."""
    undoable = [i for i in effected if saga.steps[i].compensation is not None]
    decision.values.update(data=data, effected=undoable)
    if not undoable:
        decision.values.update(state=State.COMPENSATED, command_id=None)
        return decision
    cmd = _command(saga, row.saga_id, undoable[-1], COMPENSATION, data, coordinator)
    return _go(decision, cmd, State.COMPENSATING)


def _confirm_next(
    saga: Saga, row: Any, after: int, decision: Decision, coordinator: str
) -> Decision:
    """TCC: confirm the next branch after ``after`` that has a confirm; COMPLETED when none
    is left."""
    later = [i for i, s in enumerate(saga.steps) if i > after and s.confirm is not None]
    if not later:
        decision.values.update(state=State.COMPLETED, command_id=None)
        return decision
    data = decision.values.get("data", row.data)
    cmd = _command(saga, row.saga_id, later[0], CONFIRM, dict(data), coordinator)
    return _go(decision, cmd, State.CONFIRMING)


def on_reply(saga: Saga, row: Any, reply: Reply, coordinator: str) -> Decision | None:
    """The answer ``reply`` to the saga ``row`` waits on; None when it is not that answer (a
    repeat, or an answer to a command it no longer waits for)."""
    if row is None or row.command_id != reply.command_id or row.state in State.ENDED:
        return None
    step = saga.steps[row.step]
    decision = Decision(
        {},
        [
            {
                "saga_id": row.saga_id,
                "step": row.step,
                "branch": step.action,
                "op": reply.op,
                "event": reply.outcome,
                "command_id": reply.command_id,
                "attempts": reply.attempts,
                "detail": reply.detail or None,
                "at": datetime.now(UTC),
            }
        ],
    )
    if reply.sent_ms:
        elapsed = max(time.time() - reply.sent_ms / 1000, 0.0)
        decision.took = (step.action, reply.op, reply.outcome, elapsed)
    if row.deadline_id and reply.outcome != "timeout":
        decision.recall = row.deadline_id
    decision.values.update(deadline_at=None, deadline_id=None)  # answered, or its time came
    data = dict(row.data)
    effected = list(row.effected)
    if reply.op == ACTION:
        if reply.outcome == "done":
            data.update(reply.result or {})
            effected.append(row.step)
            decision.values.update(data=data, effected=effected)
            if row.step + 1 < len(saga.steps):
                cmd = _act(saga, row.saga_id, row.step + 1, data, coordinator)
                return _go(decision, cmd, State.RUNNING, saga.steps[row.step + 1].timeout)
            return _confirm_next(saga, row, -1, decision, coordinator)
        decision.values["error"] = f"{step.action} {reply.outcome}: {reply.detail}"
        if reply.outcome == "timeout":  # it may still take effect: undo it too
            effected.append(row.step)
        return _compensate_next(saga, row, data, effected, decision, coordinator)
    if reply.op == CONFIRM:
        if reply.outcome == "done":
            return _confirm_next(saga, row, row.step, decision, coordinator)
        decision.values.update(state=State.PARKED, error=f"{step.confirm} failed: {reply.detail}")
        return decision
    if reply.outcome == "done":
        effected = [i for i in effected if i != row.step]
        return _compensate_next(saga, row, data, effected, decision, coordinator)
    # a compensation out of retries: an operator retries it, or undoes it by hand (resolve)
    decision.values.update(state=State.PARKED, error=f"{step.compensation} failed: {reply.detail}")
    return decision


def again(saga: Saga, row: Any, coordinator: str) -> Decision:
    """The command the saga ``row`` waits on, to be sent again as its decision sent it (the
    same command id; its deadline with the same message id, due when it was due): that
    decision committed, but the coordinator may have died before its messages left.  It
    writes nothing."""
    cmd = _command(saga, row.saga_id, row.step, row.op, dict(row.data), coordinator)
    cmd = msgspec.structs.replace(cmd, command_id=row.command_id)
    decision = Decision({}, command=cmd)
    step = saga.steps[row.step]
    if row.deadline_id and row.deadline_at is not None and step.timeout is not None:
        due = row.deadline_at if row.deadline_at.tzinfo else row.deadline_at.replace(tzinfo=UTC)
        left = max((due - datetime.now(UTC)).total_seconds(), 0.0)
        decision.deadline = (_expired(cmd, step.timeout), left, row.deadline_id)
    return decision


def _operator(row: Any, saga: Saga, event: str, operator: str, reason: str) -> Decision:
    if row.state != State.PARKED:
        raise ValueError(f"saga {row.saga_id} is {row.state}, not PARKED: nothing to {event}")
    if not operator or not reason:
        raise ValueError("an operator's action needs the operator's name and a reason")
    entry = {
        "saga_id": row.saga_id,
        "step": row.step,
        "branch": saga.steps[row.step].action,
        "op": "operator",
        "event": event,
        "command_id": None,
        "attempts": None,
        "detail": f"{operator}: {reason}",
        "at": datetime.now(UTC),
    }
    return Decision({"error": None}, [entry])


def operator_retry(saga: Saga, row: Any, operator: str, reason: str, coordinator: str) -> Decision:
    """An operator sends a parked saga's failing compensation (or confirm) again."""
    decision = _operator(row, saga, "retried", operator, reason)
    cmd = _command(saga, row.saga_id, row.step, row.op, dict(row.data), coordinator)
    return _go(decision, cmd, State.CONFIRMING if row.op == CONFIRM else State.COMPENSATING)


def operator_resolve(
    saga: Saga, row: Any, operator: str, reason: str, coordinator: str
) -> Decision:
    """An operator did a parked saga's failing compensation (or confirm) by hand: the saga
    goes on with the steps before it (after it)."""
    decision = _operator(row, saga, "resolved", operator, reason)
    if row.op == CONFIRM:
        return _confirm_next(saga, row, row.step, decision, coordinator)
    effected = [i for i in row.effected if i != row.step]
    return _compensate_next(saga, row, dict(row.data), effected, decision, coordinator)
