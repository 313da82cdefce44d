"""Group commit of a coordinator's answers (async mode).  Answers that arrive while the
coordinator's database is busy with others are decided together in one local transaction —
one ``SELECT … FOR UPDATE`` of their sagas, each saga's update and the step log, one
``COMMIT`` — then each decision's messages leave and each answer is acknowledged.  Under
load that is one local transaction for several answers instead of one each; alone, an
answer is decided as before, at once.

Each answer's decision is the one it would have had alone: its saga's row is read, locked,
in the group's transaction and its update is conditioned on that row.  Should anything fail
in the group's transaction (a row changed under it, a database error, an ``on_end`` that
raises), the group is rolled back and each of its answers is decided again on its own, where
it succeeds or fails alone.  At most one answer per saga is in a group.

One answer at a time leads: it decides the waiting answers, its own among them; once its
own is decided it hands the lead to the first answer still waiting, so that no consume
worker stays busy with other answers for long (its message's offset held back meanwhile).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from txmq.consumer.model import ConsumeResult
from txmq.protocol.message import Message
from txmq.protocol.wire.errors import TxmqError
from txmq.saga import decide
from txmq.saga.decide import Decision
from txmq.saga.writes import (
    INSERT_STEPS,
    LAST,
    SELECT_MANY,
    changed,
    committed,
    ended,
    not_recalled,
    outgoing,
    raise_if_not_safe,
    taken,
    waits,
    writes,
)

__all__ = ["MAX_GROUP", "GroupCommit"]

log = logging.getLogger("txmq.saga")

#: at most this many answers in one local transaction
MAX_GROUP = 32

#: an answer decided on its own: (saga id, choose, answered) -> its consume result
Alone = Callable[[str, Any, tuple[str, str]], Awaitable[ConsumeResult]]


@dataclass(eq=False)
class _Waiting:
    """An answer waiting for its decision."""

    saga_id: str
    choose: Any
    answered: tuple[str, str]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: ConsumeResult | None = None
    error: BaseException | None = None
    #: it leads now (decides the waiting answers)
    lead: bool = False

    @property
    def settled(self) -> bool:
        return self.result is not None or self.error is not None

    def settle(self, result: ConsumeResult | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass
class _Planned:
    """What a group's transaction decided for one answer."""

    waiting: _Waiting
    row: Any
    #: the decision it commits (None: the answer changes nothing)
    decision: Decision | None = None
    #: the awaited command sent again (the answer's decision was taken before)
    again: Decision | None = None


class GroupCommit:
    """The answers of one coordinator, decided in groups (see the module).  ``saga_of``:
    a row's definition; ``alone``: an answer decided on its own, the way every answer is
    when its group fails."""

    def __init__(
        self,
        *,
        sessions: Any,
        producer: Any,
        service: str,
        topic: str,
        saga_of: Callable[[Any], Any],
        on_end: Callable[..., Any] | None,
        alone: Alone,
        max_group: int = MAX_GROUP,
    ) -> None:
        self.sessions = sessions
        self.producer = producer
        self.service = service
        self.topic = topic
        self.saga_of = saga_of
        self.on_end = on_end
        self.alone = alone
        self.max_group = max_group
        self._queue: list[_Waiting] = []
        self._leading = False
        #: the group being decided (settled with an error should its leader be cancelled)
        self._current: list[_Waiting] = []
        #: groups decided together, and the answers in them (for tests and metrics)
        self.groups = 0
        self.grouped = 0

    async def decide(self, saga_id: str, choose: Any, answered: tuple[str, str]) -> ConsumeResult:
        """Decide an answer to saga ``saga_id`` (``choose(saga, row)``: its decision), in a
        group with the answers waiting meanwhile."""
        me = _Waiting(saga_id, choose, answered)
        self._queue.append(me)
        if self._leading:
            try:
                await me.done.wait()
            except BaseException:
                if me in self._queue:
                    self._queue.remove(me)
                if me.lead and not me.settled:
                    self._hand_over()
                raise
        else:
            self._leading = me.lead = True
        if me.lead and not me.settled:
            try:
                while not me.settled:
                    self._current = self._take()
                    await self._decide_group(self._current)
            finally:
                for w in self._current:  # cancelled in the middle of a group
                    if not w.settled:
                        w.settle(None, RuntimeError("the coordinator stopped meanwhile"))
                self._current = []
                self._hand_over()
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _take(self) -> list[_Waiting]:
        """The next group: the waiting answers in their order, one per saga, at most
        ``max_group``; the others wait for a later group."""
        group: list[_Waiting] = []
        rest: list[_Waiting] = []
        ids: set[str] = set()
        for w in self._queue:
            if len(group) < self.max_group and w.saga_id not in ids:
                group.append(w)
                ids.add(w.saga_id)
            else:
                rest.append(w)
        self._queue = rest
        return group

    def _hand_over(self) -> None:
        if self._queue:
            nxt = self._queue[0]
            nxt.lead = True
            nxt.done.set()
        else:
            self._leading = False

    async def _decide_group(self, group: list[_Waiting]) -> None:
        if len(group) > 1:
            try:
                planned = await self._together(group)
            except Exception as exc:
                log.info("%d answers failed together (%s): each is decided alone", len(group), exc)
            else:
                self.groups += 1
                self.grouped += len(group)
                await self._after_commit(planned)
                return
        for w in group:
            try:
                w.settle(await self.alone(w.saga_id, w.choose, w.answered))
            except Exception as exc:
                w.settle(None, exc)

    async def _together(self, group: list[_Waiting]) -> list[_Planned]:
        """One transaction for the group: read and lock their sagas, decide, write, commit."""
        async with self.sessions() as session:
            ids = [w.saga_id for w in group]
            rows = {r.saga_id: r for r in (await session.execute(SELECT_MANY, {"saga_ids": ids}))}
            planned = []
            for w in group:
                row = rows.get(w.saga_id)
                plan = _Planned(w, row, w.choose(self.saga_of(row), row))
                if plan.decision is None and waits(row):
                    last = (await session.execute(LAST, {"saga_id": w.saga_id})).first()
                    if taken(last, w.answered):
                        plan.again = decide.again(self.saga_of(row), row, self.service)
                planned.append(plan)
            log_rows: list[dict[str, Any]] = []
            for plan in planned:
                decision = plan.decision
                if decision is None:
                    continue
                for stmt, params, conditioned in writes(plan.row, decision, steps=False):
                    changed(await session.execute(stmt, params), conditioned, plan.row)
                log_rows += decision.log
                done = ended(plan.row, decision) if self.on_end is not None else None
                if done is not None:
                    assert self.on_end is not None
                    result = self.on_end(done, session)
                    if inspect.isawaitable(result):
                        await result
            if log_rows:
                await session.execute(INSERT_STEPS, log_rows)
            await session.commit()
        return planned

    async def _after_commit(self, planned: list[_Planned]) -> None:
        """Each committed decision's metrics, then its messages (a send that fails fails
        that answer alone: delivered again, it finds its decision taken and sends the
        command again), then its deadline's recall."""
        for plan in planned:
            if plan.decision is not None:
                committed(plan.row.name, plan.decision, plan.row.state)
        async with anyio.create_task_group() as tg:  # the sends of different sagas at once
            for plan in planned:
                tg.start_soon(self._send, plan)

    async def _send(self, plan: _Planned) -> None:
        decision = plan.decision or plan.again
        if decision is not None:
            try:
                msgs: list[Message] = outgoing(decision, self.service)
                for msg in msgs:
                    raise_if_not_safe(await self.producer.send(msg, sharding_key=plan.row.saga_id))
            except Exception as exc:
                plan.waiting.settle(None, exc)
                return
            if decision.recall is not None:
                try:
                    await self.producer.recall(self.topic, decision.recall)
                except TxmqError as exc:
                    not_recalled(decision.recall, exc)
        plan.waiting.settle(ConsumeResult.SUCCESS)
