"""Consumer groups on the broker: heartbeats, membership notifications, expiry, queue locks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import pytest

from tests.conftest import raw_request
from txmq import AdminClient
from txmq.broker.server import EmbeddedBroker
from txmq.client.core import BrokerClient
from txmq.protocol.wire import (
    ConsumerData,
    Empty,
    GetConsumerListByGroup,
    Heartbeat,
    LockBatchMq,
    NotifyConsumerIdsChanged,
    Request,
    RequestCode,
    UnlockBatchMq,
    UnregisterClient,
)
from txmq.protocol.wire.base import Response
from txmq.protocol.wire.errors import BadRequest
from txmq.transports.port import Calls

pytestmark = pytest.mark.anyio


async def until(predicate: Callable[[], Awaitable[Any] | Any], timeout: float = 10.0) -> Any:
    """Poll ``predicate`` (sync or async) until it is truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await anyio.sleep(0.01)


class Noted(BrokerClient):
    """A client that records the broker's membership notices."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.notified: list[str] = []

    def serve(self, request: Request[Any], body: bytes, origin: Calls) -> Response | None:
        if isinstance(request, NotifyConsumerIdsChanged):
            self.notified.append(request.group)
            return Empty()
        return super().serve(request, body, origin)


class Member:
    """A raw client that heartbeats as a consumer and records the broker's notifications."""

    def __init__(self, address: str, client_id: str) -> None:
        self.client_id = client_id
        self.client = Noted(address)
        self.notified = self.client.notified

    async def heartbeat(
        self,
        *groups: str,
        model: Literal["CLUSTERING", "BROADCASTING"] = "CLUSTERING",
        producers: tuple[str, ...] = (),
    ) -> None:
        consumers = [
            ConsumerData(
                group=g,
                message_model=model,
                subscriptions={"orders": "*", f"%RETRY%{g}": "*"},
            )
            for g in groups
        ]
        await self.client.call(
            Heartbeat(client_id=self.client_id, consumers=consumers, producers=list(producers))
        )

    async def lock(self, group: str, *queues: tuple[str, int]) -> list[tuple[str, int]]:
        request = LockBatchMq(group=group, client_id=self.client_id, queues=list(queues))
        return list((await self.client.call(request)).locked)

    async def unlock(self, group: str, *queues: tuple[str, int]) -> None:
        request = UnlockBatchMq(group=group, client_id=self.client_id, queues=list(queues))
        await self.client.call(request)


async def members(client: BrokerClient, group: str) -> list[str]:
    return list((await client.call(GetConsumerListByGroup(group=group))).client_ids)


async def test_membership_changes_are_announced(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    a, b = Member(eb.address, "client-a"), Member(eb.address, "client-b")
    async with a.client, AdminClient(eb.address) as admin:
        assert await members(admin, "g1") == []
        await a.heartbeat("g1")
        assert await members(admin, "g1") == ["client-a"]
        topics = {t.topic: t for t in await admin.topics()}
        assert topics["%RETRY%g1"].queue_nums == 1 and topics["%RETRY%g1"].system
        a.notified.clear()

        await a.heartbeat("g1")  # a renewal changes nothing
        async with b.client:
            await b.heartbeat("g1")
            assert await members(admin, "g1") == ["client-a", "client-b"]
            await until(lambda: a.notified == ["g1"])
        # b's connection closed: it leaves, a is told
        await until(lambda: a.notified == ["g1", "g1"])
        assert await members(admin, "g1") == ["client-a"]

        # BROADCASTING groups are members too, without a retry topic
        await a.heartbeat("bcast", model="BROADCASTING")
        assert await members(admin, "bcast") == ["client-a"]
        assert "%RETRY%bcast" not in {t.topic for t in await admin.topics()}

        # UNREGISTER_CLIENT
        c = Member(eb.address, "client-c")
        async with c.client:
            await c.heartbeat("g1")
            await until(lambda: a.notified.count("g1") == 3)
            await c.client.call(UnregisterClient(client_id="client-c", consumer_groups=["g1"]))
            assert await members(admin, "g1") == ["client-a"]
            await until(lambda: a.notified.count("g1") == 4)


async def test_reconnecting_client_keeps_its_membership(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    assert eb.broker is not None
    broker = eb.broker
    old, new = Member(eb.address, "same-id"), Member(eb.address, "same-id")
    async with AdminClient(eb.address) as admin, new.client:
        async with old.client:
            await old.heartbeat("g2")
            await new.heartbeat("g2")  # the same client id from a second connection
            assert len(broker.connections) == 3
        # the old connection closed, but the member now lives on the new one
        await until(lambda: len(broker.connections) == 2)
        assert await members(admin, "g2") == ["same-id"]
        await new.client.stop()
        await until(lambda: _not(members(admin, "g2")))


async def _not(value: Awaitable[Any]) -> bool:
    return not await value


async def test_silent_members_expire(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(consumer_channel_expiry_s=1.0)
    assert eb.broker is not None
    quiet, alive = Member(eb.address, "quiet"), Member(eb.address, "alive")
    async with quiet.client, alive.client, AdminClient(eb.address) as admin:
        began = time.monotonic()  # before quiet's last heartbeat: expiry counts from it
        await quiet.heartbeat("g3", producers=("pg",))
        await alive.heartbeat("g3", producers=("pg",))
        assert await members(admin, "g3") == ["alive", "quiet"]
        assert eb.broker.producers.client_ids("pg") == ["alive", "quiet"]
        alive.notified.clear()
        async with anyio.create_task_group() as tg:

            async def keep_alive() -> None:
                while True:
                    await alive.heartbeat("g3", producers=("pg",))
                    await anyio.sleep(0.1)

            tg.start_soon(keep_alive)
            await until(lambda: _equals(members(admin, "g3"), ["alive"]))
            assert time.monotonic() - began >= 1.0
            await until(lambda: alive.notified == ["g3"])
            assert eb.broker.producers.client_ids("pg") == ["alive"]
            tg.cancel_scope.cancel()
        # the silent client's connection stays open: only its membership expired
        assert not (await quiet.client.remoting.connection()).closed


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


async def test_producer_groups_follow_connections(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    assert eb.broker is not None
    broker = eb.broker
    p = Member(eb.address, "producer-1")
    async with p.client:
        await p.heartbeat(producers=("orders-pg",))
        assert broker.producers.client_ids("orders-pg") == ["producer-1"]
        assert len(broker.producers.connections("orders-pg")) == 1
        assert await members(p.client, "orders-pg") == []  # a producer is not a consumer
    await until(lambda: broker.producers.client_ids("orders-pg") == [])


async def test_bad_heartbeats_are_refused(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker()
    async with BrokerClient(eb.address) as client:
        for header in (
            {"client_id": "x", "consumers": [{"group": "g", "message_model": "BOTH"}]},
            {"client_id": "x", "consumers": [{"group": 5}]},
            {"client_id": "x", "consumers": "g"},
            {"consumers": [{"group": "g"}]},
            {"client_id": "x", "consumers": [{"group": "g", "subscriptions": ["t"]}]},
            {"client_id": "x", "producers": [1]},
        ):
            with pytest.raises(BadRequest):
                await raw_request(client, RequestCode.HEARTBEAT, header)
        with pytest.raises(BadRequest):
            await raw_request(client, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {})
        # an empty heartbeat (no groups) is still fine
        await client.call(Heartbeat(client_id="x"))


async def test_queue_locks(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(lock_expiry_s=0.5)
    a, b = Member(eb.address, "lock-a"), Member(eb.address, "lock-b")
    q0, q1, q2 = ("orders", 0), ("orders", 1), ("orders", 2)
    async with a.client, b.client:
        assert await a.lock("g", q0, q1) == [q0, q1]
        assert await b.lock("g", q1, q2) == [q2]
        assert await b.lock("other", q1) == [q1]  # another group: another lock

        # renewing keeps the lock well past its expiry
        began = time.monotonic()
        while time.monotonic() - began < 1.2:
            assert await a.lock("g", q0, q1) == [q0, q1]
            assert await b.lock("g", q0, q1) == []
            await anyio.sleep(0.1)

        await b.unlock("g", q0)  # not b's lock: nothing happens
        assert await b.lock("g", q0) == []
        await a.unlock("g", q1)
        assert await b.lock("g", q1) == [q1]

        # a stops renewing q0: b gets it once the lock expired, not before
        taken = time.monotonic()  # before the broker renews it: the expiry is later still
        await a.lock("g", q0)
        await until(lambda: _equals(b.lock("g", q0), [q0]))
        assert time.monotonic() - taken >= 0.5
        assert await a.lock("g", q0) == []

        with pytest.raises(BadRequest):
            await raw_request(
                a.client,
                RequestCode.LOCK_BATCH_MQ,
                {"group": "g", "client_id": "lock-a", "queues": [["orders"]]},
            )
