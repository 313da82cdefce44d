"""Replicated broker sets on real processes, for bench/replication_bench.py and
bench/failover_bench.py.

* :class:`Node` (from :mod:`bench.common`): one ``python -m txmq.cli ... start`` process
  (name server, controller or broker) with a ready file and a log in a temporary folder;
  start, SIGKILL, SIGTERM (by PID), start again on the same store, CPU seconds so far.
  :func:`namesrv_node`: a name server with the controller inside; :func:`plain_namesrv_node`:
  one without; :func:`controller_node`: a controller of its own on etcd (on the same port
  at every start).
* :class:`BrokerSet`: ``replicas`` brokers of one broker set, as a user runs them: every
  broker ``--namesrv NS --cluster C --broker-name B --broker-id i``, and for a replicated
  set ``--replication sync|async --controller NS`` (the controller inside the name server
  elects the master; or ``--controller 'C1;C2;C3'``, controllers of their own).
  :meth:`BrokerSet.healthy` reads the (leading) controller's view (``GetReplicaInfo``).
* :func:`create_topic`: a topic on one broker set through the name server, and the wait
  until the name server routes it.
* :func:`consume_all`: every message of a topic in the set's consume queues, read from the
  master through the name server: how many times each body is there.

Nothing here waits without a bound; every process is ended by its PID.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections import Counter
from pathlib import Path

import anyio

from bench.common import Node as Node  # re-exported: bench.replicas.Node still works
from bench.common import free_port
from txmq.protocol.peer import RemotingClient, named_leader
from txmq.protocol.wire import BrokerSetState, GetReplicaInfo, Request
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import BrokerUnavailable, ControllerNotLeader, RequestTimeout

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "bench"


def namesrv_node(tmp: Path, log_level: str = "WARNING") -> Node:
    """A name server with the controller inside (state in ``tmp/controller``)."""
    argv = ["namesrv", "start", "--controller-store", str(tmp / "controller")]
    return Node("namesrv", argv, tmp, log_level)


def plain_namesrv_node(tmp: Path, log_level: str = "WARNING") -> Node:
    """A name server without a controller (the brokers are given controllers of their own)."""
    return Node("namesrv", ["namesrv", "start"], tmp, log_level)


def controller_node(
    tmp: Path,
    name: str,
    etcd_endpoints_arg: str,
    log_level: str = "WARNING",
    *,
    port: int | None = None,
) -> Node:
    """A controller of its own (``txmq controller start --etcd E1,E2,E3``), its state in
    etcd (``--store tmp/<name>``: unused with etcd, given so that nothing lands in the
    working folder), on ``port`` (None: a port free now) at every start.  It leads, or
    names the leader, as ``127.0.0.1:port`` (its bound address: no
    ``--advertised-address`` needed on loopback)."""
    argv = ["controller", "start", "--etcd", etcd_endpoints_arg, "--store", str(tmp / name)]
    chosen = free_port() if port is None else port
    return Node(name, argv, tmp, log_level, port=chosen)


async def aask(address: str, request: Request[R], timeout: float = 5.0) -> R:
    """One typed request to ``address`` on a connection of its own; its typed answer."""
    async with RemotingClient(address, connect_timeout=timeout) as client:
        return (await client.call(request, timeout=timeout)).header


def ask(address: str, request: Request[R], timeout: float = 5.0) -> R:
    """:func:`aask` from synchronous code (no event loop running in this thread)."""

    async def go() -> R:
        return await aask(address, request, timeout)

    return anyio.run(go)


class BrokerSet:
    """``replicas`` brokers of broker set ``name``; replicated ones under the controller
    (``controllers``: the addresses of controllers of their own, say three on etcd; None:
    the one inside the name server)."""

    def __init__(
        self,
        tmp: Path,
        namesrv: str,
        name: str,
        replicas: int = 3,
        replication: str | None = "sync",
        *,
        flush: str = "async",
        log_level: str = "WARNING",
        extra: list[str] | None = None,
        controllers: list[str] | None = None,
    ) -> None:
        self.name = name
        self.namesrv = namesrv
        self.replication = replication
        self.controllers = list(controllers or [namesrv])
        self.nodes: dict[int, Node] = {}
        for i in range(replicas):
            argv = [
                *("broker", "start", "--store", str(tmp / f"store-{name}{i}")),
                *("--flush", flush, "--namesrv", namesrv, "--cluster", CLUSTER),
                *("--broker-name", name, "--broker-id", str(i)),
            ]
            if replication is not None:
                argv += ["--replication", replication]
                argv += ["--controller", ";".join(self.controllers)]
            self.nodes[i] = Node(f"{name}{i}", [*argv, *(extra or [])], tmp, log_level)

    @property
    def controlled(self) -> bool:
        return self.replication is not None

    def start(self, timeout: float = 60.0) -> BrokerSet:
        for node in self.nodes.values():
            node.start()
        for node in self.nodes.values():
            node.wait_ready(timeout)
        return self

    def stop(self) -> None:
        """SIGTERM every replica by PID (slaves first: a stopping master hands over)."""
        for _, node in sorted(self.nodes.items(), reverse=True):
            node.stop()

    def kill_all(self) -> None:
        for node in self.nodes.values():
            node.kill()

    def state(self) -> BrokerSetState | None:
        """The (leading) controller's view of the set (None: it does not know the set yet,
        or no controller leads now).  Several controllers: each address in turn; one that
        does not lead names the leader, which is asked next (it may listen where the
        brokers were not told: it was named to them too); one that does not answer is
        passed over.  A single controller that does not answer raises, as before."""
        order = list(self.controllers)
        tried: set[str] = set()
        while order:  # (each address at most once: bounded)
            address = order.pop(0)
            if address in tried:
                continue
            tried.add(address)
            try:
                info = ask(address, GetReplicaInfo(broker_name=self.name))
            except ControllerNotLeader as exc:
                leader = named_leader(exc)
                if leader is not None:
                    order.insert(0, leader)
                continue
            except (BrokerUnavailable, RequestTimeout):
                if len(self.controllers) == 1:
                    raise
                continue
            return info.sets[0] if info.sets else None
        return None

    def master(self) -> int:
        """The id of the master the controller names now, if that process runs; else -1."""
        if not self.controlled:
            return 0 if self.nodes[0].alive() else -1
        s = self.state()
        if s is None or s.electing or s.master_id < 0:
            return -1
        node = self.nodes.get(s.master_id)
        return s.master_id if node is not None and node.alive() else -1

    def healthy(self) -> int:
        """The master's id once it leads every other running replica in its sync state set
        (and the controller sees them all alive); else -1."""
        if not self.controlled:
            return self.master()
        s = self.state()
        if s is None or s.electing or s.master_id < 0 or not self.nodes[s.master_id].alive():
            return -1
        others = {i for i, n in self.nodes.items() if n.alive() and i != s.master_id}
        alive = {r.broker_id for r in s.replicas if r.alive}
        if others <= set(s.in_sync) and others | {s.master_id} <= alive:
            return s.master_id
        return -1

    def wait_healthy(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (master := self.healthy()) < 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker set {self.name} not whole within {timeout}s")
            time.sleep(0.05)
        return master


async def create_topic(namesrv: str, topic: str, broker: str, queues: int = 4) -> None:
    """Create ``topic`` on broker set ``broker`` (its master, through the name server) and
    wait until the name server routes its ``queues`` write queues."""
    from txmq import AdminClient, Producer
    from txmq.protocol.wire.errors import TxmqError

    # until the master registers, the admin client warns that the set has no master
    logging.getLogger("txmq.admin").setLevel(logging.ERROR)
    deadline = time.monotonic() + 30
    async with AdminClient(namesrv=namesrv) as admin:
        while True:  # a master elected moments ago may not be registered yet
            try:
                await admin.create_topic(topic, queues, broker=broker)
                break
            except TxmqError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    async with Producer(namesrv=namesrv) as producer:
        while True:
            try:
                route = await producer.route(topic, refresh=True)
            except TxmqError:  # TopicNotFound until the master registers it
                route = None
            if route is not None and queues == len(
                [mq for mq in route.write_queues if mq.broker_name == broker]
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the name server does not route {topic} on {broker}")
            await asyncio.sleep(0.1)


def consume_all(namesrv: str, topic: str, group: str = "bench-check") -> Counter[bytes]:
    """Every message of ``topic`` in its consume queues (pulled through the name server,
    from each set's master): how many times each body is there."""
    from txmq.sync import PullConsumer

    seen: Counter[bytes] = Counter()
    with PullConsumer(namesrv=namesrv, group=group) as consumer:
        for mq in consumer.message_queues(topic, refresh=True):
            offset = 0
            while True:
                res = consumer.pull(
                    topic,
                    mq.queue_id,
                    offset,
                    max_msgs=512,
                    long_poll=0,
                    broker_name=mq.broker_name,
                )
                if not res.messages:
                    break
                seen.update(bytes(m.body) for m in res.messages)
                offset = res.next_offset
    return seen


def commit_log_end(address: str) -> int:
    """A broker's commit-log max offset (GetBrokerRuntimeInfo)."""
    from txmq.protocol.wire import GetBrokerRuntimeInfo

    return ask(address, GetBrokerRuntimeInfo()).commit_log_max_offset


def git_head() -> str:
    """The commit the bench runs, and whether broker/txmq/namesrv had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                *("git", "status", "--porcelain", "--untracked-files=no"),
                "--",
                "broker",
                "txmq",
                "namesrv",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
    except OSError:
        return "commit ?"
    return f"commit {head}" + (" + uncommitted changes in broker/txmq/namesrv" if dirty else "")
