"""Sagas across three services (orders coordinates; inventory and payment take part), each
with its own database and producer, over an in-process broker: success, a refusal at each
step, transient failures then success, retries exhausted, a compensation that fails until
an operator steps in, repeated commands — on PostgreSQL and SQLite, async and sync."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import txmq
import txmq.sync
from tests.observe_support import registry as registry  # a fixture
from tests.saga_service import accounts, app, orders, stock
from tests.sqla_support import pg_schema
from txmq import Message
from txmq.cli.main import main
from txmq.saga import (
    Coordinator,
    Ended,
    Participant,
    Refuse,
    Saga,
    State,
    Step,
    command_topic,
    tcc,
)
from txmq.saga.model import ACTION, COMPENSATION, Command, encode, reply_topic
from txmq.sqla import SqlTransactionChecker
from txmq.sqla.tables import metadata as txmq_metadata
from txmq.sqla.tables import saga_barrier, saga_steps, sagas
from txmq.testing import InProcessBroker

pytestmark = pytest.mark.anyio

# the services' tables: the same as the process tests' services

CHECKOUT = Saga(
    "checkout",
    [
        Step("reserve-stock", service="inventory", compensation="release-stock"),
        Step("charge", service="payment", compensation="refund", compensation_retries=1),
        Step("confirm-order", service="orders"),
    ],
)
SERVICES = ("orders", "inventory", "payment")
#: the charge given up on after a minute without an answer
SLOW = Saga(
    "slow-checkout",
    [
        Step("reserve-stock", service="inventory", compensation="release-stock"),
        Step("charge", service="payment", compensation="refund", timeout=60),
    ],
)
#: TCC: (service, try, confirm, cancel) per branch
HOLD = tcc(
    "hold",
    [
        ("inventory", "hold-stock", "ship-stock", "unhold-stock"),
        ("payment", "hold-funds", "capture", "unhold-funds"),
    ],
    confirm_retries=1,
)


@pytest.fixture
def broker(in_process_broker: Callable[..., InProcessBroker]) -> InProcessBroker:
    return in_process_broker()


@contextmanager
def _urls(backend: str, tmp_path: Path) -> Iterator[dict[str, tuple[str, str]]]:
    """A database per service: (sync url, async url)."""
    if backend == "sqlite":
        paths = {s: tmp_path / f"{s}.db" for s in SERVICES}
        yield {s: (f"sqlite:///{p}", f"sqlite+aiosqlite:///{p}") for s, p in paths.items()}
        return
    with ExitStack() as stack:
        urls = {s: stack.enter_context(pg_schema()) for s in SERVICES}
        yield {s: (u, u) for s, u in urls.items()}


@dataclass
class Faults:
    """What the services' handlers are told to do wrong (set by a test)."""

    charge_fails: int = 0  # the next n charges raise
    refund_fails: int = 0  # the next n refunds raise
    capture_fails: int = 0  # the next n captures (TCC confirms) raise
    seen: list[str] = field(default_factory=list)
    #: what the coordinator's on_end was told: (saga id, state, error)
    ended: list[tuple[str, str, str | None]] = field(default_factory=list)


def _seed(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        txmq_metadata.create_all(conn)
        app.create_all(conn)
        conn.execute(stock.insert(), [{"product": "apple", "available": 10, "reserved": 0}])
        conn.execute(accounts.insert(), [{"customer": "ann", "balance": 100, "held": 0}])
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, tuple[str, str]]]:
    with _urls(request.param, tmp_path) as u:
        for url, _ in u.values():
            _seed(url)
        yield u


def _async_handlers(inv: Participant, pay: Participant, orders_p: Participant, f: Faults) -> None:
    @inv.action("reserve-stock")
    async def reserve(data: dict[str, Any], session: AsyncSession) -> dict[str, Any]:
        f.seen.append("reserve")
        q = data["quantity"]
        row = (
            await session.execute(sa.select(stock).where(stock.c.product == data["product"]))
        ).one()
        if row.available < q:
            raise Refuse(f"only {row.available} {data['product']} left")
        await session.execute(
            stock.update()
            .where(stock.c.product == data["product"])
            .values(available=stock.c.available - q, reserved=stock.c.reserved + q)
        )
        return {"reserved": q}

    @inv.compensation("release-stock")
    async def release(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("release")
        q = data["reserved"]
        await session.execute(
            stock.update()
            .where(stock.c.product == data["product"])
            .values(available=stock.c.available + q, reserved=stock.c.reserved - q)
        )

    @pay.action("charge")
    async def charge(data: dict[str, Any], session: AsyncSession) -> dict[str, Any]:
        f.seen.append("charge")
        if f.charge_fails > 0:
            f.charge_fails -= 1
            raise ConnectionError("the card network is down")
        row = (
            await session.execute(
                sa.select(accounts).where(accounts.c.customer == data["customer"])
            )
        ).one()
        if row.balance < data["amount"]:
            return Refuse("card declined")  # type: ignore[return-value]  (returned, not raised)
        await session.execute(
            accounts.update()
            .where(accounts.c.customer == data["customer"])
            .values(balance=accounts.c.balance - data["amount"])
        )
        return {"charged": data["amount"]}

    @pay.compensation("refund")
    async def refund(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("refund")
        if f.refund_fails > 0:
            f.refund_fails -= 1
            raise ConnectionError("the bank is down")
        await session.execute(
            accounts.update()
            .where(accounts.c.customer == data["customer"])
            .values(balance=accounts.c.balance + data["amount"])
        )

    @orders_p.action("confirm-order")
    async def confirm(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("confirm")
        if data.get("confirm_refused"):
            raise Refuse("the order was cancelled meanwhile")
        await session.execute(
            orders.update().where(orders.c.id == data["order"]).values(state="CONFIRMED")
        )


def _tcc_handlers(inv: Participant, pay: Participant, f: Faults) -> None:
    async def move(session: AsyncSession, q: int, held: int) -> None:
        await session.execute(
            stock.update().values(available=stock.c.available - q, reserved=stock.c.reserved + held)
        )

    @inv.try_("hold-stock")
    async def hold_stock(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("hold-stock")
        await move(session, data["quantity"], data["quantity"])

    @inv.confirm("ship-stock")
    async def ship_stock(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("ship-stock")
        await move(session, 0, -data["quantity"])

    @inv.cancel("unhold-stock")
    async def unhold_stock(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("unhold-stock")
        await move(session, -data["quantity"], -data["quantity"])

    @pay.try_("hold-funds")
    async def hold_funds(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("hold-funds")
        balance = (await session.execute(sa.select(accounts.c.balance))).scalar_one()
        if balance < data["amount"]:
            raise Refuse("insufficient funds")
        await session.execute(accounts.update().values(balance=accounts.c.balance - data["amount"]))

    @pay.confirm("capture")
    async def capture(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("capture")
        if f.capture_fails > 0:
            f.capture_fails -= 1
            raise ConnectionError("the acquirer is down")

    @pay.cancel("unhold-funds")
    async def unhold_funds(data: dict[str, Any], session: AsyncSession) -> None:
        f.seen.append("unhold-funds")
        await session.execute(accounts.update().values(balance=accounts.c.balance + data["amount"]))


@dataclass
class World:
    coordinator: Coordinator
    engines: dict[str, sa.Engine]
    faults: Faults
    broker: InProcessBroker

    def saga(self, saga_id: str) -> Any:
        with self.engines["orders"].connect() as conn:
            return conn.execute(sa.select(sagas).where(sagas.c.saga_id == saga_id)).one()

    def steps(self, saga_id: str) -> list[tuple[str, str, str]]:
        with self.engines["orders"].connect() as conn:
            q = (
                sa.select(saga_steps)
                .where(saga_steps.c.saga_id == saga_id)
                .order_by(saga_steps.c.id)
            )
            return [(r.branch, r.op, r.event) for r in conn.execute(q)]

    def stock(self) -> tuple[int, int]:
        with self.engines["inventory"].connect() as conn:
            row = conn.execute(sa.select(stock)).one()
            return row.available, row.reserved

    def balance(self) -> int:
        with self.engines["payment"].connect() as conn:
            return int(conn.execute(sa.select(accounts.c.balance)).scalar_one())

    def order(self, order_id: str) -> str | None:
        with self.engines["orders"].connect() as conn:
            return conn.execute(sa.select(orders.c.state).where(orders.c.id == order_id)).scalar()

    async def until(
        self, saga_id: str, *states: str, timeout: float = 30, advance: bool = True
    ) -> Any:
        """Poll (with a deadline) until the saga is in one of ``states``; the broker's clock
        is moved on meanwhile (``advance``), so that retries on delay levels come due at
        once."""
        with anyio.fail_after(timeout):
            while (row := self.saga(saga_id)).state not in states:
                if advance:
                    self.broker.advance(3600)
                await anyio.sleep(0.05)
        return row


@pytest.fixture
async def world(broker: InProcessBroker, urls: dict[str, tuple[str, str]]) -> AsyncIterator[World]:
    faults = Faults()
    async with AsyncExitStack() as stack:
        engines = {s: sa.create_engine(u) for s, (u, _) in urls.items()}
        aengines = {s: create_async_engine(a) for s, (_, a) in urls.items()}
        for e in engines.values():
            stack.callback(e.dispose)
        for ae in aengines.values():
            stack.push_async_callback(ae.dispose)
        sessions = {s: async_sessionmaker(e, expire_on_commit=False) for s, e in aengines.items()}
        producers = {
            s: txmq.TransactionProducer(
                group=f"{s}-tx", listener=SqlTransactionChecker(aengines[s])
            )
            for s in SERVICES
        }
        for p in producers.values():
            await stack.enter_async_context(p)

        async def on_end(ended: Ended, session: AsyncSession) -> None:
            faults.ended.append((ended.saga_id, ended.state, ended.error))
            if ended.state == State.COMPENSATED and "order" in ended.data:
                cancel = orders.update().where(orders.c.id == ended.data["order"])
                await session.execute(cancel.values(state="CANCELLED"))

        coordinator = Coordinator(
            "orders",
            producers["orders"],
            sessions["orders"],
            [CHECKOUT, HOLD, SLOW],
            on_end=on_end,
        )
        parts = {s: Participant(s, producers[s], sessions[s]) for s in SERVICES}
        _async_handlers(parts["inventory"], parts["payment"], parts["orders"], faults)
        _tcc_handlers(parts["inventory"], parts["payment"], faults)
        for runner in [coordinator, *parts.values()]:
            consumer = txmq.PushConsumer(**runner.consumer_options())
            consumer.subscribe(runner.topic)
            await stack.enter_async_context(consumer)
        yield World(coordinator, engines, faults, broker)


async def _checkout(
    w: World, order_id: str, *, quantity: int = 2, amount: int = 30, **extra: Any
) -> str:
    data = {
        "order": order_id,
        "product": "apple",
        "quantity": quantity,
        "customer": "ann",
        "amount": amount,
        **extra,
    }
    async with w.coordinator.sessions() as session:
        async with w.coordinator.start(session, CHECKOUT, data) as saga:
            await session.execute(orders.insert().values(id=order_id, state="PENDING"))
    return saga.saga_id


#: the step log of a checkout that completed
EVERY_STEP_DONE = [
    (branch, "action", event)
    for branch in ("reserve-stock", "charge", "confirm-order")
    for event in ("sent", "done")
]


async def test_a_saga_runs_every_step_and_completes(world: World) -> None:
    saga_id = await _checkout(world, "o-1")
    row = await world.until(saga_id, State.COMPLETED)
    assert row.data["reserved"] == 2 and row.data["charged"] == 30 and row.effected == [0, 1, 2]
    assert world.stock() == (8, 2) and world.balance() == 70 and world.order("o-1") == "CONFIRMED"
    assert world.faults.ended == [(saga_id, State.COMPLETED, None)]
    assert world.steps(saga_id) == EVERY_STEP_DONE


async def test_a_start_that_raises_leaves_no_saga_and_sends_nothing(world: World) -> None:
    with pytest.raises(RuntimeError, match="changed my mind"):
        async with world.coordinator.sessions() as session:
            async with world.coordinator.start(session, CHECKOUT, {"order": "o-x"}) as saga:
                raise RuntimeError("changed my mind")
    with world.engines["orders"].connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sagas)).scalar_one() == 0
    assert world.broker.messages(command_topic("inventory")) == []
    assert saga.saga_id


@pytest.mark.parametrize("where", ["reserve-stock", "charge", "confirm-order"])
async def test_a_refusal_at_each_step_compensates_the_steps_before_it(
    world: World, where: str
) -> None:
    quantity, amount, extra = 2, 30, {}
    if where == "reserve-stock":
        quantity = 11  # more than the stock
    elif where == "charge":
        amount = 101  # more than the balance
    else:
        extra = {"confirm_refused": True}
    saga_id = await _checkout(world, "o-2", quantity=quantity, amount=amount, **extra)
    row = await world.until(saga_id, State.COMPENSATED)
    assert row.effected == [] and where in row.error and "refused" in row.error
    assert world.stock() == (10, 0) and world.balance() == 100
    # on_end ran in the transaction that recorded the end: the order is cancelled with it
    assert world.order("o-2") == "CANCELLED"
    assert world.faults.ended == [(saga_id, State.COMPENSATED, row.error)]
    events = world.steps(saga_id)
    assert (where, "action", "refused") in events
    undone = [b for b, op, e in events if op == "compensation" and e == "done"]
    assert (
        undone
        == {
            "reserve-stock": [],
            "charge": ["reserve-stock"],
            "confirm-order": ["charge", "reserve-stock"],
        }[where]
    )


async def test_a_failing_step_is_retried_then_succeeds(world: World) -> None:
    world.faults.charge_fails = 2  # the step allows 3 retries
    saga_id = await _checkout(world, "o-3")
    await world.until(saga_id, State.COMPLETED)
    assert world.faults.seen.count("charge") == 3 and world.balance() == 70
    with world.engines["orders"].connect() as conn:
        q = sa.select(saga_steps.c.attempts).where(
            saga_steps.c.saga_id == saga_id,
            saga_steps.c.branch == "charge",
            saga_steps.c.event == "done",
        )
        assert conn.execute(q).scalar_one() == 3


async def test_a_step_out_of_retries_compensates(world: World) -> None:
    world.faults.charge_fails = 100
    saga_id = await _checkout(world, "o-4")
    row = await world.until(saga_id, State.COMPENSATED)
    assert world.faults.seen.count("charge") == 4  # 1 + 3 retries
    assert "charge failed: ConnectionError: the card network is down" in row.error
    assert world.stock() == (10, 0) and world.balance() == 100
    with world.engines["payment"].connect() as conn:  # the barrier says it had no effect
        reason = conn.execute(
            sa.select(saga_barrier.c.reason).where(
                saga_barrier.c.saga_id == saga_id, saga_barrier.c.op == "action"
            )
        ).scalar_one()
    assert reason == "failed"


async def test_a_compensation_that_keeps_failing_parks_the_saga_for_an_operator(
    world: World,
) -> None:
    # confirm refuses: charge and reserve are compensated; the refund fails twice (1 retry)
    world.faults.refund_fails = 100
    saga_id = await _checkout(world, "o-5", confirm_refused=True)
    row = await world.until(saga_id, State.PARKED)
    assert row.step == 1 and "refund failed" in row.error
    assert world.balance() == 70 and world.stock() == (8, 2)  # nothing undone yet
    # the bank is back: an operator retries, and the saga goes on to the end
    world.faults.refund_fails = 0
    await world.coordinator.retry(saga_id, operator="alice", reason="bank is back")
    await world.until(saga_id, State.COMPENSATED)
    assert world.balance() == 100 and world.stock() == (10, 0)
    assert ("charge", "operator", "retried") in world.steps(saga_id)
    with pytest.raises(ValueError, match="not PARKED"):
        await world.coordinator.resolve(saga_id, operator="alice", reason="again")


async def test_an_operator_resolves_a_parked_saga_by_hand(world: World) -> None:
    world.faults.refund_fails = 100
    saga_id = await _checkout(world, "o-6", confirm_refused=True)
    await world.until(saga_id, State.PARKED)
    with world.engines["payment"].begin() as conn:  # the operator refunds by hand
        conn.execute(accounts.update().values(balance=accounts.c.balance + 30))
    with pytest.raises(ValueError, match="reason"):
        await world.coordinator.resolve(saga_id, operator="bob", reason="")
    await world.coordinator.resolve(saga_id, operator="bob", reason="refunded by hand, ticket 7")
    await world.until(saga_id, State.COMPENSATED)
    assert world.balance() == 100 and world.stock() == (10, 0)
    with world.engines["orders"].connect() as conn:
        q = sa.select(saga_steps.c.detail).where(
            saga_steps.c.saga_id == saga_id, saga_steps.c.op == "operator"
        )
        assert conn.execute(q).scalar_one() == "bob: refunded by hand, ticket 7"


async def test_repeated_commands_have_no_second_effect(world: World) -> None:
    saga_id = await _checkout(world, "o-7")
    await world.until(saga_id, State.COMPLETED)
    # every command the coordinator sent, delivered again
    async with txmq.Producer() as producer:
        for service in ("inventory", "payment", "orders"):
            for m in world.broker.messages(command_topic(service)):
                await producer.send(Message(m.topic, m.body, tags=m.tags, keys=list(m.keys)))
    for service in ("inventory", "payment", "orders"):
        await world.broker.wait_consumed_async(f"saga-{service}", command_topic(service))
    assert world.stock() == (8, 2) and world.balance() == 70
    assert world.faults.seen.count("reserve") == 1 and world.faults.seen.count("charge") == 1
    assert world.saga(saga_id).state == State.COMPLETED


async def test_an_answer_lost_after_its_commit_is_sent_again_as_it_was(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A participant whose transaction committed but whose answer never left (here the
    broker refuses it once; in life the service died in between): its command comes again,
    the barrier finds the row, and the first answer is sent again from what the row kept —
    the action's result, or its refusal's words — without a second effect."""
    lost: list[str] = []
    send = txmq.TransactionProducer.send

    async def losing(self: Any, msg: Message, **options: Any) -> Any:
        if msg.topic == reply_topic("orders") and msg.tags in ("done", "refused"):
            key = msg.keys[0]
            if key not in lost:
                lost.append(key)
                raise txmq.BrokerUnavailable("the broker went away (a test)")
        return await send(self, msg, **options)

    monkeypatch.setattr(txmq.TransactionProducer, "send", losing)
    done = await _checkout(world, "o-8")
    row = await world.until(done, State.COMPLETED)
    assert row.data["reserved"] == 2 and row.data["charged"] == 30  # the kept results
    refused = await _checkout(world, "o-9", amount=101)  # more than the balance left
    row = await world.until(refused, State.COMPENSATED)
    assert row.error == "charge refused: card declined"  # the kept words
    assert sorted(lost) == sorted(
        [f"{done}/{i}/action" for i in range(3)]
        + [f"{refused}/{i}/action" for i in range(2)]
        + [f"{refused}/0/compensation"]
    )
    # one effect each: the repeats were answered, not run
    assert world.faults.seen.count("reserve") == 2 and world.faults.seen.count("charge") == 2
    assert world.faults.seen.count("release") == 1
    assert world.stock() == (8, 2) and world.balance() == 70


async def test_a_command_lost_after_its_decision_committed_is_sent_again(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator committed an answer's decision but its next command never left (the
    broker refuses it once here; in life the coordinator died in between): the answer is
    delivered again, its decision is found taken, and the command the saga waits on is
    sent again — the same command — so the saga goes on, each step taking effect once."""
    lost: list[str] = []
    send = txmq.TransactionProducer.send

    async def losing(self: Any, msg: Message, **options: Any) -> Any:
        cmd = msg.topic in (command_topic("payment"), command_topic("orders"))
        if cmd and msg.keys[0] not in lost:
            lost.append(msg.keys[0])
            raise txmq.BrokerUnavailable("the broker went away (a test)")
        return await send(self, msg, **options)

    monkeypatch.setattr(txmq.TransactionProducer, "send", losing)
    saga_id = await _checkout(world, "o-10")
    row = await world.until(saga_id, State.COMPLETED)
    assert lost == [f"{saga_id}/1/action", f"{saga_id}/2/action"]
    assert row.data["charged"] == 30 and world.order("o-10") == "CONFIRMED"
    assert world.faults.seen.count("charge") == 1 and world.faults.seen.count("confirm") == 1
    assert world.steps(saga_id) == EVERY_STEP_DONE


async def test_a_compensation_delivered_before_its_action_suspends_the_action(
    world: World,
) -> None:
    """A release-stock that comes before its reserve-stock (a reordered delivery): it is a
    null compensation and the late action is suspended — it answers "refused", so the saga,
    which still waited for it, compensates instead of waiting forever."""
    early = Command(
        saga_id="o-early",
        saga=CHECKOUT.name,
        step=0,
        service="inventory",
        branch="reserve-stock",
        op=COMPENSATION,
        handler="release-stock",
        command_id="not-the-coordinators",
        sent_ms=int(time.time() * 1000),
        data={"order": "o-early", "product": "apple", "quantity": 2},
        reply_to=reply_topic("orders"),
        retries=0,
    )
    async with txmq.Producer() as producer:
        await producer.send(Message(command_topic("inventory"), encode(early), tags=COMPENSATION))
    await world.broker.wait_consumed_async("saga-inventory", command_topic("inventory"))
    async with world.coordinator.sessions() as session:
        data = {"order": "o-early", "product": "apple", "quantity": 2, "amount": 30}
        async with world.coordinator.start(session, CHECKOUT, data, saga_id="o-early"):
            await session.execute(orders.insert().values(id="o-early", state="PENDING"))
    row = await world.until("o-early", State.COMPENSATED)
    assert "suspended: its compensation came first" in row.error
    assert world.stock() == (10, 0) and world.faults.seen.count("reserve") == 0
    assert world.order("o-early") == "CANCELLED"
    with world.engines["inventory"].connect() as conn:
        reasons = dict(
            conn.execute(
                sa.select(saga_barrier.c.op, saga_barrier.c.reason).where(
                    saga_barrier.c.saga_id == "o-early"
                )
            ).all()
        )
    assert reasons == {ACTION: COMPENSATION, COMPENSATION: COMPENSATION}


def test_a_blocking_service_runs_sagas_the_same_way(
    broker: InProcessBroker, urls: dict[str, tuple[str, str]]
) -> None:
    """Sync handlers with ``Session`` and ``txmq.sync`` clients: a saga completes, and a
    refused one is compensated."""
    with ExitStack() as stack:
        engines = {s: sa.create_engine(u) for s, (u, _) in urls.items()}
        for e in engines.values():
            stack.callback(e.dispose)
        sessions = {s: sessionmaker(e, expire_on_commit=False) for s, e in engines.items()}
        producers = {
            s: stack.enter_context(
                txmq.sync.TransactionProducer(
                    group=f"{s}-tx", listener=SqlTransactionChecker(engines[s])
                )
            )
            for s in SERVICES
        }

        def on_end(ended: Ended, session: Session) -> None:
            if ended.state == State.COMPENSATED:
                cancel = orders.update().where(orders.c.id == ended.data["order"])
                session.execute(cancel.values(state="CANCELLED"))

        coordinator = Coordinator(
            "orders", producers["orders"], sessions["orders"], [CHECKOUT], on_end=on_end
        )
        parts = {s: Participant(s, producers[s], sessions[s]) for s in SERVICES}
        inv, pay, orders_p = parts["inventory"], parts["payment"], parts["orders"]

        def move(session: Session, product: str, q: int) -> None:
            session.execute(
                stock.update()
                .where(stock.c.product == product)
                .values(available=stock.c.available - q, reserved=stock.c.reserved + q)
            )

        @inv.action("reserve-stock")
        def reserve(data: dict[str, Any], session: Session) -> dict[str, Any]:
            move(session, data["product"], data["quantity"])
            return {"reserved": data["quantity"]}

        @inv.compensation("release-stock")
        def release(data: dict[str, Any], session: Session) -> None:
            move(session, data["product"], -data["reserved"])

        @pay.action("charge")
        def charge(data: dict[str, Any], session: Session) -> None:
            if data["amount"] > 100:
                raise Refuse("card declined")

        @pay.compensation("refund")
        def refund(data: dict[str, Any], session: Session) -> None:
            pass

        @orders_p.action("confirm-order")
        def confirm(data: dict[str, Any], session: Session) -> None:
            session.execute(
                orders.update().where(orders.c.id == data["order"]).values(state="CONFIRMED")
            )

        with pytest.raises(TypeError, match="async handler"):

            @inv.action("other")
            async def other(data: dict[str, Any], session: AsyncSession) -> None: ...

        for runner in [coordinator, *parts.values()]:
            consumer = txmq.sync.PushConsumer(**runner.consumer_options())
            consumer.subscribe(runner.topic)
            stack.enter_context(consumer)
        started = []
        for order_id, amount in (("s-1", 30), ("s-2", 500)):
            data = {"order": order_id, "product": "apple", "quantity": 2, "amount": amount}
            with sessions["orders"]() as session:
                with coordinator.start(session, "checkout", data) as saga:
                    session.execute(orders.insert().values(id=order_id, state="PENDING"))
            started.append(saga.saga_id)

        def state(saga_id: str) -> str:
            with engines["orders"].connect() as conn:
                q = sa.select(sagas.c.state).where(sagas.c.saga_id == saga_id)
                return str(conn.execute(q).scalar_one())

        deadline = time.monotonic() + 30
        while [state(s) for s in started] != [State.COMPLETED, State.COMPENSATED]:
            assert time.monotonic() < deadline, [state(s) for s in started]
            time.sleep(0.05)
        with engines["inventory"].connect() as conn:
            assert conn.execute(sa.select(stock.c.available, stock.c.reserved)).one() == (8, 2)
        with engines["orders"].connect() as conn:
            assert conn.execute(
                sa.select(orders.c.id, orders.c.state).order_by(orders.c.id)
            ).all() == [
                ("s-1", "CONFIRMED"),
                ("s-2", "CANCELLED"),
            ]


async def _hold(w: World, *, amount: int) -> str:
    async with w.coordinator.sessions() as session:
        async with w.coordinator.start(session, HOLD, {"quantity": 2, "amount": amount}) as tx:
            pass
    return tx.saga_id


async def test_tcc_confirms_every_branch_once_all_tries_took_effect(world: World) -> None:
    saga_id = await _hold(world, amount=30)
    await world.until(saga_id, State.COMPLETED)
    assert world.stock() == (8, 0) and world.balance() == 70
    assert world.faults.seen == ["hold-stock", "hold-funds", "ship-stock", "capture"]
    assert [(b, op, e) for b, op, e in world.steps(saga_id) if e != "sent"] == [
        ("hold-stock", "action", "done"),
        ("hold-funds", "action", "done"),
        ("hold-stock", "confirm", "done"),
        ("hold-funds", "confirm", "done"),
    ]


async def test_tcc_cancels_every_try_that_took_effect_when_one_fails(world: World) -> None:
    saga_id = await _hold(world, amount=500)
    row = await world.until(saga_id, State.COMPENSATED)
    assert "insufficient funds" in row.error
    assert world.stock() == (10, 0) and world.balance() == 100
    assert world.faults.seen == ["hold-stock", "hold-funds", "unhold-stock"]


async def test_a_confirm_that_keeps_failing_parks_until_an_operator_retries(world: World) -> None:
    world.faults.capture_fails = 100
    saga_id = await _hold(world, amount=30)
    row = await world.until(saga_id, State.PARKED)
    assert row.op == "confirm" and "capture failed" in row.error
    world.faults.capture_fails = 0
    await world.coordinator.retry(saga_id, operator="carol", reason="acquirer back")
    await world.until(saga_id, State.COMPLETED)
    assert world.stock() == (8, 0) and world.balance() == 70
    # a repeated confirm has no second effect
    assert world.faults.seen.count("ship-stock") == 1


async def test_txmq_admin_sagas_lists_shows_and_resolves_a_parked_saga(
    world: World, urls: dict[str, tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's commands on the coordinator's database, the command of a resolve
    sent through the broker like the coordinator's own."""
    world.faults.refund_fails = 100
    saga_id = await _checkout(world, "o-8", confirm_refused=True)
    await world.until(saga_id, State.PARKED)
    db = urls["orders"][0]

    async def txmq(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(main, ["admin", "sagas", *argv, "--db", db])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await txmq("list", "--state", "PARKED")
    assert code == 0 and saga_id in out and "checkout" in out and "refund failed" in out
    code, out, _ = await txmq("show", saga_id)
    assert code == 0 and f"saga {saga_id} (checkout): PARKED at step 1" in out
    assert "confirm-order" in out and "refused" in out and "ConnectionError" in out
    code, out, _ = await txmq("list", "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "PARKED"
    code, _, err = await txmq("retry", "nope", "--reason", "x")
    assert code == 1 and "no saga nope" in err
    with pytest.raises(SystemExit):  # argparse: a count that is not one, said in one line
        await txmq("list", "--max", "-1")
    assert "--max" in capsys.readouterr().err
    with world.engines["payment"].begin() as conn:  # refunded by hand
        conn.execute(accounts.update().values(balance=accounts.c.balance + 30))
    code, out, _ = await txmq("resolve", saga_id, "--reason", "refunded", "--operator", "dan")
    assert code == 0 and "resolve recorded (dan: refunded)" in out
    await world.until(saga_id, State.COMPENSATED)
    assert world.balance() == 100 and world.stock() == (10, 0)
    code, _, err = await txmq("resolve", saga_id, "--reason", "again")
    assert code == 1 and "not PARKED" in err


async def test_metrics_count_sagas_by_state_and_time_each_step(
    world: World, registry: CollectorRegistry
) -> None:
    done = await _checkout(world, "o-9")
    refused = await _checkout(world, "o-10", amount=500)  # the charge is refused
    await world.until(done, State.COMPLETED)
    await world.until(refused, State.COMPENSATED)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"saga": "checkout", **labels}) or 0.0

    # the coordinator counts a state once its transaction committed, just after the row
    # the test polls shows it: wait (bounded) for the last two counts
    with anyio.fail_after(10):
        ended = ("COMPLETED", "COMPENSATED")
        while sum(value("txmq_sagas_total", state=s) for s in ended) < 2:  # noqa: ASYNC110
            await anyio.sleep(0.01)

    assert value("txmq_sagas_total", state="RUNNING") == 2
    assert value("txmq_sagas_total", state="COMPLETED") == 1
    assert value("txmq_sagas_total", state="COMPENSATING") == 1
    assert value("txmq_sagas_total", state="COMPENSATED") == 1
    step = "txmq_saga_step_seconds_count"
    assert value(step, branch="reserve-stock", op="action", outcome="done") == 2
    assert value(step, branch="charge", op="action", outcome="refused") == 1
    assert value(step, branch="reserve-stock", op="compensation", outcome="done") == 1
    assert (
        0 < value("txmq_saga_step_seconds_sum", branch="charge", op="action", outcome="done") < 30
    )


async def test_a_step_without_an_answer_in_its_time_is_compensated_with_those_before(
    world: World,
) -> None:
    """The charge keeps failing (retried on the delay levels); its minute passes first: the
    saga compensates — the refund arrives before any charge took effect (a null
    compensation), and the charge's later retries find the barrier and do nothing."""
    world.faults.charge_fails = 100
    data = {"order": "o-11", "product": "apple", "quantity": 2, "customer": "ann", "amount": 30}
    async with world.coordinator.sessions() as session:
        async with world.coordinator.start(session, SLOW, data) as saga:
            pass
    with anyio.fail_after(10):
        while "charge" not in world.faults.seen:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    assert world.saga(saga.saga_id).deadline_id  # its deadline message waits
    world.broker.advance(60)
    row = await world.until(saga.saga_id, State.COMPENSATED)
    assert "no answer within 60 s" in row.error
    events = {(b, op, e) for b, op, e in world.steps(saga.saga_id)}
    assert {("charge", "action", "timeout"), ("charge", "compensation", "done")} <= events
    assert "refund" not in world.faults.seen  # nothing to refund: a null compensation
    world.faults.charge_fails = 0  # a later charge would succeed: the barrier stops it
    world.broker.advance(7200)
    await world.broker.wait_consumed_async("saga-payment", command_topic("payment"))
    assert world.balance() == 100 and world.stock() == (10, 0)


async def test_an_answer_in_time_recalls_the_deadline(world: World) -> None:
    data = {"order": "o-12", "product": "apple", "quantity": 1, "customer": "ann", "amount": 5}
    async with world.coordinator.sessions() as session:
        async with world.coordinator.start(session, SLOW, data) as saga:
            pass
    row = await world.until(saga.saga_id, State.COMPLETED, advance=False)  # (not its deadline)
    assert row.deadline_id is None
    with anyio.fail_after(10):  # the deadline of the charge, recalled by its answer
        while len(world.broker.messages("RMQ_SYS_TIMER_RECALL")) < 1:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    world.broker.advance(7200)
    await world.broker.wait_consumed_async("saga-orders-coordinator", "saga-orders-replies")
    tags = [m.tags for m in world.broker.messages("saga-orders-replies")]
    assert "timeout" not in tags and tags.count("done") == 2
