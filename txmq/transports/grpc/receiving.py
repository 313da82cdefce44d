"""The push consumer's receive mode: consumption over RocketMQ 5's gRPC protocol.

RocketMQ 5 has no pull: a consumer asks which message queues its group is assigned
(QueryAssignment), receives batches from each with long polling (ReceiveMessage), each
message invisible to the group's other receives for a while, and then acknowledges it
(AckMessage) or makes it visible again later (ChangeInvisibleDuration).  The endpoint
counts delivery attempts and dead-letters a message after the group's last one.

The listener dispatch is the push consumer's own (:meth:`Consuming.invoke` on one of its
workers: :meth:`Consuming.submit`, its concurrency limits): SUCCESS acknowledges;
RECONSUME_LATER or an exception makes the message visible again after the retry back-off of
its attempt (the endpoint's policy, told in its settings; else RocketMQ's delay levels from
level 3).  While a listener runs longer than half the invisible time, the message's
invisibility is renewed.

Stopping stops receiving at once; received messages whose listener has not started yet are
left alone (they come back once their invisible time is over), and the listeners already
running get up to :data:`STOP_GRACE_S` to finish and be settled (:meth:`ReceiveMode.drain`,
awaited before the endpoint is told the client terminates) before the client's work is
cancelled: a listener cancelled half-way may have done its effects without recording them
(an idempotent consumer's ``done`` mark, its database transaction's commit).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc

from txmq.protocol.grpc_convert import DEFAULT_DELAY_LEVELS_MS, duration_ms
from txmq.protocol.message import MessageExt, MessageQueue
from txmq.protocol.wire.errors import TopicNotFound, TxmqError
from txmq.transports.port import ConsumeResult, Consuming

__all__ = ["STOP_GRACE_S", "Endpoint", "ReceiveMode", "Received", "backoff_s"]

log = logging.getLogger("txmq.consumer")

#: the most a ReceiveMessage may carry, and the longest long poll RocketMQ's proxy allows
MAX_BATCH = 32
MAX_LONG_POLL_S = 20.0
#: how long a stopping consumer waits for its running listeners (the client gives the whole
#: unregistration 5 s: the endpoint is still told of the termination after this)
STOP_GRACE_S = 4.0


def backoff_s(settings: Any, attempt: int) -> float:
    """Seconds until delivery attempt ``attempt`` + 1 of a failed message: the endpoint's
    retry policy (``settings.backoff_policy``), else RocketMQ's delay level 2 + attempt."""
    policy = settings.backoff_policy if settings is not None else None
    if (
        policy is not None
        and policy.HasField("customized_backoff")
        and policy.customized_backoff.next
    ):
        steps = policy.customized_backoff.next
        return duration_ms(steps[min(max(attempt, 1), len(steps)) - 1]) / 1000
    if policy is not None and policy.HasField("exponential_backoff"):
        exp = policy.exponential_backoff
        initial = duration_ms(exp.initial) / 1000
        longest = duration_ms(exp.max) / 1000 or float("inf")
        return float(min(initial * (exp.multiplier or 2.0) ** (max(attempt, 1) - 1), longest))
    levels = DEFAULT_DELAY_LEVELS_MS
    return levels[min(2 + max(attempt, 1), len(levels)) - 1] / 1000


@dataclass(slots=True)
class Received:
    """A received message and what acknowledging it needs."""

    msg: MessageExt
    topic: str
    handle: str
    attempt: int


class Endpoint(Protocol):
    """What receiving needs of the endpoint it receives from
    (:class:`txmq.transports.grpc.remote.GrpcRemote`)."""

    @property
    def address(self) -> str: ...

    #: the endpoint's settings for this client (its retry policy), None until told
    settings: Any

    async def query_assignment(self, topic: str, group: str, timeout: float) -> list[Any]: ...

    async def receive(
        self,
        group: str,
        queue: Any,
        expression: str,
        *,
        batch: int,
        invisible_s: float,
        long_poll_s: float,
        timeout: float,
    ) -> list[Received]: ...

    async def ack(self, group: str, received: Received, timeout: float) -> None: ...

    async def forward_to_dlq(
        self, group: str, received: Received, reason: str, timeout: float
    ) -> None: ...

    async def change_invisible(
        self, group: str, received: Received, invisible_s: float, timeout: float
    ) -> None: ...


class ReceiveMode:
    """Receives for one push consumer (``transport="grpc"``); see the module's documentation."""

    def __init__(self, consumer: Consuming, remote: Endpoint) -> None:
        self.consumer = consumer
        self.remote = remote
        self.invisible_s = consumer.invisible_time
        #: received messages waiting for (or in) their listener: what ack needs
        self._receipts: dict[int, Received] = {}
        self._scope = anyio.CancelScope()
        self._stopping = False
        self._running = 0  # listeners started and not settled yet
        self._idle = anyio.Event()  # set while none runs
        self._idle.set()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._run)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Receive no more and start no more listeners (see :meth:`drain`)."""
        self._stopping = True
        self._scope.cancel()

    async def drain(self, timeout: float = STOP_GRACE_S) -> bool:
        """After :meth:`stop`: wait up to ``timeout`` seconds for the running listeners to
        finish and their messages to be settled; whether they all did."""
        with anyio.move_on_after(timeout):
            while self._running:
                await self._idle.wait()
        if self._running:
            log.warning(
                "%s stops with %d listener(s) still running after %.1fs: they are cancelled "
                "(their messages come back after their invisible time)",
                self.consumer.group,
                self._running,
                timeout,
            )
        return not self._running

    async def _run(self) -> None:
        with self._scope:
            async with anyio.create_task_group() as tg:
                for topic, expression in self.consumer.subscriptions.items():
                    tg.start_soon(self._topic_loop, topic, expression)

    async def _topic_loop(self, topic: str, expression: str) -> None:
        """Receive from each queue the endpoint assigns; ask again after a failure."""
        c = self.consumer
        while True:
            try:
                queues = await self.remote.query_assignment(topic, c.group, c.request_timeout)
            except TopicNotFound:
                c.routed(topic, False)
                await anyio.sleep(c.pull_delay_on_error)
                continue
            except TxmqError as exc:
                log.warning("assignment of %s to %s failed: %s", topic, c.group, exc)
                await anyio.sleep(c.pull_delay_on_error)
                continue
            c.routed(topic, True)
            if not queues:
                await anyio.sleep(c.rebalance_interval)
                continue
            log.info("%s/%s receives %s from %s", c.group, c.client_id, topic, self.remote.address)
            async with anyio.create_task_group() as tg:
                for queue in queues:
                    tg.start_soon(self._receive_loop, topic, queue, expression)

    async def _receive_loop(self, topic: str, queue: Any, expression: str) -> None:
        c = self.consumer
        mq = MessageQueue(topic, queue.broker.name, queue.id)
        failures = 0
        while failures < 3:
            # flow control: receive no more while the worker pool has enough queued
            while c.backlog() >= c.consume_concurrency:  # noqa: ASYNC110
                await anyio.sleep(0.02)
            try:
                got = await self.remote.receive(
                    c.group,
                    queue,
                    expression,
                    batch=max(1, min(c.pull_batch_size, MAX_BATCH, c.consume_concurrency)),
                    invisible_s=self.invisible_s,
                    long_poll_s=min(c.long_poll, MAX_LONG_POLL_S),
                    timeout=c.request_timeout,
                )
            except TxmqError as exc:
                failures += 1
                log.warning("receive from %s failed: %s", mq, exc)
                await anyio.sleep(c.pull_delay_on_error)
                continue
            failures = 0
            for r in got:
                self._receipts[id(r.msg)] = r
                c.submit(functools.partial(self.consume, r.msg))
        # several failures in a row: the assignment may have changed (asked again)

    async def consume(self, msg: MessageExt) -> None:
        """Run the listener on ``msg`` (renewing its invisibility meanwhile), then
        acknowledge it or hand it back for a later attempt."""

        r = self._receipts.pop(id(msg), None)
        if r is None or self._stopping:
            return  # stopping: not started, it comes back after its invisible time
        if not self._running:
            self._idle = anyio.Event()
        self._running += 1
        try:
            status: ConsumeResult
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._renew, r)
                status, why = await self.consumer.invoke(msg)
                tg.cancel_scope.cancel()
            await self.settle(r, status, why)
        finally:
            self._running -= 1
            if not self._running:
                self._idle.set()

    async def settle(self, r: Received, status: ConsumeResult, why: str = "") -> None:
        c = self.consumer
        try:
            if status is ConsumeResult.SUCCESS:
                await self.remote.ack(c.group, r, c.request_timeout)
            elif status is ConsumeResult.DEAD_LETTER:
                await self.remote.forward_to_dlq(c.group, r, why, c.request_timeout)
            else:
                later = backoff_s(self.remote.settings, r.attempt)
                await self.remote.change_invisible(c.group, r, later, c.request_timeout)
        except TxmqError as exc:
            # it comes back once its invisible time is over (consumers are idempotent)
            log.warning("settling %s (%s) failed: %s", r.msg.msg_id, status.name, exc)

    async def _renew(self, r: Received) -> None:
        c = self.consumer
        while True:
            await anyio.sleep(self.invisible_s / 2)
            with anyio.CancelScope(shield=True):  # the new receipt handle must not be lost
                try:
                    await self.remote.change_invisible(
                        c.group, r, self.invisible_s, c.request_timeout
                    )
                except TxmqError as exc:
                    log.warning("renewing %s failed: %s", r.msg.msg_id, exc)
