"""The job reads every view as of one time (``--now``): what the databases or the broker got
after it is left for the next run, and a transaction gets the SLA to reach the broker."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import wait_for
from tests.spark.conftest import Small
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message
from txmq.sqla.tables import transaction_log
from txmq.sync import TransactionProducer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUP = "shop"


def _later_than(t: datetime) -> datetime:
    """The clock's time once it is past ``t`` by more than a millisecond (the store's unit)."""
    wait_for(lambda: datetime.now(UTC) > t + timedelta(milliseconds=2), timeout=5, interval=0.001)
    return datetime.now(UTC)


def test_what_came_after_the_cut_or_within_the_sla_is_not_an_anomaly(small: Small) -> None:
    with TransactionProducer(small.address, GROUP) as tp:
        # the broker commits a half after the cut, that no local transaction logged (yet):
        # as of the cut it was an undecided half, not a phantom
        r = tp.send_half(Message("orders", b"{}", keys=["o-late"]), transaction_id="late-op")
        as_of = _later_than(datetime.now(UTC))
        _later_than(as_of)
        tp.end_transaction(r, LocalTransactionState.COMMIT)
    committed = {"producer_group": GROUP, "state": "COMMITTED"}
    # committed locally after the cut: not there yet as of the cut
    small.insert(
        transaction_log,
        transaction_id="after-cut",
        created_at=as_of + timedelta(minutes=1),
        **committed,
    )
    # committed a minute before the cut, no half yet: within the SLA (10 minutes)
    small.insert(
        transaction_log,
        transaction_id="young",
        created_at=as_of - timedelta(minutes=1),
        **committed,
    )
    # committed an hour before the cut, no half: lost
    small.insert(
        transaction_log, transaction_id="old", created_at=as_of - timedelta(hours=1), **committed
    )
    found = small.reconcile(now=as_of)
    assert found.ids("lost") == {"old"}, found.rows["lost"]
    assert found.rows["lost"][0]["detail"] == "the broker never got the half message"
    assert found.ids("phantom") == set(), found.rows["phantom"]
    assert found.summary["facts"]["now"] == as_of.isoformat(timespec="seconds")
    # as of later, the local transaction that came after the cut is old enough too, and the
    # half the broker committed is a phantom
    later = small.reconcile(now=as_of + timedelta(hours=1))
    assert later.ids("lost") == {"old", "after-cut", "young"}, later.rows["lost"]
    assert later.ids("phantom") == {"late-op"}, later.rows["phantom"]
