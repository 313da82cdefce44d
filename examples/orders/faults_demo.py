"""The demo's faults: how each is injected, when the system has settled after it, and how
its particular outcome is verified (beyond the books, which every run checks)."""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from examples.orders.models import CANCELLED, CONFIRMED, ORDER_CREATED, OrderCreated
from examples.orders.web import request
from txmq import Message
from txmq.sync import Producer

if TYPE_CHECKING:
    from examples.orders.demo import Demo

__all__ = ["FAULTS", "Fault", "FaultResult"]

SETTLED = (CONFIRMED, CANCELLED)
HOLD = "before-broker-commit"


@dataclass
class FaultResult:
    name: str
    what: str
    verified: bool = False
    detail: str = "not verified"
    data: dict[str, Any] = field(default_factory=dict)


class Fault:
    name = ""
    what = ""

    def describe(self, demo: Demo) -> str:
        """What this fault does, in the layout that runs."""
        return self.what

    def inject(self, demo: Demo) -> FaultResult:
        raise NotImplementedError

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        """Whether this fault's own aftermath is over (the demo waits for it, bounded)."""
        return True

    def verify(self, demo: Demo, result: FaultResult) -> None:
        raise NotImplementedError

    def _result(self, **data: Any) -> FaultResult:
        return FaultResult(self.name, self.what, data=data)


def _short(order_id: str) -> str:
    return order_id[:8] + "…"


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
                f"order {_short(order_id)} never existed; the broker checked back, the "
                f"transaction log had no commit, the answer was ROLLBACK ({checked} "
                "transaction(s) rolled back by check-back)"
            )
        else:
            result.verified = state in SETTLED
            result.detail = (
                f"order {_short(order_id)} was committed, the broker never heard COMMIT; "
                f"its check-back found the commit in the log and delivered it: {state}"
            )


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass(frozen=True)
class _Placed:
    began: float
    ended: float
    status: int
    broker: str


class _Flow:
    """Orders placed without a break by the demo's clients (each pausing ``pause`` s
    between orders) until stopped: the traffic a broker set dies under."""

    def __init__(self, demo: Demo, pause: float = 0.02) -> None:
        self.demo = demo
        self.pause = pause
        self.placed: list[_Placed] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        products = sorted(demo.config.stock)
        self._threads = [
            threading.Thread(target=self._client, args=(products[i:] + products[:i],))
            for i in range(demo.config.clients)
        ]

    def _client(self, products: list[str]) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                status, data = self.demo.place(products[n % len(products)], 1)
                n += 1
                broker = str(data.get("broker", "")) if status == 201 else ""
                with self._lock:
                    self.placed.append(_Placed(began, time.monotonic(), status, broker))
                time.sleep(self.pause)
        except BaseException as exc:  # surfaces in stop()
            self.errors.append(exc)

    def since(self, t: float) -> int:
        with self._lock:
            return sum(1 for p in self.placed if p.began > t)

    def __enter__(self) -> _Flow:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        if self.errors and exc[0] is None:
            raise self.errors[0]


class BrokerRestart(Fault):
    name = "broker-restart"
    what = "broker SIGKILLed, orders placed while it is down, broker restarted"
    tries = 3
    # cluster: orders placed before the kill, while broker-b is down, after its restart
    before, during, after = 8, 24, 12

    def describe(self, demo: Demo) -> str:
        if demo.single:
            return self.what
        victim = list(demo.brokers)[-1]
        return f"{victim} SIGKILLed while orders flow, restarted on its store and port"

    def inject(self, demo: Demo) -> FaultResult:
        if not demo.single:
            return self._inject_cluster(demo)
        assert demo.broker is not None
        demo.broker.kill()
        statuses = [demo.place("pear", 1)[0] for _ in range(self.tries)]
        demo.start_broker()
        return self._result(statuses=statuses, accepted_before=len(demo.accepted))

    def _inject_cluster(self, demo: Demo) -> FaultResult:
        victim = list(demo.brokers.values())[-1]
        assert victim.proc is not None and demo.orders is not None
        lost_before = self._ends_lost(demo, victim.name)
        # an order on the victim is held between its database commit and its COMMIT, so
        # that the kill leaves at least one transaction for the victim's check-back
        hold = {"hold": HOLD, "when": victim.name}
        status, body = request(demo.orders_url, "POST", "/faults", hold)
        if status != 200:
            raise RuntimeError(f"holding {HOLD}: {status} {body}")
        with _Flow(demo) as flow:
            try:
                held = demo.orders.wait_line(f"HOLD {HOLD} ", timeout=30).split()[2]
                _wait(lambda: flow.since(0) >= self.before, 30)
                victim.proc.kill()
                killed = time.monotonic()
            finally:
                request(demo.orders_url, "POST", "/faults", {"release": HOLD})
            _wait(lambda: flow.since(killed) >= self.during, 30)
            restarting = time.monotonic()
            demo.start_broker(victim.name)  # orders keep flowing while it starts
            restarted = time.monotonic()
            _wait(lambda: flow.since(restarted) >= self.after, 30)
        # placed while it was surely down: after the kill, before its new process began
        down = [p for p in flow.placed if p.began > killed and p.ended < restarting]
        after = [p for p in flow.placed if p.began > restarted]
        result = self._result(
            victim=victim.name,
            down_s=restarting - killed,
            down=len(down),
            down_accepted=Counter(p.broker for p in down if p.status == 201),
            down_refused=sum(1 for p in down if p.status != 201),
            refused=sum(1 for p in flow.placed if p.status != 201),
            after_accepted=Counter(p.broker for p in after if p.status == 201),
            lost_before=lost_before,
            held=held,
        )
        result.what = self.describe(demo)
        return result

    @staticmethod
    def _ends_lost(demo: Demo, broker: str) -> int:
        """Transactions whose COMMIT the order service could not deliver to ``broker``."""
        return int(demo.stats(demo.orders_url).get(f"ends_lost_on_{broker}", 0))

    def verify(self, demo: Demo, result: FaultResult) -> None:
        if not demo.single:
            self._verify_cluster(demo, result)
            return
        statuses = result.data["statuses"]
        since = len(demo.accepted) - result.data["accepted_before"]
        result.verified = statuses == [503] * self.tries and since > 0
        result.detail = (
            f"{statuses.count(503)} of {self.tries} orders refused with 503 while it was down "
            f"(nothing half-done); restarted on its store, clients reconnected, {since} "
            "orders accepted since"
        )

    def _verify_cluster(self, demo: Demo, result: FaultResult) -> None:
        d = result.data
        victim = d["victim"]
        accepted: Counter[str] = d["down_accepted"]
        moved = sum(accepted.values())
        after: Counter[str] = d["after_accepted"]
        # the order service restarts in other faults: its counters start again at 0
        lost = max(0, self._ends_lost(demo, victim) - d["lost_before"])
        # the books (checked on every run) show the refused ones left nothing half-done,
        # and the demo settled only once no half message was pending on any broker set
        held = d["held"]
        state = demo.order_states([held]).get(held)
        result.verified = (
            moved > 0
            and victim not in accepted
            and sum(after.values()) > 0
            and lost >= 1
            and state in SETTLED
        )
        others = ", ".join(f"{n} on {b}" for b, n in sorted(accepted.items())) or "none"
        result.detail = (
            f"{d['down']} orders placed in the {d['down_s']:.1f} s it was down: {moved} "
            f"accepted ({others}), {d['down_refused']} refused with 503 (their send failed "
            f"on the dead set; nothing half-done); restarted on its store and port: "
            f"{sum(after.values())} accepted since ({after.get(victim, 0)} on {victim}); "
            f"{lost} transaction(s) whose COMMIT died with it (order {_short(held)} held "
            f"there on purpose) settled by its check-back: {state}"
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
            f"killed while reserving for order {_short(order_id)}; after the restart the "
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
        InventoryCrash(),
        Duplicates(),
        Poison(),
    )
}
