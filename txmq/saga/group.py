"""Group commit of a coordinator's answers.  Answers that arrive while the coordinator's
database is busy with others are decided together in one local transaction — one
``SELECT … FOR UPDATE`` of their sagas, each saga's update and the step log, one ``COMMIT``
— then each decision's messages leave and each answer is acknowledged.  Under load that is
one local transaction for several answers instead of one each; alone, an answer is decided
as before, at once.  The same in async mode (answers on the consumer's event loop) and in
sync mode (on its worker threads).

Each answer's decision is the one it would have had alone: its saga's row is read, locked,
in the group's transaction and its update is conditioned on that row.  Should anything fail
in the group's transaction (a row changed under it, a database error, an ``on_end`` that
raises), the group is rolled back and each of its answers is decided again on its own, where
it succeeds or fails alone.  At most one answer per saga is in a group.  ``on_end`` runs in
the group's transaction: what it does delays the group's other answers.

One answer at a time leads: it decides the waiting answers, its own among them; once its
own is decided it hands the lead to the first answer still waiting, so that no consume
worker stays busy with other answers for long (its message's offset held back meanwhile).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
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
    Ended,
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

#: an answer decided on its own: (saga id, choose, answered) -> its consume result (or, in
#: async mode, an awaitable of it)
Alone = Callable[[str, Any, tuple[str, str]], Any]

#: a group's transaction as a series of steps, the same in both modes: each yielded
#: (statement, parameters) is executed by the driver, which sends its result back; a yielded
#: :class:`Ended` is handed to ``on_end`` with the session; the return value is the plan
Plan = Generator[Any, Any, "list[_Planned]"]


@dataclass(eq=False)
class _Waiting:
    """An answer waiting for its decision."""

    saga_id: str
    choose: Any
    answered: tuple[str, str]
    #: set once it is settled, or leads (anyio's in async mode, threading's else)
    done: Any = None
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
    """The answers of one coordinator, decided in groups (see the module): :meth:`decide`
    in async mode (``sessions`` an ``async_sessionmaker``), :meth:`decide_sync` else (the
    consumer's worker threads).  ``saga_of``: a row's definition; ``alone``: an answer
    decided on its own, the way every answer is when its group fails."""

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
        self._lock = threading.Lock()  # the queue and the lead (worker threads, sync mode)
        self._queue: list[_Waiting] = []
        self._leading = False
        #: groups decided together, and the answers in them (for tests and metrics)
        self.groups = 0
        self.grouped = 0

    # -- the queue and the lead (both modes) -------------------------------------------------

    def _join(self, me: _Waiting) -> bool:
        """Queue ``me``; whether it leads (no answer does)."""
        with self._lock:
            self._queue.append(me)
            if self._leading:
                return False
            self._leading = me.lead = True
            return True

    def _take(self) -> list[_Waiting]:
        """The next group: the waiting answers in their order, one per saga, at most
        ``max_group``; the others wait for a later group."""
        group: list[_Waiting] = []
        rest: list[_Waiting] = []
        ids: set[str] = set()
        with self._lock:
            for w in self._queue:
                if len(group) < self.max_group and w.saga_id not in ids:
                    group.append(w)
                    ids.add(w.saga_id)
                else:
                    rest.append(w)
            self._queue = rest
        return group

    def _hand_over(self, me: _Waiting, *, waited: bool = False) -> None:
        """``me`` leaves: the lead passes to the first answer still waiting — when ``me``
        led, or (``waited``: cancelled while it waited) had just been handed the lead.  A
        leader cancelled before its own answer was taken leaves the queue too."""
        with self._lock:
            if me in self._queue:
                self._queue.remove(me)
            if waited and not me.lead:
                return
            if self._queue:
                nxt = self._queue[0]
                nxt.lead = True
                nxt.done.set()
            else:
                self._leading = False

    @staticmethod
    def _outcome(me: _Waiting) -> ConsumeResult:
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _plan(self, group: list[_Waiting]) -> Plan:
        """The group's transaction: read and lock their sagas, decide, write."""
        ids = [w.saga_id for w in group]
        rows = {r.saga_id: r for r in (yield SELECT_MANY, {"saga_ids": ids})}
        planned = []
        for w in group:
            row = rows.get(w.saga_id)
            plan = _Planned(w, row, w.choose(self.saga_of(row), row))
            if plan.decision is None and waits(row):
                last = (yield LAST, {"saga_id": w.saga_id}).first()
                if taken(last, w.answered):
                    plan.again = decide.again(self.saga_of(row), row, self.service)
            planned.append(plan)
        log_rows: list[dict[str, Any]] = []
        for plan in planned:
            decision = plan.decision
            if decision is None:
                continue
            for stmt, params, conditioned in writes(plan.row, decision, steps=False):
                changed((yield stmt, params), conditioned, plan.row)
            log_rows += decision.log
            done = ended(plan.row, decision) if self.on_end is not None else None
            if done is not None:
                yield done
        if log_rows:
            yield INSERT_STEPS, log_rows
        return planned

    def _counted(self, planned: list[_Planned]) -> None:
        """A group committed: its counts, and each decision's metrics."""
        self.groups += 1
        self.grouped += len(planned)
        for plan in planned:
            if plan.decision is not None:
                committed(plan.row.name, plan.decision, plan.row.state)

    # -- async ---------------------------------------------------------------------------------

    async def decide(self, saga_id: str, choose: Any, answered: tuple[str, str]) -> ConsumeResult:
        """Decide an answer to saga ``saga_id`` (``choose(saga, row)``: its decision), in a
        group with the answers waiting meanwhile."""
        me = _Waiting(saga_id, choose, answered, anyio.Event())
        if not self._join(me):
            try:
                await me.done.wait()
            except BaseException:
                self._hand_over(me, waited=True)
                raise
        if not me.settled:  # it leads
            current: list[_Waiting] = []
            try:
                while not me.settled:
                    current = self._take()
                    await self._decide_group(current)
            finally:
                for w in current:  # cancelled in the middle of a group
                    if not w.settled:
                        w.settle(None, RuntimeError("the coordinator stopped meanwhile"))
                self._hand_over(me)
        return self._outcome(me)

    async def _decide_group(self, group: list[_Waiting]) -> None:
        if len(group) > 1:
            try:
                planned = await self._together(group)
            except Exception as exc:
                log.info("%d answers failed together (%s): each is decided alone", len(group), exc)
            else:
                self._counted(planned)
                async with anyio.create_task_group() as tg:  # different sagas' sends at once
                    for plan in planned:
                        tg.start_soon(self._send, plan)
                return
        for w in group:
            try:
                w.settle(await self.alone(w.saga_id, w.choose, w.answered))
            except Exception as exc:
                w.settle(None, exc)

    async def _together(self, group: list[_Waiting]) -> list[_Planned]:
        async with self.sessions() as session:
            plan = self._plan(group)
            value: Any = None
            try:
                while True:
                    step = plan.send(value)
                    if isinstance(step, Ended):
                        assert self.on_end is not None
                        value = self.on_end(step, session)
                        if inspect.isawaitable(value):
                            await value
                    else:
                        value = await session.execute(*step)
            except StopIteration as stop:
                planned: list[_Planned] = stop.value
            await session.commit()
        return planned

    async def _send(self, plan: _Planned) -> None:
        """A committed decision's messages (a send that fails fails that answer alone:
        delivered again, it finds its decision taken and sends the command again), then its
        deadline's recall."""
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

    # -- blocking (the same, on the consumer's worker threads) ----------------------------------

    def decide_sync(self, saga_id: str, choose: Any, answered: tuple[str, str]) -> ConsumeResult:
        """:meth:`decide` in sync mode."""
        me = _Waiting(saga_id, choose, answered, threading.Event())
        if not self._join(me):
            me.done.wait()
        if not me.settled:  # it leads
            try:
                while not me.settled:
                    self._decide_group_sync(self._take())
            finally:
                self._hand_over(me)
        return self._outcome(me)

    def _decide_group_sync(self, group: list[_Waiting]) -> None:
        if len(group) > 1:
            try:
                planned = self._together_sync(group)
            except Exception as exc:
                log.info("%d answers failed together (%s): each is decided alone", len(group), exc)
            else:
                self._counted(planned)
                for plan in planned:
                    self._send_sync(plan)
                return
        for w in group:
            try:
                w.settle(self.alone(w.saga_id, w.choose, w.answered))
            except Exception as exc:
                w.settle(None, exc)

    def _together_sync(self, group: list[_Waiting]) -> list[_Planned]:
        with self.sessions() as session:
            plan = self._plan(group)
            value: Any = None
            try:
                while True:
                    step = plan.send(value)
                    if isinstance(step, Ended):
                        assert self.on_end is not None
                        value = self.on_end(step, session)
                    else:
                        value = session.execute(*step)
            except StopIteration as stop:
                planned: list[_Planned] = stop.value
            session.commit()
        return planned

    def _send_sync(self, plan: _Planned) -> None:
        decision = plan.decision or plan.again  # (as _send)
        if decision is not None:
            try:
                for msg in outgoing(decision, self.service):
                    raise_if_not_safe(self.producer.send(msg, sharding_key=plan.row.saga_id))
            except Exception as exc:
                plan.waiting.settle(None, exc)
                return
            if decision.recall is not None:
                try:
                    self.producer.recall(self.topic, decision.recall)
                except TxmqError as exc:
                    not_recalled(decision.recall, exc)
        plan.waiting.settle(ConsumeResult.SUCCESS)
