"""The demo's faults: how each is injected, when the system has settled after it, and how
its particular outcome is verified (beyond the books, which every run checks).  The broker
faults are in :mod:`examples.orders.faults_broker`, what they all share in
:mod:`examples.orders.fault_base`."""

from __future__ import annotations

import http.client
from typing import TYPE_CHECKING

from examples.orders.fault_base import SETTLED, Fault, FaultResult, short
from examples.orders.faults_broker import BrokerRestart, MasterFailover
from examples.orders.models import ORDER_CREATED, OrderCreated
from examples.orders.web import request
from txmq import Message
from txmq.sync import Producer

if TYPE_CHECKING:
    from examples.orders.demo import Demo

__all__ = ["CLUSTER_ONLY", "FAULTS", "Fault", "FaultResult"]


class OrderCrash(Fault):
    def __init__(self, point: str) -> None:
        self.point = point
        self.name = f"order-crash-{point.removesuffix('-db-commit')}-commit"
        when = "before" if point.startswith("before") else "after"
        self.what = f"order service SIGKILLed {when} its database commit " + (
            "(half message sent)" if when == "before" else "(broker not yet told COMMIT)"
        )

    def inject(self, demo: Demo) -> FaultResult:
        assert demo.orders is not None
        status, body = request(demo.orders_url, "POST", "/faults", {"crash": self.point})
        if status != 200:
            raise RuntimeError(f"arming {self.point}: {status} {body}")
        status, _ = demo.place("apple", 1)
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


class InventoryCrash(Fault):
    name = "inventory-crash"
    what = "inventory service SIGKILLed inside its handler (writes done, not committed)"

    def inject(self, demo: Demo) -> FaultResult:
        assert demo.inventory is not None
        try:
            status, body = request(demo.inventory_url, "POST", "/faults", {"crash": "in-handler"})
        except (OSError, http.client.HTTPException):
            # A message already on its way (a redelivery from an earlier fault) can reach the
            # armed point before the answer is written: the crash cut the answer off. The
            # FAULT line below names the order it died on either way.
            status, body = 200, None
        if status != 200:
            raise RuntimeError(f"arming in-handler: {status} {body}")
        demo.place("kiwi", 1)
        line = demo.inventory.wait_line("FAULT in-handler ")
        demo.inventory.wait_exit()
        demo.start_inventory()
        return self._result(order_id=line.split()[2])

    def verify(self, demo: Demo, result: FaultResult) -> None:
        order_id = result.data["order_id"]
        state = demo.order_states([order_id]).get(order_id)
        result.verified = state in SETTLED
        result.detail = (
            f"killed while reserving for order {short(order_id)}; after the restart the "
            f"message came again and was applied once: {state}"
        )


class Duplicates(Fault):
    name = "duplicates"
    what = "OrderCreated messages delivered again (copies with the same keys)"

    def inject(self, demo: Demo) -> FaultResult:
        before = demo.stats(demo.inventory_url).get("duplicates_skipped", 0)
        copies = demo.accepted[-demo.config.duplicates :]
        with Producer(group="demo-duplicator", **demo.client_args) as producer:
            for o in copies:
                event = OrderCreated(o["id"], o["product"], o["quantity"])
                msg = Message(
                    ORDER_CREATED,
                    event.encode(),
                    tags="OrderCreated",
                    keys=[f"order-{o['id']}-created"],
                )
                producer.send(msg, sharding_key=o["id"])
        return self._result(before=before, sent=len(copies))

    def _skipped(self, demo: Demo, result: FaultResult) -> int:
        now: int = demo.stats(demo.inventory_url).get("duplicates_skipped", 0)
        return now - int(result.data["before"])

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        return self._skipped(demo, result) >= int(result.data["sent"])

    def verify(self, demo: Demo, result: FaultResult) -> None:
        skipped = self._skipped(demo, result)
        result.verified = skipped >= result.data["sent"] > 0
        result.detail = (
            f"{result.data['sent']} copies sent; {skipped} skipped by the idempotent consumer, "
            "none applied twice"
        )


class Poison(Fault):
    name = "poison"
    what = "a malformed OrderCreated that fails every time"
    key = "poison-1"

    def inject(self, demo: Demo) -> FaultResult:
        with Producer(group="demo-poisoner", **demo.client_args) as producer:
            msg = Message(ORDER_CREATED, b"{not json", tags="OrderCreated", keys=[self.key])
            producer.send(msg, sharding_key=self.key)
        return self._result()

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        return self.key in demo.dlq()

    def verify(self, demo: Demo, result: FaultResult) -> None:
        from examples.orders.demo import INVENTORY_MAX_RECONSUME

        result.verified = self.key in demo.dlq()
        result.detail = (
            f"retried in order on its queue ({INVENTORY_MAX_RECONSUME} times), then moved to "
            "%DLQ%inventory-service; every other order kept flowing"
        )


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        OrderCrash("before-db-commit"),
        OrderCrash("after-db-commit"),
        BrokerRestart(),
        MasterFailover(),
        InventoryCrash(),
        Duplicates(),
        Poison(),
    )
}
"""Every fault by name, in the order the demo injects them."""

CLUSTER_ONLY = frozenset({MasterFailover.name})
"""Faults that need a cluster: ``--single-broker`` leaves them out."""
