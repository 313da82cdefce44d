"""The demo's broker faults, in the cluster and on one broker alone: a broker set
SIGKILLed and restarted (``broker-restart``), and a replicated set's master SIGKILLed and
replaced by the controller (``master-failover``)."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from examples.orders.cluster import (
    ALONE,
    REPLICATED,
    registered_id,
    replica_state,
    wait_set_healthy,
)
from examples.orders.fault_base import (
    HOLD,
    SETTLED,
    Fault,
    FaultResult,
    Flow,
    short,
    wait_until,
)
from examples.orders.web import request
from txmq.client.route import NOT_AVAILABLE_S
from txmq.protocol.wire import MASTER_ID

if TYPE_CHECKING:
    from examples.orders.demo import Demo


def ends_lost(demo: Demo, broker: str) -> int:
    """Transactions whose COMMIT the order service could not deliver to broker set
    ``broker`` (the order service restarts in other faults: its counters start at 0)."""
    return int(demo.stats(demo.orders_url).get(f"ends_lost_on_{broker}", 0))


def checked_back(demo: Demo, order_id: str) -> int:
    """How often a broker checked the transaction of ``order_id`` back (its COMMIT went
    oneway: one sent to a broker as it died may vanish without an error)."""
    status, body = request(demo.orders_url, "GET", f"/orders/{order_id}")
    if status != 200:
        raise RuntimeError(f"GET /orders/{order_id}: {status} {body}")
    return int(body.get("checked_back", 0))


__all__ = ["BrokerRestart", "MasterFailover"]


class BrokerRestart(Fault):
    name = "broker-restart"
    what = "broker SIGKILLed, orders placed while it is down, broker restarted"
    tries = 3
    # cluster: orders placed before the kill, while broker-b is down, after its restart
    before, during, after = 8, 24, 12

    def describe(self, demo: Demo) -> str:
        if demo.single:
            return self.what
        return f"{ALONE} SIGKILLed while orders flow, restarted on its store and port"

    def inject(self, demo: Demo) -> FaultResult:
        if not demo.single:
            return self._inject_cluster(demo)
        assert demo.broker is not None
        demo.broker.kill()
        statuses = [demo.place("pear", 1)[0] for _ in range(self.tries)]
        demo.start_broker()
        return self._result(statuses=statuses, accepted_before=len(demo.accepted))

    def _inject_cluster(self, demo: Demo) -> FaultResult:
        victim = demo.nodes(ALONE)[0]  # (a broker set of one broker: named as its set)
        assert victim.proc is not None and demo.orders is not None
        lost_before = ends_lost(demo, victim.broker_set)
        # an order on the victim is held between its database commit and its COMMIT, so
        # that the kill leaves at least one transaction for the victim's check-back
        hold = {"hold": HOLD, "when": victim.broker_set}
        status, body = request(demo.orders_url, "POST", "/faults", hold)
        if status != 200:
            raise RuntimeError(f"holding {HOLD}: {status} {body}")
        with Flow(demo) as flow:
            try:
                held = demo.orders.wait_line(f"HOLD {HOLD} ", timeout=30).split()[2]
                wait_until(lambda: flow.since(0) >= self.before, 30)
                victim.proc.kill()
                killed = time.monotonic()
            finally:
                request(demo.orders_url, "POST", "/faults", {"release": HOLD})
            wait_until(lambda: flow.since(killed) >= self.during, 30)
            restarting = time.monotonic()
            demo.start_broker(victim.name)  # orders keep flowing while it starts
            restarted = time.monotonic()
            wait_until(lambda: flow.since(restarted) >= self.after, 30)
        # placed while it was surely down: after the kill, before its new process began
        down = [p for p in flow.placed if p.began > killed and p.ended < restarting]
        after = [p for p in flow.placed if p.began > restarted]
        result = self._result(
            victim=victim.broker_set,
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
        lost = max(0, ends_lost(demo, victim) - d["lost_before"])
        # the books (checked on every run) show the refused ones left nothing half-done,
        # and the demo settled only once no half message was pending on any broker set
        held = d["held"]
        state = demo.order_states([held]).get(held)
        checks = checked_back(demo, held)
        result.verified = (
            moved > 0
            and victim not in accepted
            and sum(after.values()) > 0
            and checks >= 1
            and state in SETTLED
        )
        others = ", ".join(f"{n} on {b}" for b, n in sorted(accepted.items())) or "none"
        result.detail = (
            f"{d['down']} orders placed in the {d['down_s']:.1f} s it was down: {moved} "
            f"accepted ({others}), {d['down_refused']} refused with 503 (their send failed "
            f"on the dead set; nothing half-done); restarted on its store and port: "
            f"{sum(after.values())} accepted since ({after.get(victim, 0)} on {victim}); "
            f"order {short(held)}, held there on purpose between its database commit and its "
            f"COMMIT, checked back {checks} time(s): {state} "
            f"({lost} COMMIT(s) refused by the dead connection)"
        )


class MasterFailover(Fault):
    """``broker-a``'s master SIGKILLed while orders flow (the cluster only).

    An order whose half message is on ``broker-a`` is held between its database commit and
    its COMMIT; the master is killed under it.  The controller elects the other replica in
    a new epoch; the killed node is restarted on its store and ports and rejoins as a slave
    (a SYNC_MASTER acknowledges only what a slave has too: the new master accepts orders
    once it is back); orders flow to ``broker-b`` meanwhile, then to ``broker-a`` again.
    The held order's COMMIT died with the old master: the new one checks it back.
    """

    name = "master-failover"
    what = (
        f"{REPLICATED}'s master SIGKILLed while orders flow: the controller elected the "
        "slave, the killed node rejoined as a slave"
    )
    # orders placed before the kill, and after the first one accepted on the new master
    before, after = 8, 12
    timeout = 60.0
    pause = 0.4  # between a client's orders (the failover may take a while)

    def describe(self, demo: Demo) -> str:
        s = replica_state(demo.namesrv, REPLICATED)
        master = demo.node(REPLICATED, s.master_id).name if s and s.master_id >= 0 else "?"
        return (
            f"{REPLICATED}'s master ({master}) SIGKILLed while orders flow; the controller "
            "elects the slave, the killed node restarts on its store and ports as a slave"
        )

    def inject(self, demo: Demo) -> FaultResult:
        nodes = demo.nodes(REPLICATED)
        first = wait_set_healthy(demo.namesrv, nodes, self.timeout)
        victim = demo.node(REPLICATED, first.master_id)
        assert victim.proc is not None and victim.broker_id is not None
        assert demo.orders is not None
        lost_before = ends_lost(demo, REPLICATED)
        seen = len(demo.orders.lines)  # (an earlier fault may have held an order too)
        hold = {"hold": HOLD, "when": REPLICATED}
        status, body = request(demo.orders_url, "POST", "/faults", hold)
        if status != 200:
            raise RuntimeError(f"holding {HOLD}: {status} {body}")

        def elected() -> bool:
            s = replica_state(demo.namesrv, REPLICATED)
            return (
                s is not None
                and not s.electing
                and s.epoch > first.epoch
                and s.master_id not in (-1, victim.broker_id)
            )

        def registered(address: str) -> int | None:
            return registered_id(demo.namesrv, REPLICATED, address)

        def on_new_master() -> list[float]:
            """When the orders accepted on broker-a since the kill were answered."""
            return [p.ended for p in flow.accepted_since(killed) if p.broker == REPLICATED]

        with Flow(demo, self.pause) as flow:
            try:
                line = demo.orders.wait_line(f"HOLD {HOLD} ", timeout=30, skip=seen)
                wait_until(lambda: flow.since(0) >= self.before, 30)
                victim.proc.kill()
                killed = time.monotonic()
            finally:
                request(demo.orders_url, "POST", "/faults", {"release": HOLD})
            if not wait_until(elected, self.timeout):
                raise RuntimeError(
                    f"no new master of {REPLICATED} {self.timeout:.0f} s after the kill"
                )
            elected_s = time.monotonic() - killed
            demo.start_broker(victim.name)  # on its store and ports; orders keep flowing
            whole = wait_set_healthy(demo.namesrv, nodes, self.timeout)
            rejoined_s = time.monotonic() - killed
            # registered with the name server as a slave (not under the master's id 0)
            wait_until(lambda: registered(victim.address) not in (None, MASTER_ID), 30)
            slot = registered(victim.address)
            # fault avoidance may leave the set out for a while after a slow or failed send
            # to the new master (30 s at most, txmq.client.route)
            back_within = self.timeout + max(NOT_AVAILABLE_S)
            if not wait_until(lambda: bool(on_new_master()), back_within):
                raise RuntimeError(
                    f"no order accepted on {REPLICATED} {back_within:.0f} s after its failover"
                    f" ({flow.summary(killed)}); the end of {demo.orders.log}:\n"
                    f"{demo.orders.log_tail(20)}"
                )
            back = min(on_new_master())
            wait_until(lambda: flow.since(back) >= self.after, 30)
        window = [p for p in flow.placed if p.began > killed and p.ended < back]
        # from the first order the new master acknowledged on (it counts: later ones may
        # go to broker-b while fault avoidance leaves broker-a out after that slow send)
        after = [p for p in flow.placed if p.ended >= back]
        result = self._result(
            victim=victim.name,
            victim_id=victim.broker_id,
            # the restarted node: alive, following the new master, in its sync state set
            as_slave=victim.broker_id in whole.in_sync
            and any(
                r.broker_id == victim.broker_id and r.alive and not r.master for r in whole.replicas
            ),
            slot=slot,
            epoch_before=first.epoch,
            epoch=whole.epoch,
            master=demo.node(REPLICATED, whole.master_id).name,
            master_id=whole.master_id,
            elected_s=elected_s,
            rejoined_s=rejoined_s,
            failover_s=back - killed,
            window=len(window),
            window_accepted=Counter(p.broker for p in window if p.status == 201),
            window_refused=sum(1 for p in window if p.status != 201),
            refused=sum(1 for p in flow.placed if p.status != 201),
            after_accepted=Counter(p.broker for p in after if p.status == 201),
            lost_before=lost_before,
            held=line.split()[2],
        )
        result.what = self.what
        return result

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        held = result.data["held"]
        return demo.order_states([held]).get(held) in SETTLED

    def verify(self, demo: Demo, result: FaultResult) -> None:
        """By what was seen during the failover (a later election, under load, would not
        undo it) and the held order's end."""
        d = result.data
        window: Counter[str] = d["window_accepted"]
        after: Counter[str] = d["after_accepted"]
        lost = max(0, ends_lost(demo, REPLICATED) - d["lost_before"])
        held = d["held"]
        state = demo.order_states([held]).get(held)
        checks = checked_back(demo, held)
        result.verified = (
            d["master_id"] != d["victim_id"]
            and d["epoch"] > d["epoch_before"]
            and d["as_slave"]
            and d["slot"] not in (None, MASTER_ID)
            and after.get(REPLICATED, 0) > 0
            and state in SETTLED
        )
        moved = ", ".join(f"{n} on {b}" for b, n in sorted(window.items())) or "none"
        if checks:
            commit = f"its COMMIT died with the old master; checked back {checks} time(s)"
        elif lost:
            commit = "its COMMIT died with the old master"
        else:
            commit = "its COMMIT reached the new master"
        result.detail = (
            f"{d['victim']} killed (epoch {d['epoch_before']}); {d['master']} elected in "
            f"{d['elected_s']:.1f} s: epoch {d['epoch']}; {d['victim']} restarted on its "
            f"store, a slave in sync at {d['rejoined_s']:.1f} s (registered as id {d['slot']}); "
            f"failover time {d['failover_s']:.1f} s (kill -> first order accepted on "
            f"{d['master']}); meanwhile {d['window']} orders: {sum(window.values())} "
            f"accepted ({moved}), {d['window_refused']} refused with 503; since: "
            f"{sum(after.values())} accepted ({after.get(REPLICATED, 0)} on {REPLICATED}); "
            f"order {short(held)} held on {REPLICATED} across the kill: {commit}: {state}"
        )
