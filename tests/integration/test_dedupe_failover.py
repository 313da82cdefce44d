"""The dedupe window survives a failover: a slave follows the ids in its copy of the log, so
once promoted it answers a retry of a message its old master stored with the original's
result (a SYNC_MASTER and two slaves under the controller, on real processes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.integration.test_dedupe import Resent
from tests.replicaset import ReplicaSet, consume_all, replica_sets
from txmq.protocol.message import new_message_id
from txmq.sync import Producer

__all__ = ["replica_sets"]  # the fixture

TOPIC = "dedupe-failover"


@pytest.fixture
def replica_set(replica_sets: Callable[..., ReplicaSet]) -> ReplicaSet:
    return replica_sets("sync")


def test_a_promoted_slave_answers_retries_of_what_its_old_master_stored(
    replica_set: ReplicaSet,
) -> None:
    rs = replica_set
    first = rs.wait_healthy()
    msgs = [Resent(TOPIC, str(n).encode(), msg_id=new_message_id()) for n in range(200)]
    namesrv = rs.namesrv.address
    with Producer(namesrv=namesrv, retry_times=0) as producer:
        firsts = [producer.send(m) for m in msgs]
    assert {r.status for r in firsts} == {"SEND_OK"}  # on a slave too (SYNC_MASTER)
    rs.kill(first)  # the acknowledgements of a resend of these would be lost with it
    # (an election takes seconds; under the suite's four workers on 2 cores it once took
    # more than 30 s: the controller waits for the in-sync slaves' reports, issue 32)
    wait_for(lambda: rs.master() not in (-1, first), timeout=90)
    new = rs.wait_healthy()
    assert "dedupe window: 200 key hashes" in rs.brokers[new].output()
    with Producer(namesrv=namesrv, retry_times=2) as producer:
        agains = [producer.send(m) for m in msgs]
        later = producer.send(Resent(TOPIC, b"200", msg_id=new_message_id()))
    assert agains == firsts  # same queue, queue offset, offset message id, store time
    assert later.status == "SEND_OK"
    seen = consume_all(namesrv, TOPIC)
    assert sorted(seen) == list(range(201)) and set(seen.values()) == {1}
