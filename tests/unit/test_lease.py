"""Under a controller every acknowledgement needs the master's lease (issue 32, item 5):
a write a slave confirmed is not acknowledged once the lease ran out — a master paused past
it reads, when it resumes, confirmations its slaves sent before the pause."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from txmq.broker.ha.role import Role
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.context import FlushAcks
from txmq.broker.store import MessageStore
from txmq.protocol.wire import Sent
from txmq.protocol.wire.errors import NotMaster


def _master(**kw: Any) -> Role:
    return Role("sync", True, 2, controlled=True, lease_s=2.0, **kw)


class _Gate:
    """Replication's gate over a real :class:`Role`: a write waits for a confirmation the
    test gives."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.waiting: list[Callable[[str], None]] = []

    def may_acknowledge(self) -> bool:
        return self.role.may_acknowledge()

    def sync_replication(self) -> bool:
        return True

    def when_copied(self, end: int, done: Callable[[str], None], timeout_s: float) -> None:
        self.waiting.append(done)


def test_the_lease_is_needed_with_a_sync_state_set_and_only_then() -> None:
    role = _master(in_sync=frozenset({1}), proposed=frozenset({1}))
    assert not role.may_acknowledge()  # no lease yet
    role.renew(time.monotonic())
    assert role.may_acknowledge()
    role.renew(time.monotonic() - 2.5)  # a confirmation of an answer sent before a pause
    role.lease_until = time.monotonic() - 0.5
    assert not role.may_acknowledge()
    alone = _master()  # no slave could be elected: no lease needed
    assert alone.may_acknowledge()
    uncontrolled = Role("sync", True, 0)
    assert uncontrolled.may_acknowledge()
    assert not Role("sync", False, 2, controlled=True).may_acknowledge()


@pytest.mark.parametrize("status", ["", "FLUSH_SLAVE_TIMEOUT"])
def test_a_write_confirmed_after_the_lease_ran_out_is_not_acknowledged(status: str) -> None:
    async def run() -> None:
        role = _master(in_sync=frozenset({1}), proposed=frozenset({1}))
        role.renew(time.monotonic())
        gate = _Gate(role)
        acks = FlushAcks(cast(MessageStore, None), BrokerConfig(), gate)
        answer = Sent(msg_id="m", offset_msg_id="o", queue_id=0, queue_offset=0, store_timestamp=1)
        within = acks.after_flush(100, answer)
        later = acks.after_flush(200, answer)
        assert isinstance(within, asyncio.Future) and isinstance(later, asyncio.Future)
        gate.waiting[0](status)  # confirmed (or timed out) while the lease runs
        assert (await within).status == status
        role.lease_until = time.monotonic() - 0.001  # paused past the lease
        gate.waiting[1](status)  # the confirmation read on resume
        with pytest.raises(NotMaster, match="lease ran out"):
            await later

    asyncio.run(run())


def test_a_master_whose_lease_ran_out_stores_nothing() -> None:
    """Issue 32, the isolate fault: a master cut off from its controller and slaves refused
    each send only after storing it and waiting sync_replication_timeout_s for a slave;
    once its lease ran out it refuses before storing (NOT_MASTER at once)."""
    role = _master(in_sync=frozenset({1}), proposed=frozenset({1}))
    role.renew(time.monotonic())
    store = cast(MessageStore, type("Store", (), {"writable": True})())
    acks = FlushAcks(store, BrokerConfig(), _Gate(role))
    acks.check_may_store()  # the lease runs
    role.lease_until = time.monotonic() - 0.001
    with pytest.raises(NotMaster, match="not stored"):
        acks.check_may_store()
    slave = cast(MessageStore, type("Store", (), {"writable": False})())
    FlushAcks(slave, BrokerConfig(), _Gate(role)).check_may_store()  # (a slave's store refuses)
