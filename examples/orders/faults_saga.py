"""The demo's saga faults: the coordinator SIGKILLed between two steps, each participant
SIGKILLed inside its action and inside its compensation, a step's deadline passed while the
payment service is paused, commands delivered twice, and a compensation delivered before
its action."""

from __future__ import annotations

import http.client
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa

from examples.orders.fault_base import SETTLED, Fault, FaultResult, short, wait_until
from examples.orders.models import (
    CANCELLED,
    CHARGED,
    FAULT_CUSTOMER,
    FAULT_PRODUCT,
    REFUNDED,
    RELEASED,
    RESERVED,
    Charge,
    Order,
    OrderData,
    Reservation,
    place_order,
    price_of,
)
from examples.orders.order_service import SERVICE as ORDERS
from examples.orders.web import request
from txmq import Message
from txmq.saga import command_topic, reply_topic
from txmq.saga.model import ACTION, COMPENSATION, Command, Saga, encode
from txmq.sqla.db import with_connection
from txmq.sqla.tables import saga_barrier, saga_steps, sagas
from txmq.sync import AdminClient, Producer

if TYPE_CHECKING:
    from examples.orders.demo import Demo

__all__ = [
    "CoordinatorCrash",
    "Deadline",
    "Duplicates",
    "ParticipantCrash",
    "Reordered",
]


def _arm(url: str, point: str, when: str | None = None) -> None:
    """Arm a crash point of a service.  A command already on its way (a redelivery from an
    earlier fault) can reach the point before the answer is written: the crash then cuts
    the answer off, and the FAULT line the caller waits for names what it died on."""
    try:
        armed = {"crash": point} if when is None else {"crash": point, "when": when}
        status, body = request(url, "POST", "/faults", armed)
    except (OSError, http.client.HTTPException):
        return
    if status != 200:
        raise RuntimeError(f"arming {point}: {status} {body}")


def _saga_state(demo: Demo, saga_id: str) -> str | None:
    q = sa.select(sagas.c.state).where(sagas.c.saga_id == saga_id)
    return with_connection(demo.orders_db, lambda conn: conn.execute(q).scalar())


def _barrier(demo: Demo, db: str, saga_id: str, branch: str) -> dict[str, str]:
    """The barrier rows of a saga's branch in a participant's database: op → reason."""
    t = saga_barrier
    q = sa.select(t.c.op, t.c.reason).where(t.c.saga_id == saga_id, t.c.branch == branch)
    return with_connection(db, lambda conn: {op: why for op, why in conn.execute(q)})


def _gave_up(demo: Demo, saga_id: str, branch: str) -> bool:
    """Whether the saga gave up on a branch at its deadline (its step log says so)."""
    t = saga_steps
    q = sa.select(sa.func.count()).where(
        t.c.saga_id == saga_id, t.c.branch == branch, t.c.event == "timeout"
    )
    return bool(with_connection(demo.orders_db, lambda conn: conn.execute(q).scalar_one()))


def _order_reason(demo: Demo, order_id: str) -> str:
    q = sa.select(Order.reason).where(Order.id == order_id)
    return with_connection(demo.orders_db, lambda conn: conn.execute(q).scalar() or "")


class CoordinatorCrash(Fault):
    name = "coordinator-crash"
    what = (
        "order service SIGKILLed between two steps of a saga (the next step committed in its "
        "database, its command not sent)"
    )

    def inject(self, demo: Demo) -> FaultResult:
        assert demo.orders is not None
        # the fault's own saga, once the charge answered: the command of its last step, the
        # order review (two round trips after the order was placed: its request was answered
        # long before)
        order_id = uuid.uuid4().hex
        _arm(demo.orders_url, "between-steps", f"{order_id}/2")
        demo.place(FAULT_PRODUCT, 1, FAULT_CUSTOMER, order_id)
        line = demo.orders.wait_line("FAULT between-steps ")
        demo.orders.wait_exit()
        demo.start_orders()
        return self._result(saga_id=line.split()[2])

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        return _saga_state(demo, result.data["saga_id"]) in ("COMPLETED", "COMPENSATED")

    def verify(self, demo: Demo, result: FaultResult) -> None:
        saga_id = result.data["saga_id"]
        saga, order = _saga_state(demo, saga_id), demo.order_states([saga_id]).get(saga_id)
        result.verified = saga in ("COMPLETED", "COMPENSATED") and order in SETTLED
        result.detail = (
            f"saga {short(saga_id)}: its coordinator died after committing its next step, "
            f"before sending its command; the answer came again, found its decision taken, "
            f"and the command was sent again; the saga went on: {saga}, order {order}"
        )


class ParticipantCrash(Fault):
    """A participant SIGKILLed inside its action or its compensation (after its writes,
    before their commit).  ``customer``: whose order takes the saga there (a rich one: the
    charge; a broke one: declined, so the stock is released; a blocked one: refused at the
    review, so the charge is refunded)."""

    #: what each point's effect leaves once applied: the row's model and state
    EFFECTS: ClassVar[dict[str, tuple[Any, str]]] = {
        "in-reserve": (Reservation, RESERVED),
        "in-release": (Reservation, RELEASED),
        "in-charge": (Charge, CHARGED),
        "in-refund": (Charge, REFUNDED),
    }

    def __init__(self, service: str, point: str, customer: str, outcome: str) -> None:
        self.service, self.point, self.customer, self.outcome = service, point, customer, outcome
        kind = "compensation" if point in ("in-release", "in-refund") else "action"
        self.name = f"{service}-crash-{kind}"
        step = point.removeprefix("in-")
        self.what = (
            f"{service} service SIGKILLed inside its {kind} ({step}; writes done, not committed)"
        )

    def _proc_url(self, demo: Demo) -> tuple[Any, str]:
        if self.service == "inventory":
            return demo.inventory, demo.inventory_url
        return demo.payment, demo.payment_url

    def inject(self, demo: Demo) -> FaultResult:
        proc, url = self._proc_url(demo)
        assert proc is not None
        # the sagas of the load ended first, so that the point is reached by this order's
        idle = wait_until(lambda: demo.running() == 0, 60)
        _arm(url, self.point)
        demo.place(FAULT_PRODUCT, 1, self.customer)
        line = proc.wait_line(f"FAULT {self.point} ")
        proc.wait_exit()
        (demo.start_inventory if self.service == "inventory" else demo.start_payment)()
        return self._result(order_id=line.split()[2], idle=idle)

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        order_id = result.data["order_id"]
        return demo.order_states([order_id]).get(order_id) in SETTLED

    def verify(self, demo: Demo, result: FaultResult) -> None:
        order_id = result.data["order_id"]
        state = demo.order_states([order_id]).get(order_id)
        model, effect = self.EFFECTS[self.point]
        db = demo.inventory_db if self.service == "inventory" else demo.payment_db
        row = with_connection(
            db,
            lambda conn: conn.execute(
                sa.select(model.state).where(model.order_id == order_id)
            ).scalar(),
        )
        # the order the crash hit (the load was idle: the fault's own, unless a redelivery
        # from an earlier fault came first) settled, and the killed write was made after all
        expected = self.outcome if result.data["idle"] else state
        what = model.__name__.lower()
        if self.point == "in-charge" and _gave_up(demo, order_id, "charge"):
            # the charge's deadline passed while the service restarted: the saga gave up on
            # it and compensated it (refunded, or the refund came first and the redelivered
            # charge did nothing) — the books say the same
            result.verified = state == CANCELLED and row in (REFUNDED, None)
            result.detail = (
                f"killed in charge for order {short(order_id)}; its deadline passed before the "
                f"restarted service answered: the saga compensated it ({what} {row}): {state}"
            )
            return
        result.verified = state in SETTLED and state == expected and row == effect
        result.detail = (
            f"killed in {self.point.removeprefix('in-')} for order {short(order_id)}; after "
            f"the restart the command came again and was applied once ({what} {row}): {state}"
        )


class Deadline(Fault):
    name = "deadline"
    what = "payment service paused (SIGSTOP) past the charge's deadline, then resumed"

    def inject(self, demo: Demo) -> FaultResult:
        assert demo.payment is not None
        demo.payment.pause()
        try:
            status, placed = demo.place(FAULT_PRODUCT, 1)
            if status != 201:
                raise RuntimeError(f"placing the order: {status} {placed}")
            order_id = placed["id"]
            began = time.monotonic()
            # it gives up on the charge and compensates: the charge first (reverse order),
            # which waits for the paused service
            gave_up = wait_until(
                lambda: _saga_state(demo, order_id) == "COMPENSATING",
                demo.config.charge_deadline + 30,
            )
            waited = time.monotonic() - began
        finally:
            demo.payment.resume()
        return self._result(order_id=order_id, gave_up=gave_up, waited=waited)

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        # the payment service took both the late charge and its compensation
        done = _barrier(demo, demo.payment_db, result.data["order_id"], "charge")
        return ACTION in done and COMPENSATION in done

    def verify(self, demo: Demo, result: FaultResult) -> None:
        order_id = result.data["order_id"]
        state = demo.order_states([order_id]).get(order_id)
        reason = _order_reason(demo, order_id)
        charge = with_connection(
            demo.payment_db,
            lambda conn: conn.execute(
                sa.select(Charge.state).where(Charge.order_id == order_id)
            ).scalar(),
        )
        late = {
            None: "the refund came first (a null compensation) and the late charge did nothing",
            REFUNDED: "the late charge was taken, then refunded",
        }
        result.verified = (
            result.data["gave_up"] and state == CANCELLED and "no answer within" in reason
        ) and charge in late
        result.detail = (
            f"order {short(order_id)}: no answer to its charge within the deadline; the saga "
            f"gave up on it after {result.data['waited']:.1f} s and compensated it, then the "
            f"stock ({state}: {reason}); resumed, "
            f"{late.get(charge, f'the charge is {charge}')}"
        )


def _commands(demo: Demo, saga_ids: list[str]) -> list[Command]:
    """The action commands the coordinator sent for ``saga_ids`` (each step's last), rebuilt
    from its step log and the saga's stored definition and data."""

    def read(conn: sa.Connection) -> list[Command]:
        rows = {
            r.saga_id: r
            for r in conn.execute(sa.select(sagas).where(sagas.c.saga_id.in_(saga_ids)))
        }
        q = (
            sa.select(saga_steps)
            .where(
                saga_steps.c.saga_id.in_(saga_ids),
                saga_steps.c.op == ACTION,
                saga_steps.c.event == "sent",
            )
            .order_by(saga_steps.c.id)
        )
        sent = {(s.saga_id, s.step): s for s in conn.execute(q)}
        out = []
        for (saga_id, step), s in sent.items():
            row = rows[saga_id]
            definition = Saga.from_dict(row.definition)
            st = definition.steps[step]
            out.append(
                Command(
                    saga_id=saga_id,
                    saga=row.name,
                    step=step,
                    service=st.service,
                    branch=st.action,
                    op=ACTION,
                    handler=st.action,
                    command_id=s.command_id,
                    sent_ms=int(s.at.timestamp() * 1000),
                    data=dict(row.data),
                    reply_to=reply_topic(row.coordinator),
                    retries=st.retries,
                )
            )
        return out

    commands: list[Command] = with_connection(demo.orders_db, read)
    return commands


class Duplicates(Fault):
    name = "duplicates"
    what = "saga commands delivered again (copies of commands already carried out)"

    def inject(self, demo: Demo) -> FaultResult:
        ids = [o["id"] for o in demo.accepted[-demo.config.duplicates :]]
        # every saga ended first: what the participants do from here on is the copies'
        idle = wait_until(lambda: demo.running() == 0, 60)
        commands = [c for c in _commands(demo, ids) if c.service != ORDERS]
        before = self._effects(demo)
        last: dict[str, str] = {}
        with Producer(group="demo-duplicator", **demo.client_args) as producer:
            for cmd in commands:
                key = f"{cmd.saga_id}/{cmd.step}/{cmd.op}"
                msg = Message(command_topic(cmd.service), encode(cmd), tags=ACTION, keys=[key])
                last[cmd.service] = producer.send(msg, sharding_key=cmd.saga_id).msg_id
        with AdminClient(**demo.client_args) as admin:
            for service, msg_id in last.items():
                admin.wait_consumed(msg_id, f"saga-{service}", timeout=60)
        after = self._effects(demo)
        return self._result(sent=len(commands), before=before, after=after, idle=idle)

    @staticmethod
    def _effects(demo: Demo) -> dict[str, int]:
        """The reservations and charges made by the participants' processes so far."""
        return {
            "inventory": demo.stats(demo.inventory_url).get("reserved", 0),
            "payment": demo.stats(demo.payment_url).get("charged", 0),
        }

    def verify(self, demo: Demo, result: FaultResult) -> None:
        after, sent = result.data["after"], result.data["sent"]
        result.verified = result.data["idle"] and sent > 0 and after == result.data["before"]
        result.detail = (
            f"{sent} copies of reserve-stock and charge commands delivered and consumed; the "
            f"barrier let none take a second effect (reservations and charges made meanwhile: "
            f"{after['inventory'] - result.data['before']['inventory']} and "
            f"{after['payment'] - result.data['before']['payment']})"
        )


class Reordered(Fault):
    name = "reordered"
    what = "an order's compensation (release its stock) delivered before its action"

    def inject(self, demo: Demo) -> FaultResult:
        order_id = uuid.uuid4().hex
        data = OrderData(order_id, FAULT_PRODUCT, 1, FAULT_CUSTOMER, price_of(FAULT_PRODUCT, 1))
        step = place_order().steps[0]
        early = Command(
            saga_id=order_id,
            saga="place-order",
            step=0,
            service=step.service,
            branch=step.action,
            op=COMPENSATION,
            handler=str(step.compensation),
            command_id=uuid.uuid4().hex,  # not one the coordinator will wait for
            sent_ms=int(time.time() * 1000),
            data=data.as_dict(),
            reply_to=reply_topic(ORDERS),
            retries=0,
        )
        with Producer(group="demo-reorderer", **demo.client_args) as producer:
            msg = Message(command_topic(step.service), encode(early), tags=COMPENSATION)
            producer.send(msg, sharding_key=order_id)
        came = wait_until(
            lambda: COMPENSATION in _barrier(demo, demo.inventory_db, order_id, step.action),
            60,
        )
        status, _ = demo.place(FAULT_PRODUCT, 1, FAULT_CUSTOMER, order_id)
        return self._result(order_id=order_id, came=came, status=status)

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        order_id = result.data["order_id"]
        return demo.order_states([order_id]).get(order_id) in SETTLED

    def verify(self, demo: Demo, result: FaultResult) -> None:
        order_id = result.data["order_id"]
        state = demo.order_states([order_id]).get(order_id)
        reason = _order_reason(demo, order_id)
        held = with_connection(
            demo.inventory_db,
            lambda conn: conn.execute(
                sa.select(sa.func.count())
                .select_from(Reservation)
                .where(Reservation.order_id == order_id)
            ).scalar_one(),
        )
        result.verified = (
            result.data["came"]
            and result.data["status"] == 201
            and state == CANCELLED
            and "suspended" in reason
            and held == 0
        )
        result.detail = (
            f"order {short(order_id)}: its release came first (a null compensation); its "
            f"reservation, when it came, was suspended by the barrier and answered no: "
            f"{state} ({reason}); stock reserved for it: {held}"
        )
