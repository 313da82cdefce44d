"""RocketMQ 5's pop consumption through the proxy: the endpoint's
:class:`~txmq.server.grpc.ports.PopPort` over txmq's protocol (POP_MESSAGE, ACK_MESSAGE,
CHANGE_MESSAGE_INVISIBLETIME, POP_DEAD_LETTER) to the broker sets' masters.

A receive pops from the broker set the client's assignment names (one assignment per set:
the official clients receive from each in turn), long polling there.  A client that names
none (or one the route does not have) gets the sets in turn: each is asked without waiting,
the last one long polls.  A receipt handle is the broker's own with the name of its broker
set in front, ``BROKER:HANDLE`` (broker names have no ``:``): acks and changes of the
invisible time go to that set, through any proxy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec

from txmq.protocol.codec import decode_record
from txmq.protocol.message import MessageExt, MessageQueue
from txmq.protocol.wire import (
    AckMessage,
    ChangeInvisibleTime,
    DeadLetterPopped,
    PopMessage,
    PoppedEntry,
    PopResult,
    WithBody,
)
from txmq.protocol.wire.errors import InvalidReceiptHandle, TxmqError, error_for_code
from txmq.proxy.batching import Batches
from txmq.proxy.cluster import ClusterLink

__all__ = ["ProxyPopped", "ProxyPops", "split_handle"]


@dataclass(frozen=True, slots=True)
class ProxyPopped:
    msg: MessageExt
    handle: str  # BROKER:HANDLE
    attempt: int
    invisible_until_ms: int


def split_handle(handle: str) -> tuple[str, str]:
    """(broker set, the broker's handle) of a proxy's receipt handle, or
    InvalidReceiptHandle."""
    broker, sep, own = handle.partition(":") if isinstance(handle, str) else ("", "", "")
    if not sep or not broker or not own:
        raise InvalidReceiptHandle(
            "malformed receipt handle: a proxy's handles name their broker set "
            "(BROKER:HANDLE); receive the message again"
        )
    return broker, own


class ProxyPops:
    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self._turns = itertools.count()
        #: acks to a broker set that come in one turn of the event loop go as one request
        self.acks: Batches[tuple[str, str, str], str, None] = Batches(
            self._ack_batch, linger_s=link.batch_linger_s
        )

    async def pop(
        self,
        *,
        broker: str,
        group: str,
        topic: str,
        max_msgs: int,
        invisible_ms: int,
        poll_ms: int,
        expression: str,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[ProxyPopped]:
        route = await self.link.route(topic)
        sets = sorted({mq.broker_name for mq in route.read_queues})
        if broker in sets:
            order = [broker]
        else:
            start = next(self._turns) % max(len(sets), 1)
            order = sets[start:] + sets[:start]
        failed: list[TxmqError] = []
        for i, name in enumerate(order):
            wait_ms = poll_ms if i == len(order) - 1 else 0
            ask = PopMessage(
                group=group,
                topic=topic,
                max_msgs=max_msgs,
                invisible_ms=invisible_ms,
                poll_ms=wait_ms,
                expression=expression,
                fifo=fifo,
                max_attempts=max_attempts,
            )
            try:
                answer = await self.link.call_with_body(
                    ask, broker=name, timeout=wait_ms / 1000 + self.link.request_timeout
                )
            except TxmqError as exc:
                if not exc.retriable:
                    raise
                self.link.routes.failed(
                    MessageQueue(topic, name, 0), unreachable=not getattr(exc, "sent", True)
                )
                failed.append(exc)
                continue
            got = _unpack(name, answer)
            if got:
                return got
        if failed and len(failed) == len(order):
            raise failed[0]
        return []

    async def ack(self, *, group: str, topic: str, handle: str) -> None:
        broker, own = split_handle(handle)
        await self.link.route(topic)  # (names the set's master, in a proxy that just started)
        await self.acks.submit((broker, group, topic), own)

    async def _ack_batch(
        self, key: tuple[str, str, str], handles: list[str]
    ) -> list[BaseException | None]:
        """One ACK_MESSAGE for the acks of a turn of one group and topic on one broker set."""
        broker, group, topic = key
        answer = await self.link.call(
            AckMessage(group=group, topic=topic, handles=handles), broker=broker
        )
        out: list[BaseException | None] = [None] * len(handles)
        for f in answer.failed:
            out[f.index] = error_for_code(f.code, f.error)
        return out

    async def change_invisible(
        self, *, group: str, topic: str, handle: str, invisible_ms: int
    ) -> PoppedEntry:
        broker, own = split_handle(handle)
        await self.link.route(topic)
        ask = ChangeInvisibleTime(group=group, topic=topic, handle=own, invisible_ms=invisible_ms)
        entry = await self.link.call(ask, broker=broker)
        return msgspec.structs.replace(entry, handle=f"{broker}:{entry.handle}")

    async def dead_letter(self, *, group: str, topic: str, handle: str, reason: str = "") -> None:
        broker, own = split_handle(handle)
        await self.link.route(topic)
        ask = DeadLetterPopped(group=group, topic=topic, handle=own, reason=reason)
        await self.link.call(ask, broker=broker)


def _unpack(broker: str, answer: WithBody[PopResult]) -> list[ProxyPopped]:
    body = answer.body
    out: list[ProxyPopped] = []
    pos = 0
    for e in answer.header.entries:
        msg = decode_record(body, pos)
        pos += e.size
        out.append(ProxyPopped(msg, f"{broker}:{e.handle}", e.attempt, e.invisible_until_ms))
    return out
