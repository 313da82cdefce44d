"""The demo's faults: how each is injected, when the system has settled after it, and how
its particular outcome is verified (beyond the books, which every run checks).  The broker
faults are in :mod:`examples.orders.faults_broker`, the saga faults in
:mod:`examples.orders.faults_saga`, what they all share in :mod:`examples.orders.fault_base`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from examples.orders.fault_base import SETTLED, Fault, FaultResult, short
from examples.orders.faults_broker import BrokerRestart, MasterFailover
from examples.orders.faults_saga import (
    CoordinatorCrash,
    Deadline,
    Duplicates,
    ParticipantCrash,
    Reordered,
)
from examples.orders.models import (
    BLOCKED,
    BROKE,
    CANCELLED,
    CONFIRMED,
    FAULT_CUSTOMER,
    FAULT_PRODUCT,
)
from examples.orders.web import request
from txmq import Message
from txmq.saga import command_topic
from txmq.sync import Producer

if TYPE_CHECKING:
    from examples.orders.demo import Demo

__all__ = ["CLUSTER_ONLY", "FAULTS", "Fault", "FaultResult"]


class OrderCrash(Fault):
    def __init__(self, point: str) -> None:
        self.point = point
        self.name = f"order-crash-{point.removesuffix('-db-commit')}-commit"
        when = "before" if point.startswith("before") else "after"
        self.what = f"order service SIGKILLed starting a saga, {when} its database commit " + (
            "(half message sent)" if when == "before" else "(broker not yet told COMMIT)"
        )

    def inject(self, demo: Demo) -> FaultResult:
        assert demo.orders is not None
        status, body = request(demo.orders_url, "POST", "/faults", {"crash": self.point})
        if status != 200:
            raise RuntimeError(f"arming {self.point}: {status} {body}")
        status, _ = demo.place(FAULT_PRODUCT, 1)
        line = demo.orders.wait_line(f"FAULT {self.point} ")
        demo.orders.wait_exit()
        rolled_back = demo.rolled_back_transactions()
        demo.start_orders()
        return self._result(order_id=line.split()[2], status=status, rolled_back=rolled_back)

    def verify(self, demo: Demo, result: FaultResult) -> None:
        order_id = result.data["order_id"]
        state = demo.order_states([order_id]).get(order_id)
        if self.point == "before-db-commit":
            checked = demo.rolled_back_transactions() - result.data["rolled_back"]
            result.verified = state is None and checked >= 1 and result.data["status"] == 0
            result.detail = (
                f"order {short(order_id)} never existed; the broker checked back, the "
                f"transaction log had no commit, the answer was ROLLBACK ({checked} "
                "transaction(s) rolled back by check-back)"
            )
        else:
            result.verified = state in SETTLED
            result.detail = (
                f"order {short(order_id)} was committed, the broker never heard COMMIT; "
                f"its check-back found the commit in the log and delivered it: {state}"
            )


class Poison(Fault):
    name = "poison"
    what = "a malformed saga command"
    key = "poison-1"

    def inject(self, demo: Demo) -> FaultResult:
        with Producer(group="demo-poisoner", **demo.client_args) as producer:
            msg = Message(command_topic("inventory"), b"{not json", tags="action", keys=[self.key])
            producer.send(msg, sharding_key=self.key)
        return self._result()

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        return self.key in demo.dlq()

    def verify(self, demo: Demo, result: FaultResult) -> None:
        result.verified = self.key in demo.dlq()
        result.detail = (
            "it cannot be read, so no retry can help: moved to %DLQ%saga-inventory at once; "
            "every other saga kept flowing"
        )


def _participant_faults() -> list[Fault]:
    return [
        ParticipantCrash("inventory", "in-reserve", FAULT_CUSTOMER, CONFIRMED),
        ParticipantCrash("inventory", "in-release", BROKE, CANCELLED),
        ParticipantCrash("payment", "in-charge", FAULT_CUSTOMER, CONFIRMED),
        ParticipantCrash("payment", "in-refund", BLOCKED, CANCELLED),
    ]


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        OrderCrash("before-db-commit"),
        OrderCrash("after-db-commit"),
        CoordinatorCrash(),
        BrokerRestart(),
        MasterFailover(),
        *_participant_faults(),
        Deadline(),
        Duplicates(),
        Reordered(),
        Poison(),
    )
}
"""Every fault by name, in the order the demo injects them."""

CLUSTER_ONLY = frozenset({MasterFailover.name})
"""Faults that need a cluster: ``--single-broker`` leaves them out."""
