"""Replication's answers through faults, on real processes (issue 32): a SYNC_MASTER's
FLUSH_SLAVE_TIMEOUT reaches a producer with default settings, and a master paused past its
lease and replaced acknowledges nothing when it resumes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.integration.test_failover import check_everything_acknowledged_is_there_once
from tests.replicaset import ReplicaSet, Sender, replica_sets
from txmq import Message
from txmq.sync import Producer

__all__ = ["replica_sets"]  # the fixture

TOPIC = "jepsen"


@pytest.mark.timeout(180)
def test_a_producer_with_default_settings_sees_flush_slave_timeout(
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    """The broker's wait for a slave (sync_replication_timeout_s, 2 s) fits inside the
    producer's default send timeout (3 s): the status reaches the caller (it was answered
    3 s after storing, just as the client gave up, and never seen)."""
    rs = replica_sets("sync", replicas=2)
    master = rs.wait_healthy()
    [slave] = [i for i in rs.brokers if i != master]
    with Producer(namesrv=rs.namesrv.address) as producer:  # send_timeout 3 s
        assert producer.send(Message(TOPIC, b"before")).status == "SEND_OK"
        rs.brokers[slave].pause()
        try:
            began = time.monotonic()
            result = producer.send(Message(TOPIC, b"while its slave is paused"))
            took = time.monotonic() - began
        finally:
            rs.brokers[slave].resume()
        assert result.status == "FLUSH_SLAVE_TIMEOUT", result
        assert 1.5 < took < 3.0, took
        wait_for(lambda: producer.send(Message(TOPIC, b"after")).status == "SEND_OK", 30)


@pytest.mark.timeout(180)
def test_a_send_held_by_a_paused_master_is_sent_to_the_new_one(
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    """A send waits on a master that was just SIGSTOPped.  The producer's stall check
    (``stall_check_s``, 0.5 s) fetches the route while it waits; once the route names no
    master (the election) or another one, the send stops waiting and goes to the new
    master: it is answered long before its 20 s timeout (without the check it waits the
    whole 20 s for the paused node, and only then tries the new master)."""
    rs = replica_sets("sync")
    old = rs.wait_healthy()
    with Producer(namesrv=rs.namesrv.address, send_timeout=20.0) as producer:
        assert producer.send(Message(TOPIC, b"before")).status == "SEND_OK"
        rs.brokers[old].pause()
        try:
            began = time.monotonic()
            result = producer.send(Message(TOPIC, b"held, then moved"))
            took = time.monotonic() - began
            new = rs.master()
        finally:
            rs.brokers[old].resume()
    assert result.status == "SEND_OK", result
    assert new not in (old, -1)
    assert took < 12.0, f"the send waited {took:.1f} s for the paused master"
    print(f"master {old} paused: the send was answered by broker {new} after {took:.2f} s")


@pytest.mark.timeout(240)
def test_a_master_paused_past_its_lease_acknowledges_nothing_when_it_resumes(
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    """A SYNC set under load: its slaves are SIGSTOPped (the master's sends wait for their
    confirmations), then the master, then the slaves go on and elect a new master.  The
    old master is SIGCONTed once that happened (its lease ran out long before), while the
    sends it holds still wait (15 s timeout): it must acknowledge none of them.  The master
    was idle when paused (nothing came to decide for 0.3 s), so a send that began before
    its pause and was answered SEND_OK after its resume was acknowledged by it after its
    lease (``retry_times=0``: a send goes to one broker).  Then every acknowledged message
    is there once and the logs are identical.  (Here the old master hears of its
    demotion before it reads a stale confirmation; the lease check on confirmed writes
    themselves is tested in tests/unit/test_lease.py.)"""
    rs = replica_sets("sync")
    old = rs.wait_healthy()
    slaves = [rs.brokers[i] for i in rs.brokers if i != old]
    sender = Sender(
        rs.namesrv.address, TOPIC, threads=8, send_timeout=15.0, stall_check_s=None
    ).start()  # (no stall check: the held sends wait for the old master's answers)
    try:
        wait_for(lambda: sender.acked_count() >= 300, timeout=60)
        for slave in slaves:
            slave.pause()
        time.sleep(0.3)  # the fault's shape: the master's answers all left, sends wait
        paused_at = time.monotonic()
        rs.brokers[old].pause()
        for slave in slaves:
            slave.resume()
        try:
            wait_for(lambda: rs.master() not in (-1, old), timeout=30)
        finally:
            resumed_at = time.monotonic()
            rs.brokers[old].resume()
        assert resumed_at - paused_at < 12.0  # the sends it holds still wait
        rs.wait_healthy()
        moment = time.monotonic()
        wait_for(lambda: sender.acked_since(moment), timeout=60)
    finally:
        sender.stop()
    late = [n for began, answered, n in sender.spans if began < paused_at < resumed_at < answered]
    assert not late, f"acknowledged by the deposed master after its lease: {late[:20]}"
    count = check_everything_acknowledged_is_there_once(rs, sender)
    print(f"{count} messages; {len(sender.failed)} sends failed over the pause")


@pytest.mark.timeout(240)
def test_under_all_ack_a_reachable_in_sync_slave_is_elected_while_another_is_silent(
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    """all_ack_in_sync (RocketMQ 5's allAckInSyncStateSet, issue 32 item 2): an in-sync
    slave SIGSTOPped (silent to the controller and to the master) and at once the master
    SIGKILLed: the other in-sync slave is elected while the paused one is still silent —
    every SEND_OK write was on both.  (Under the default rule the election waits for the
    silent one: tests/unit/test_controller.py.)  Then every acknowledged message is there
    once and the logs are identical."""
    rs = replica_sets("sync", all_ack_in_sync="true")
    master = rs.wait_healthy()
    quiet, other = [i for i in rs.brokers if i != master]
    sender = Sender(rs.namesrv.address, TOPIC, threads=4).start()
    try:
        wait_for(lambda: sender.acked_count() >= 300, timeout=60)
        state = rs.state()
        assert state is not None and set(state.in_sync) == {quiet, other}, state
        rs.brokers[quiet].pause()
        rs.kill(master)
        try:
            wait_for(lambda: rs.master() == other, timeout=30)
        finally:
            rs.brokers[quiet].resume()  # (SEND_OK needs a slave again: the new master has one)
        moment = time.monotonic()
        wait_for(lambda: sender.acked_since(moment), timeout=30)
        rs.restart(master)
        rs.wait_healthy()
    finally:
        sender.stop()
    count = check_everything_acknowledged_is_there_once(rs, sender)
    print(f"{count} messages; {len(sender.failed)} sends failed")
