"""How an admin client reaches "its brokers": the one broker it was given, or every master
the name servers know — one code path for both.

:meth:`ClusterClient.brokers` lists them; :meth:`ClusterClient._each` asks them all at once
and keeps the answers of those that answered (a broker that does not is logged and left out
of a listing; when none answers, the error is raised); :meth:`ClusterClient._all_or_raise`
makes a change on every one of them or says where it was done and where not.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio

from txmq.client.core import BrokerClient
from txmq.protocol.wire import (
    MASTER_ID,
    ClusterInfo,
    GetClusterInfo,
    GetTopicRoute,
    Request,
    TopicRoute,
    WithBody,
)
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import BrokerUnavailable, TxmqError

__all__ = ["BrokerAddress", "ClusterClient", "is_offset_id", "merged"]

log = logging.getLogger("txmq.admin")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """A broker an admin client asks: its cluster, broker set, broker id (0: the master)
    and address.  A broker given directly has an empty cluster and name."""

    cluster: str
    broker_name: str
    broker_id: int
    address: str

    def __str__(self) -> str:
        return f"{self.broker_name} ({self.address})" if self.broker_name else self.address


def is_offset_id(msg_id: str) -> bool:
    """An offset message id (16 hex digits: a commit-log offset) names a message on one
    broker only; unique ids (32 hex digits) are the same on every broker."""
    if len(msg_id) != 16:
        return False
    try:
        int(msg_id, 16)
    except ValueError:
        return False
    return True


def merged(lists: Iterable[list[T]], key: Callable[[T], int], limit: int) -> list[T]:
    """Lists each in ``key`` order, as one (one list: as it is), at most ``limit`` long."""
    out: list[T] = []
    for item in heapq.merge(*lists, key=key):
        if len(out) >= limit:
            break
        out.append(item)
    return out


class ClusterClient(BrokerClient):
    """A client that asks every broker of its cluster (or the one it was given)."""

    # -- the brokers of this client -------------------------------------------------------

    async def brokers(
        self, *, broker: str | None = None, cluster: str | None = None
    ) -> list[BrokerAddress]:
        """The brokers this client asks: the one given directly, or every master the name
        servers know (only those of ``cluster``, or only the broker set ``broker``), in
        broker-name order."""
        if self.direct is not None:
            if broker is not None or cluster is not None:
                raise ValueError(
                    f"naming a broker set or a cluster needs name servers: this client talks "
                    f"to the broker at {self.direct} alone"
                )
            return [BrokerAddress("", "", MASTER_ID, self.direct)]
        info = await self.cluster_info()
        names: set[str] | None = None
        if cluster is not None:
            if cluster not in info.clusters:
                known = ", ".join(sorted(info.clusters)) or "none"
                raise ValueError(f"the name servers know no cluster {cluster!r} (known: {known})")
            names = set(info.clusters[cluster])
        if broker is not None:
            names = {broker} & names if names is not None else {broker}
        found = [b for b in info.brokers if names is None or b.broker_name in names]
        if broker is not None and not found:
            known = ", ".join(sorted(b.broker_name for b in info.brokers)) or "none"
            raise ValueError(f"the name servers know no broker {broker!r} (known: {known})")
        out = []
        for b in sorted(found, key=lambda b: b.broker_name):
            master = b.addresses.get(MASTER_ID)
            if master is None:
                log.warning("broker set %s has no master now: left out", b.broker_name)
                continue
            out.append(BrokerAddress(b.cluster, b.broker_name, MASTER_ID, master))
        if not out:
            raise BrokerUnavailable("the name servers know no broker with a master")
        return out

    async def cluster_info(self) -> ClusterInfo:
        """The name servers' brokers and clusters (the first name server that answers)."""
        return await self.ask_namesrv(GetClusterInfo())

    async def ask_namesrv(self, request: Request[R]) -> R:
        if self.direct is not None:
            raise ValueError(f"this client talks to the broker at {self.direct}, not name servers")
        self._task_group()
        return await self.routes.ask_namesrv(request)

    async def ask(self, target: BrokerAddress, request: Request[R], body: bytes = b"") -> R:
        return (await self.ask_with_body(target, request, body)).header

    async def ask_with_body(
        self, target: BrokerAddress, request: Request[R], body: bytes = b""
    ) -> WithBody[R]:
        self._task_group()
        remote = self.routes.remote(target.address)
        return await remote.call(request, body, timeout=self.request_timeout)

    async def _gather(
        self, targets: Sequence[BrokerAddress], ask: Callable[[BrokerAddress], Awaitable[T]]
    ) -> tuple[dict[int, T], dict[int, TxmqError]]:
        """``ask`` every target at once: answers and errors by target index."""
        answers: dict[int, T] = {}
        errors: dict[int, TxmqError] = {}

        async def one(i: int, target: BrokerAddress) -> None:
            try:
                answers[i] = await ask(target)
            except TxmqError as exc:
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i, target in enumerate(targets):
                tg.start_soon(one, i, target)
        return answers, errors

    async def _each(
        self,
        targets: Sequence[BrokerAddress],
        ask: Callable[[BrokerAddress], Awaitable[T]],
        *,
        nothing: tuple[type[TxmqError], ...] = (),
    ) -> list[tuple[BrokerAddress, T]]:
        """``ask`` every target at once; the answers of those that answered, in target
        order.  An error of a class in ``nothing`` means the broker has nothing to add
        (no such topic there); any other is logged and the broker left out.  When no
        target answered, an error is raised (:func:`failure`)."""
        answers, errors = await self._gather(targets, ask)
        if errors and not answers:
            raise failure([(targets[i], errors[i]) for i in sorted(errors)])
        for i in sorted(errors):
            if not isinstance(errors[i], nothing):
                why = errors[i]
                log.warning("broker %s did not answer (%s): its part is missing", targets[i], why)
        return [(targets[i], answers[i]) for i in sorted(answers)]

    async def topic_route(self, topic: str) -> TopicRoute:
        """The topic's route as the name servers hold it (a broker given directly: as it
        answers for itself): each broker set's queue counts and permissions, and its
        brokers' addresses.  :meth:`route` is the same, digested and cached."""
        if self.direct is not None:
            return await self.call(GetTopicRoute(topic=topic))
        return await self.ask_namesrv(GetTopicRoute(topic=topic))

    async def _topic_brokers(self, topic: str) -> list[BrokerAddress]:
        """The brokers of this client that hold ``topic`` (a direct broker: itself)."""
        if self.direct is not None:
            return await self.brokers()
        route = await self.topic_route(topic)
        holding = {q.broker_name for q in route.queues}
        out = []
        for b in sorted(route.brokers, key=lambda b: b.broker_name):
            master = b.addresses.get(MASTER_ID)
            if b.broker_name in holding and master is not None:
                out.append(BrokerAddress(b.cluster, b.broker_name, MASTER_ID, master))
        if not out:
            raise BrokerUnavailable(f"no broker set holding {topic!r} has a master now")
        return out

    async def _all_or_raise(
        self,
        targets: Sequence[BrokerAddress],
        ask: Callable[[BrokerAddress], Awaitable[T]],
        done: str,
    ) -> list[tuple[BrokerAddress, T]]:
        """A change on every target: their answers, or an error saying where it was
        ``done`` and where it failed."""
        answers, errors = await self._gather(targets, ask)
        if errors:
            failed = [(targets[i], errors[i]) for i in sorted(errors)]
            if not answers:
                raise failure(failed)
            ok = ", ".join(targets[i].broker_name for i in sorted(answers))
            said = "; ".join(f"{t}: {e}" for t, e in failed)
            raise BrokerUnavailable(f"{done} on {ok}; failed on {said}")
        return [(targets[i], answers[i]) for i in sorted(answers)]


def failure(failed: list[tuple[BrokerAddress, TxmqError]]) -> TxmqError:
    """The error of brokers none of which answered: the only one's as it is; the same
    error of each once, naming them; else :class:`BrokerUnavailable` with each."""
    first = failed[0][1]
    if len(failed) == 1:
        return first
    if all(type(e) is type(first) and str(e) == str(first) for _, e in failed):
        where = ", ".join(t.broker_name for t, _ in failed)
        return type(first)(f"{first} (on every broker: {where})", code=first.code)
    said = "; ".join(f"{t}: {e}" for t, e in failed)
    return BrokerUnavailable(f"every broker failed: {said}")
