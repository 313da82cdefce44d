"""The orders demo: a local txmq cluster and the three services as real processes, a load of
orders (each a saga: reserve the stock, charge the customer, confirm), faults injected one
after another, then the books.

Layouts: by default a cluster — one name server with the failover controller inside and
two broker sets: ``broker-a`` replicated (nodes ``broker-a-0`` and ``broker-a-1``, SYNC
replication, the master elected by the controller) and ``broker-b`` one broker alone, each
node its own store; the services routed through the name server, so the sagas spread over
both sets (see :mod:`examples.orders.cluster`).  ``single_broker`` (``--single-broker``):
one broker alone, the services given its address.

The load mixes the saga's outcomes: orders whose stock runs out (refused at the first
step), customers whose money runs out (declined at the charge: the stock is released) and
orders the order review refuses after payment (customer ``mallory``: refunded, released).

Faults (each between two parts of the load; the saga faults are in
:mod:`examples.orders.faults_saga`):

- ``order-crash-before-commit`` / ``order-crash-after-commit``: the order service is
  SIGKILLed while it starts a saga, after sending the half message of its first command and
  before its database commit (the order must never exist: the check-back rolls the message
  back), or after that commit and before telling the broker COMMIT (the order must settle:
  the check-back commits it).
- ``coordinator-crash``: the order service SIGKILLed between two steps of a saga: the answer
  taken and the next step committed in its database, its command not sent; the answer comes
  again, finds its decision taken, the command is sent again and the saga goes on.
- ``broker-restart`` and ``master-failover`` (the cluster only): a broker set SIGKILLed and
  restarted, and ``broker-a``'s master SIGKILLed and replaced by the controller, while
  orders flow and sagas are in flight (:mod:`examples.orders.faults_broker`).
- ``inventory-crash-action`` / ``inventory-crash-compensation`` /
  ``payment-crash-action`` / ``payment-crash-compensation``: a participant SIGKILLed inside
  its action or its compensation, after its writes, before their commit: the command comes
  again and is applied once.
- ``deadline``: the payment service paused (SIGSTOP) past the charge's deadline: the saga
  gives up on it and compensates; resumed, the late charge does nothing (or is refunded).
- ``duplicates``: copies of commands already carried out are delivered again: the barrier
  lets none take a second effect.
- ``reordered``: an order's compensation (release its stock) delivered before its action:
  a null compensation, and the late action is suspended — the order is cancelled, its stock
  never taken.
- ``poison``: a malformed saga command: dead-lettered at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from examples.orders import db as dbs
from examples.orders.checker import Report, check
from examples.orders.cluster import (
    BROKER_SETS,
    CLUSTER,
    REPLICATED,
    BrokerNode,
    masters_registered,
    node_names,
    routed_sets,
    wait_set_healthy,
)
from examples.orders.faults_demo import CLUSTER_ONLY, FAULTS, Fault, FaultResult
from examples.orders.models import (
    BLOCKED,
    BROKE,
    CANCELLED,
    CONFIRMED,
    FAULT_CUSTOMER,
    FAULT_PRODUCT,
    PENDING,
    Order,
)
from examples.orders.order_service import SERVICE as ORDERS
from examples.orders.procs import Proc, free_port
from examples.orders.secure import OPERATOR, make_secure
from examples.orders.web import request
from txmq.saga import State, command_topic, reply_topic
from txmq.sqla.db import with_connection
from txmq.sqla.tables import ROLLED_BACK, sagas, transaction_log
from txmq.sync import AdminClient

__all__ = [
    "ALL_FAULTS",
    "DemoConfig",
    "DemoResult",
    "books_lines",
    "default_faults",
    "print_summary",
    "run_demo",
]

ALL_FAULTS = tuple(FAULTS)
"""Every fault, in the order they are injected."""


def default_faults(single_broker: bool) -> tuple[str, ...]:
    """The faults a layout injects unless told otherwise: every one (one broker alone:
    those that need no cluster)."""
    return tuple(f for f in ALL_FAULTS if not (single_broker and f in CLUSTER_ONLY))


DEFAULT_STOCK = {"apple": 60, "fig": 60, "kiwi": 60, "pear": 60, "plum": 60, FAULT_PRODUCT: 100}
DEFAULT_ACCOUNTS = {
    "ann": 150,
    "bob": 150,
    "cy": 150,
    "dee": 150,
    BROKE: 0,
    BLOCKED: 1000,
    FAULT_CUSTOMER: 100_000,
}
#: the load's customers; mallory places one order in twenty
LOAD_CUSTOMERS = ("ann", "bob", "cy", "dee")
#: the saga topics, created on every broker set before anyone subscribes
TOPICS = (
    command_topic("inventory"),
    command_topic("payment"),
    command_topic(ORDERS),
    reply_topic(ORDERS),
)

# Short for a demo (defaults: check every 30 s after 6 s; retries 1 s … 2 h)
BROKER_TOML = """\
[broker]
transaction_check_interval_s = 1.0
transaction_timeout_s = 2.0
message_delay_levels = "100ms 200ms 300ms 500ms 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s"
# the services speak txmq's own protocol: no RocketMQ 5 gRPC endpoint (port 8081)
grpc_port = 0
metrics_port = 0
"""
# Short for a demo (default 30 s): a restarted broker set checks its transactions back as
# soon as the order service's producer heartbeats it again
PRODUCER_HEARTBEAT_S = 2.0
# Short for a demo (default 30 s): a broker set whose master died is left out of the
# services' sends until a route names its new master
ROUTE_TTL_S = 2.0
QUEUES_PER_BROKER = 4


@dataclass
class DemoConfig:
    orders: int = 300
    orders_db: str | None = None
    """The order service's database URL; None: a SQLite file in the demo's folder."""
    inventory_db: str | None = None
    payment_db: str | None = None
    faults: tuple[str, ...] | None = None
    """The faults to inject, in turn; None: :func:`default_faults` of the layout."""
    seed: int = 7
    clients: int = 4
    stock: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_STOCK))
    accounts: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_ACCOUNTS))
    duplicates: int = 20
    charge_deadline: float = 10.0
    """Seconds a saga waits for the payment's answer (short for a demo; default 30)."""
    settle_timeout: float = 120.0
    single_broker: bool = False
    """One broker alone (the services given its address); default: a name server and two
    broker sets (the services given the name server)."""
    secure: bool = False
    """Access control and mutual TLS on every port, a user per service
    (:mod:`examples.orders.secure`)."""


@dataclass
class DemoResult:
    config: DemoConfig
    report: Report
    folder: str
    databases: str
    layout: str = ""
    requested: int = 0
    """Orders placed (``POST /orders``): the load's and the faults' own."""
    by_faults: int = 0
    """Of those, the orders the faults placed (beside the load's ``config.orders``)."""
    accepted: int = 0
    refused: int = 0
    by_broker: dict[str, int] = field(default_factory=dict)
    """Accepted orders by the broker set that stored their OrderCreated."""
    faults: list[FaultResult] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    settled: bool = False
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.settled and self.report.ok and all(f.verified for f in self.faults)


class Demo:
    """The running system; :mod:`examples.orders.faults_demo` drives its faults."""

    def __init__(self, config: DemoConfig, folder: Path, progress: Callable[[str], None]) -> None:
        self.config = config
        self.folder = folder
        self.say = progress
        self.orders_db = config.orders_db or f"sqlite:///{folder / 'orders.db'}"
        self.inventory_db = config.inventory_db or f"sqlite:///{folder / 'inventory.db'}"
        self.payment_db = config.payment_db or f"sqlite:///{folder / 'payment.db'}"
        self.single = config.single_broker
        #: --secure: the CA, the ACL file and the users (None: plaintext, no ACL)
        self.secure = make_secure(folder) if config.secure else None
        self._saved_env: dict[str, str | None] = {}
        if self.secure is not None:  # the demo's own clients: the operator, over TLS
            for key, value in self.secure.client_env(OPERATOR).items():
                self._saved_env[key] = os.environ.get(key)
                os.environ[key] = value
        #: the ports picked so far (they are picked before anyone binds them)
        self._taken = taken = set[int]()
        self.namesrv = "" if self.single else f"127.0.0.1:{_port(taken)}"
        self.namesrv_proc: Proc | None = None
        self.brokers = {
            name: BrokerNode(name, broker_set, _port(taken), _port(taken), folder / name, broker_id)
            for name, broker_set, broker_id in node_names(self.single)
        }
        self.broker: Proc | None = None  # the single broker's process (None in a cluster)
        self.orders: Proc | None = None
        self.inventory: Proc | None = None
        self.payment: Proc | None = None
        self.orders_url = self.inventory_url = self.payment_url = ""
        self.accepted: list[dict[str, Any]] = []
        self.refused = 0
        #: orders placed so far (POST /orders), and of those the load's
        self.requested = 0
        self.load_placed = 0
        self._lock = threading.Lock()  # the load's clients are threads

    @property
    def broker_address(self) -> str:
        """The single broker's address (in a cluster: the first broker set's)."""
        return next(iter(self.brokers.values())).address

    @property
    def client_args(self) -> dict[str, str]:
        """How a txmq client reaches this system: a broker's address, or the name server."""
        return {"address": self.broker_address} if self.single else {"namesrv": self.namesrv}

    def nodes(self, broker_set: str) -> list[BrokerNode]:
        """The broker processes of ``broker_set``."""
        return [n for n in self.brokers.values() if n.broker_set == broker_set]

    def node(self, broker_set: str, broker_id: int) -> BrokerNode:
        """The replica of ``broker_set`` whose own id is ``broker_id``."""
        return next(n for n in self.nodes(broker_set) if n.broker_id == broker_id)

    @property
    def layout(self) -> str:
        plain = self._layout
        return f"{plain}; {self.secure.summary}" if self.secure is not None else plain

    @property
    def _layout(self) -> str:
        if self.single:
            return f"one broker on {self.broker_address} (--single-broker), no name server"
        sets = []
        for name in BROKER_SETS:
            nodes = self.nodes(name)
            if name == REPLICATED:
                replicas = " and ".join(f"{n.name} {n.address}" for n in nodes)
                sets.append(
                    f"{name} replicated ({replicas}; SYNC replication, master elected by the "
                    "controller)"
                )
            else:
                sets.append(f"{name} {nodes[0].address} (one broker)")
        return (
            f"a cluster: name server {self.namesrv} (controller inside); broker sets "
            + ", ".join(sets)
        )

    # -- processes -------------------------------------------------------------------------

    def start_namesrv(self) -> None:
        """The name server, with the controller inside (its state in the demo's folder)."""
        port = self.namesrv.rpartition(":")[2]
        args = ["txmq.cli", "namesrv", "start", "--port", port]
        args += ["--controller-store", str(self.folder / "controller")]
        args += self.secure.server_args() if self.secure else []
        self.namesrv_proc = Proc("namesrv", args, self.folder / "namesrv.log")
        try:
            self.namesrv_proc.wait_line("txmq namesrv listening on ")
        except RuntimeError:
            if not _lost_its_port(self.namesrv_proc):
                raise
            self.namesrv = f"127.0.0.1:{_port(self._taken)}"
            self.start_namesrv()

    def launch_broker(self, name: str | None = None) -> BrokerNode:
        """Start (or restart, on its store and ports) one broker process, without waiting
        for it; the single one by default."""
        node = self.brokers[name] if name else next(iter(self.brokers.values()))
        cfg = self.folder / "broker.toml"
        cfg.write_text(BROKER_TOML)
        args = ["txmq.cli", "broker", "start", "--store", str(node.store)]
        args += ["--port", str(node.port), "--ha-port", str(node.ha_port), "--config", str(cfg)]
        if not self.single:
            args += ["--namesrv", self.namesrv, "--cluster", CLUSTER]
            args += ["--broker-name", node.broker_set]
        if node.broker_id is not None:  # a replica: the controller gives it its role
            args += ["--broker-id", str(node.broker_id), "--replication", "sync"]
            args += ["--controller", self.namesrv]
        env = None
        if self.secure is not None:
            args += self.secure.server_args()
            env = self.secure.broker_env()
        node.proc = Proc(node.name, args, self.folder / f"{node.name}.log", env)
        if self.single:
            self.broker = node.proc
        return node

    def start_broker(self, name: str | None = None) -> None:
        """Start (or restart) one broker and wait until it listens."""
        node = self.launch_broker(name)
        assert node.proc is not None
        node.proc.wait_line("txmq broker listening on ")

    def start_brokers(self) -> None:
        """Every broker process at once; then, in a cluster, until each broker set has its
        master registered (the replicated one: elected, its slave in sync)."""
        for name in self.brokers:
            self.launch_broker(name)
        for name, node in self.brokers.items():
            for again in (True, True, False):
                assert node.proc is not None
                try:
                    node.proc.wait_line("txmq broker listening on ")
                    break
                except RuntimeError:
                    if not (again and _lost_its_port(node.proc)):
                        raise
                    node.port, node.ha_port = _port(self._taken), _port(self._taken)
                    self.launch_broker(name)
        if self.single:
            return
        wait_set_healthy(self.namesrv, self.nodes(REPLICATED), 60)
        deadline = time.monotonic() + 30
        while masters_registered(self.namesrv) != set(BROKER_SETS):
            if time.monotonic() > deadline:
                raise RuntimeError("a broker set did not register its master in 30 s")
            time.sleep(0.1)

    def admin(self) -> AdminClient:
        """An admin client of every broker set's master: through the name server in a
        cluster (a node may be a slave now), the broker itself alone."""
        return (
            AdminClient(self.broker_address) if self.single else AdminClient(namesrv=self.namesrv)
        )

    def create_topics(self) -> None:
        """The cluster's topics, on every broker set's master (through the name server),
        before anyone subscribes; then wait until the name server routes them over all sets
        (one broker alone creates them on first use, as it always did)."""
        if self.single:
            return
        topics = TOPICS
        with self.admin() as admin:
            for topic in topics:
                admin.create_topic(topic, QUEUES_PER_BROKER, cluster=CLUSTER)
        deadline = time.monotonic() + 30
        while not all(routed_sets(self.namesrv, t) == len(BROKER_SETS) for t in topics):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the name server does not route {topics} over every set")
            time.sleep(0.1)

    def _service(self, name: str, db: str, *extra: str) -> tuple[Proc, str]:
        """Start one service's process; it and its front's URL once it is READY."""
        args = ["examples.orders", name, "--db", db]
        if self.single:
            args += ["--broker", self.broker_address]
        else:
            args += ["--namesrv", self.namesrv, "--route-ttl", str(ROUTE_TTL_S)]
        args += ["--heartbeat-interval", str(PRODUCER_HEARTBEAT_S), *extra]
        env = self.secure.client_env(name) if self.secure else None
        proc = Proc(name, args, self.folder / f"{name}.log", env)
        return proc, proc.wait_line("READY ").split()[1]

    def start_orders(self) -> None:
        deadline = ("--charge-deadline", str(self.config.charge_deadline))
        self.orders, self.orders_url = self._service("order-service", self.orders_db, *deadline)

    def start_inventory(self) -> None:
        self.inventory, self.inventory_url = self._service("inventory-service", self.inventory_db)

    def start_payment(self) -> None:
        self.payment, self.payment_url = self._service("payment-service", self.payment_db)

    def close(self) -> None:
        """Stop every process the demo started (by its PID; SIGKILL if SIGTERM is not
        enough; a paused one is resumed first): the services, then the brokers, then the
        name server."""
        procs = [self.orders, self.inventory, self.payment]
        procs += [b.proc for b in self.brokers.values()]
        for proc in [*procs, self.namesrv_proc]:
            if proc is not None:
                proc.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    # -- load ------------------------------------------------------------------------------

    def place(
        self,
        product: str,
        quantity: int,
        customer: str = FAULT_CUSTOMER,
        order_id: str | None = None,
    ) -> tuple[int, Any]:
        """POST /orders; (0, error) when the service can't be reached."""
        with self._lock:
            self.requested += 1
        order: dict[str, Any] = {"product": product, "quantity": quantity, "customer": customer}
        if order_id is not None:
            order["id"] = order_id
        try:
            status, data = request(self.orders_url, "POST", "/orders", order)
        except OSError as exc:
            status, data = 0, str(exc)
        if status == 201:
            with self._lock:
                self.accepted.append(data)
        elif status in (0, 503):
            with self._lock:
                self.refused += 1
        else:
            raise RuntimeError(f"order refused with {status}: {data}")
        return status, data

    def load(self, orders: list[tuple[str, int, str]]) -> None:
        with ThreadPoolExecutor(self.config.clients) as pool:
            list(pool.map(lambda o: self.place(*o), orders))
        with self._lock:
            self.load_placed += len(orders)

    @property
    def by_faults(self) -> int:
        """The orders the faults placed so far (their own, and those flowing while a broker
        set dies)."""
        with self._lock:
            return self.requested - self.load_placed

    def stats(self, url: str) -> dict[str, Any]:
        status, data = request(url, "GET", "/stats")
        if status != 200:
            raise RuntimeError(f"GET {url}/stats: {status} {data}")
        result: dict[str, Any] = data
        return result

    def running(self) -> int:
        """Sagas not ended yet (an order commits with its saga: none PENDING without one)."""
        q = select(func.count()).select_from(sagas).where(sagas.c.state.not_in(State.ENDED))
        return with_connection(self.orders_db, lambda conn: int(conn.execute(q).scalar_one()))

    def report(self) -> Report:
        """The books as they are now."""
        return check(self.orders_db, self.inventory_db, self.payment_db)

    def order_states(self, ids: list[str]) -> dict[str, str]:
        q = select(Order.id, Order.state).where(Order.id.in_(ids))
        return with_connection(self.orders_db, lambda conn: {i: st for i, st in conn.execute(q)})

    def rolled_back_transactions(self) -> int:
        """Rows the check-back's ROLLBACK answers left in the order service's log."""
        t = transaction_log
        q = select(func.count()).select_from(t).where(t.c.state == ROLLED_BACK)
        return with_connection(self.orders_db, lambda conn: int(conn.execute(q).scalar_one()))

    def dlq(self) -> list[str]:
        """The keys of the inventory's dead letters, on every broker set."""
        with self.admin() as admin:
            letters = admin.dlq_list("saga-inventory", max=100)
        return sorted(" ".join(m.keys) for m in letters)

    def pending_transactions(self) -> int:
        """Half messages not yet committed or rolled back, on every broker set."""
        with self.admin() as admin:
            return len(admin.transactions("pending"))


def _port(taken: set[int]) -> int:
    """A free port not in ``taken`` (then in it)."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def _lost_its_port(proc: Proc) -> bool:
    """Whether ``proc`` ended at its start because a port picked for it was bound by another
    program between the pick and the start (the demo then picks another: a first start
    only, a restart keeps its ports)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait_exit(5)  # its output ended: it is exiting, reaped a moment later
    return not proc.alive and "already in use" in proc.log_tail(3)


def _check_fresh(url: str) -> None:
    q = select(func.count()).select_from(Order)
    n = with_connection(url, lambda conn: int(conn.execute(q).scalar_one()))
    if n:
        raise ValueError(f"the demo needs a fresh order database; {url} has {n} orders")


def run_demo(config: DemoConfig, progress: Callable[[str], None] = lambda s: None) -> DemoResult:
    if config.faults is None:
        config = dataclasses.replace(config, faults=default_faults(config.single_broker))
    names: tuple[str, ...] = config.faults or ()
    unknown = set(names) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}: choose from {', '.join(FAULTS)}")
    clustered = sorted(set(names) & CLUSTER_ONLY)
    if config.single_broker and clustered:
        raise ValueError(
            f"{', '.join(clustered)} needs a cluster (a replicated broker set): drop "
            "--single-broker"
        )
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="txmq-orders-")))
        demo = Demo(config, folder, progress)
        stack.callback(demo.close)
        dbs.upgrade("orders", demo.orders_db)
        dbs.upgrade("inventory", demo.inventory_db)
        dbs.upgrade("payment", demo.payment_db)
        _check_fresh(demo.orders_db)
        dbs.seed_stock(demo.inventory_db, config.stock)
        dbs.seed_accounts(demo.payment_db, config.accounts)
        progress(f"layout: {demo.layout}; stores and logs in {folder}")
        if not demo.single:
            demo.start_namesrv()
        demo.start_brokers()
        demo.create_topics()
        demo.start_inventory()
        demo.start_payment()
        demo.start_orders()
        progress(
            f"services: orders {demo.orders_url}, inventory {demo.inventory_url}, "
            f"payment {demo.payment_url}"
        )

        rng = random.Random(config.seed)
        products = sorted(set(config.stock) - {FAULT_PRODUCT})
        load = [
            (
                rng.choice(products),
                rng.randint(1, 3),
                BLOCKED if rng.random() < 0.05 else rng.choice(LOAD_CUSTOMERS),
            )
            for _ in range(config.orders)
        ]
        faults = [FAULTS[name] for name in names]
        parts = _split(load, len(faults) + 1)
        results: list[tuple[Fault, FaultResult]] = []
        for i, part in enumerate(parts):
            demo.load(part)
            progress(
                f"load: {demo.load_placed} of {config.orders} orders placed, and "
                f"{demo.by_faults} more by the faults so far: {len(demo.accepted)} of the "
                f"{demo.requested} accepted"
            )
            if i < len(faults):
                progress(f"fault: {faults[i].describe(demo)}")
                results.append((faults[i], faults[i].inject(demo)))
        result = DemoResult(config, Report(), str(folder), _describe(demo), demo.layout)
        result.settled = _settle(demo, results, config.settle_timeout)
        for fault, fr in results:
            fault.verify(demo, fr)
        result.faults = [fr for _, fr in results]
        result.report = demo.report()
        result.dead_lettered = demo.dlq()
        result.requested, result.accepted = demo.requested, len(demo.accepted)
        result.by_faults = demo.by_faults
        result.refused = demo.refused
        by_broker = Counter(str(o.get("broker") or "?") for o in demo.accepted)
        sets = () if demo.single else BROKER_SETS  # one broker alone: named as it says
        result.by_broker = {name: by_broker.get(name, 0) for name in sets} | by_broker
        result.elapsed = time.monotonic() - began
        if demo.secure is not None:
            refused = [
                line
                for log in sorted(folder.glob("*.log"))
                for line in log.read_text(errors="replace").splitlines()
                if "refused a request" in line
            ]
            progress(f"access control: {len(refused)} requests refused by the servers")
            for line in refused[:5]:
                progress(f"  {line.strip()[:300]}")
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    size = -(-len(items) // parts)
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def _describe(demo: Demo) -> str:
    c = demo.config
    if c.orders_db is None and c.inventory_db is None and c.payment_db is None:
        return "SQLite files orders.db, inventory.db and payment.db in the demo's folder"
    return (
        f"orders {demo.orders_db.split('@')[-1]}, inventory {demo.inventory_db.split('@')[-1]}, "
        f"payment {demo.payment_db.split('@')[-1]}"
    )


def _settle(demo: Demo, faults: list[tuple[Fault, FaultResult]], timeout: float) -> bool:
    """Wait (bounded) until every saga ended and every order is settled, no half message
    is pending and every fault's own condition holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = demo.report()
        if (
            report.pending == 0
            and demo.pending_transactions() == 0
            and all(f.settled(demo, r) for f, r in faults)
        ):
            return True
        time.sleep(0.25)
    return False


def books_lines(report: Report) -> list[str]:
    o, g = report.orders, report.sagas
    lines = [
        f"orders:    {CONFIRMED} {o.get(CONFIRMED, 0)} · {CANCELLED} {o.get(CANCELLED, 0)}"
        f" · {PENDING} {o.get(PENDING, 0)}",
        "sagas:     " + (" · ".join(f"{state} {n}" for state, n in sorted(g.items())) or "none"),
        "stock:     product   initial  available  reserved",
    ]
    for st in report.stock:
        lines.append(
            f"           {st['product']:<8} {st['initial']:>8} {st['available']:>10}"
            f" {st['reserved']:>9}"
        )
    lines.append("money:     customer  initial    balance   charged")
    for a in report.accounts:
        lines.append(
            f"           {a['customer']:<8} {a['initial']:>8} {a['balance']:>10} {a['charged']:>9}"
        )
    if report.ok:
        lines.append(
            "books:     BALANCED — every saga ended and every order settled as its saga says; "
            "available + reserved = initial for every product and balance + charged = initial "
            "for every customer; nothing reserved or charged twice, nothing held for a "
            "cancelled order, nothing for an order that does not exist"
        )
    else:
        lines.append("books:     DO NOT BALANCE")
        lines += [f"           - {p}" for p in report.problems]
    return lines


def print_summary(result: DemoResult, out: Callable[[str], None] = print) -> None:
    out("")
    out("== txmq orders demo ==")
    out(f"layout:    {result.layout}")
    out(f"databases: {result.databases}")
    load = result.requested - result.by_faults
    out(
        f"load:      {load} orders by {result.config.clients} clients, and {result.by_faults} "
        f"more placed by the faults: {result.accepted} of the {result.requested} accepted, "
        f"{result.refused} refused while a service or a broker was down"
    )
    carried = ", ".join(f"{name} {n}" for name, n in result.by_broker.items())
    out(f"carried:   accepted orders by the broker set that stored their first command: {carried}")
    if result.faults:
        out("faults:")
        for f in result.faults:
            out(f"  [{'ok' if f.verified else 'FAILED'}] {f.what}")
            out(f"         {f.detail}")
    for line in books_lines(result.report):
        out(line)
    r = result.report
    out(
        f"outcomes:  {r.reservations.get('RELEASED', 0)} reservations released and "
        f"{r.charges.get('REFUNDED', 0)} charges refunded by compensations; "
        f"{len(result.dead_lettered)} dead-lettered"
        + (f" ({', '.join(result.dead_lettered)})" if result.dead_lettered else "")
    )
    if not result.settled:
        out(f"NOT SETTLED within {result.config.settle_timeout:.0f} s")
    out(f"result:    {'OK' if result.ok else 'FAILED'} in {result.elapsed:.1f} s")
