"""A replicated broker set on real processes, for the failover tests: a name server with
the controller inside, and a master and slaves (``txmq broker start --controller``) that
the tests SIGKILL and start again; producers that send numbered messages and remember
which were acknowledged; the checks made afterwards.

Partitions (``replica_sets(..., proxied=True)``): every broker reaches the controller(s)
through TCP proxies of its own (:attr:`ReplicaSet.to_controller`), and every broker's HA
port is reached only through a proxy in front of it (:attr:`ReplicaSet.ha_in`: the broker
binds a free ``--ha-port`` and advertises the proxy with ``--ha-advertised-address``, so a
slave copies from master *i* through ``ha_in[i]``).  Clients and the name server reach the
brokers directly.  So ``rs.to_controller[i].cut()`` cuts broker *i* from the controller,
``rs.ha_in[i].cut()`` cuts every slave from master *i*, while producers still reach it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.tcp_proxy import TcpProxy
from tests.conftest import BrokerProcess, NamesrvProcess, ask, free_port, wait_for
from txmq import Message
from txmq.broker.ha.epochs import EpochLog
from txmq.broker.store.commitlog import segment_paths
from txmq.protocol.peer import named_leader
from txmq.protocol.wire import (
    MASTER_ID,
    BrokerSetState,
    EpochEntry,
    GetBrokerRuntimeInfo,
    GetClusterInfo,
    GetReplicaInfo,
)
from txmq.protocol.wire.errors import BrokerUnavailable, ControllerNotLeader, TxmqError
from txmq.sync import Producer, PullConsumer

SET = "a"
SEGMENT = 1024 * 1024


@pytest.fixture
def replica_sets(
    tmp_path: Path, namesrv_process: Callable[..., NamesrvProcess]
) -> Iterator[Callable[..., ReplicaSet]]:
    """Factory: ``replica_sets(replication="sync", replicas=3, controllers=None,
    proxied=False, **broker_settings)`` starts a name server with the controller inside
    (``controllers``: a plain name server, the brokers heartbeating to those controllers)
    and a replicated broker set (``proxied``: behind TCP proxies, see the module's
    docstring); every broker still running at the end is SIGKILLed, then every proxy
    stopped."""
    made: list[ReplicaSet] = []

    def make(
        replication: str = "sync",
        *,
        replicas: int = 3,
        controllers: list[str] | None = None,
        proxied: bool = False,
        **settings: object,
    ) -> ReplicaSet:
        ns = namesrv_process("ns")
        if controllers is None:  # the controller inside the name server
            ns.args = ["--controller-store", str(tmp_path / "controller")]
        ns.start()
        env = {f"TXMQ_BROKER_{k.upper()}": str(v) for k, v in settings.items()}
        rs = ReplicaSet(
            tmp_path,
            ns,
            replication,
            n=replicas,
            env=env,
            controllers=list(controllers or []),
            proxied=proxied,
        )
        made.append(rs)
        return rs.start()

    yield make
    for rs in made:
        for b in rs.brokers.values():
            if b.alive():  # a paused one too (SIGKILL needs no SIGCONT)
                b.kill()
        rs.stop_proxies()


class Proxies:
    """Several proxies cut, black-holed and healed together (one broker's paths to each
    controller)."""

    def __init__(self, proxies: list[TcpProxy]) -> None:
        self.proxies = proxies

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.proxies]

    def cut(self) -> None:
        for p in self.proxies:
            p.cut()

    def blackhole(self) -> None:
        for p in self.proxies:
            p.blackhole()

    def heal(self) -> None:
        for p in self.proxies:
            p.heal()

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()


@dataclass
class ReplicaSet:
    """``n`` replicas of broker set ``a`` under the controller of ``namesrv``."""

    tmp: Path
    namesrv: NamesrvProcess
    replication: str = "sync"
    n: int = 3
    #: broker settings (TXMQ_BROKER_*) for every replica
    env: dict[str, str] = field(default_factory=dict)
    brokers: dict[int, BrokerProcess] = field(default_factory=dict)
    #: the replicas the test killed (and has not started again)
    killed: set[int] = field(default_factory=set)
    #: the controllers the brokers heartbeat to (empty: the one in the name server)
    controllers: list[str] = field(default_factory=list)
    #: every broker behind TCP proxies (see the module's docstring)
    proxied: bool = False
    #: (proxied) broker i's paths to the controllers: one proxy per controller address.
    #: (Controllers on etcd: a follower's answer names the leader's own address, which a
    #: broker then asks directly — past these proxies; with the controller in the name
    #: server, the default, there is one address and one path.)
    to_controller: dict[int, Proxies] = field(default_factory=dict)
    #: (proxied) the proxy in front of broker i's HA port: the only way slaves reach it
    ha_in: dict[int, TcpProxy] = field(default_factory=dict)

    @property
    def controller_addresses(self) -> list[str]:
        return self.controllers or [self.namesrv.address]

    def start(self) -> ReplicaSet:
        for i in range(self.n):
            controllers = self.controller_addresses
            extra: list[str] = []
            if self.proxied:
                self.to_controller[i] = Proxies(
                    [TcpProxy(a).start() for a in self.controller_addresses]
                )
                controllers = self.to_controller[i].addresses
                ha_port = free_port()  # (the same port on every restart)
                self.ha_in[i] = TcpProxy(f"127.0.0.1:{ha_port}").start()
                extra = ["--ha-port", str(ha_port), "--ha-advertised-address",
                         self.ha_in[i].address]  # fmt: skip
            self.brokers[i] = BrokerProcess(
                self.tmp / f"store-{SET}{i}",
                [
                    "--namesrv", self.namesrv.address, "--cluster", "C", "--broker-name", SET,
                    "--broker-id", str(i), "--replication", self.replication,
                    "--controller", ";".join(controllers),
                    "--segment-size", str(SEGMENT), *extra,
                ],
                self.tmp / f"{SET}{i}.log",
                env={"TXMQ_BROKER_MAX_MESSAGE_SIZE": str(64 * 1024), **self.env},
            )  # fmt: skip
            self.brokers[i].start()
        self.wait_healthy()
        return self

    def stop_proxies(self) -> None:
        for group in self.to_controller.values():
            group.stop()
        for proxy in self.ha_in.values():
            proxy.stop()

    def state(self) -> BrokerSetState | None:
        """The set as the (leading) controller sees it (None: it knows no set, or none
        leads now).  Asked with :func:`ask`, which a test may replace (TLS); a controller
        that does not lead names the leader, which is asked next (it may listen on an
        address the test did not give: a controller restarted on another port)."""
        order = list(self.controller_addresses)
        tried: set[str] = set()
        while order:
            address = order.pop(0)
            if address in tried:
                continue
            tried.add(address)
            try:
                info = ask(address, GetReplicaInfo(broker_name=SET))
            except ControllerNotLeader as exc:
                leader = named_leader(exc)
                if leader is not None:
                    order.insert(0, leader)
                continue
            except BrokerUnavailable:
                if len(self.controller_addresses) == 1:
                    raise
                continue
            return info.sets[0] if info.sets else None
        return None

    def master(self) -> int:
        """The master now (-1: none, an election runs)."""
        s = self.state()
        if s is None or s.electing or s.master_id < 0:
            return -1
        m = self.brokers.get(s.master_id)
        return s.master_id if m is not None and m.alive() else -1

    def wait_healthy(self, timeout: float = 60.0) -> int:
        """Until a master leads every other replica in its sync state set; its id."""

        def healthy() -> int | None:
            for i, b in self.brokers.items():  # none may die on its own (a master's death)
                if i not in self.killed and not b.alive():
                    raise AssertionError(f"broker {i} exited by itself:\n{b.output()[-3000:]}")
            s = self.state()
            if s is None or s.electing or s.master_id < 0:
                return None
            others = {i for i, b in self.brokers.items() if b.alive() and i != s.master_id}
            alive = {r.broker_id for r in s.replicas if r.alive}
            acting = {r.broker_id for r in s.replicas if r.master and r.alive}
            if not (others <= set(s.in_sync) and others | {s.master_id} <= alive):
                return None
            if acting != {s.master_id}:
                return None  # elected, but not told yet
            brokers = ask(self.namesrv.address, GetClusterInfo()).brokers
            if not any(b.addresses.get(MASTER_ID) for b in brokers):
                return None  # not registered as the master with the name server yet
            return s.master_id + 1  # (truthy for id 0 too)

        found: int = wait_for(healthy, timeout)
        return found - 1

    def kill(self, i: int) -> None:
        self.brokers[i].kill()
        self.killed.add(i)

    def restart(self, i: int) -> None:
        self.brokers[i].start()
        self.killed.discard(i)

    def runtime(self, i: int) -> tuple[int, int]:
        """(commit-log min offset, max offset) of replica ``i``."""
        info = ask(self.brokers[i].address, GetBrokerRuntimeInfo())
        return info.commit_log_min_offset, info.commit_log_max_offset

    def epochs(self, i: int) -> list[EpochEntry]:
        """Replica ``i``'s epoch history: from which commit-log offset each epoch's master
        wrote (``<store>/config/epochs.json``, read with the broker's own reader)."""
        return EpochLog(self.brokers[i].store / "config" / "epochs.json").entries

    def log_bytes(self, i: int, end: int) -> bytes:
        """Replica ``i``'s commit log from offset 0 up to ``end``."""
        out = bytearray()
        for path in segment_paths(self.brokers[i].store / "commitlog"):
            out += path.read_bytes()
            if len(out) >= end:
                break
        return bytes(out[:end])


@dataclass(frozen=True)
class Sample:
    """The controller's view of the set at one moment (monotonic)."""

    at: float
    epoch: int
    master_id: int
    electing: str


class StateWatch:
    """Samples the controller's view of the set (:meth:`ReplicaSet.state`) every
    ``interval`` seconds in a thread of its own until :meth:`stop`, to say afterwards when
    each epoch's master was first seen elected and when an election was seen running
    (moments seen, so at most ``interval`` plus one request after they happened)."""

    def __init__(self, rs: ReplicaSet, interval: float = 0.05) -> None:
        self.rs = rs
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="state-watch")

    def start(self) -> StateWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __enter__(self) -> StateWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(TxmqError, OSError):  # (no leader for a moment)
                s = self.rs.state()
                if s is not None:
                    sample = Sample(time.monotonic(), s.epoch, s.master_id, s.electing)
                    self.samples.append(sample)

    def elected_after(self, epoch: int) -> float | None:
        """When a master of an epoch above ``epoch`` was first seen (None: never)."""
        return next((s.at for s in list(self.samples) if s.epoch > epoch), None)

    def electing_seen(self, since: float) -> list[Sample]:
        """The samples since ``since`` that showed an election running."""
        return [s for s in list(self.samples) if s.at >= since and s.electing]


@dataclass
class Sender:
    """Producers (one per thread) that send numbered messages to ``topic`` until stopped,
    each number once (``retry_times=0``: a send that fails is not sent again, so nothing
    acknowledged can be stored twice by a retry)."""

    namesrv: str
    topic: str
    threads: int = 4
    send_timeout: float = 5.0
    #: the producers' stall_check_s (None: a send waits for its answer or its timeout)
    stall_check_s: float | None = 0.5
    acked: dict[int, str] = field(default_factory=dict)
    #: numbers answered but not safe (SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT), or failed
    unsafe: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    #: (when its send began, monotonic; number) of every acknowledgement
    times: list[tuple[float, int]] = field(default_factory=list)
    #: (began, answered, number) of every acknowledgement
    spans: list[tuple[float, float, int]] = field(default_factory=list)
    #: number -> the commit-log offset its acknowledgement named (``offset_msg_id``)
    offsets: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Sender:
        for t in range(self.threads):
            worker = threading.Thread(target=self._run, args=(t,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def _run(self, t: int) -> None:
        n = t
        with Producer(
            namesrv=self.namesrv,
            retry_times=0,
            send_timeout=self.send_timeout,
            stall_check_s=self.stall_check_s,
        ) as producer:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    r = producer.send(Message(self.topic, str(n).encode(), keys=[str(n)]))
                except TxmqError:
                    with self._lock:
                        self.failed.add(n)
                    time.sleep(0.02)
                else:
                    with self._lock:
                        if r.status == "SEND_OK":
                            self.acked[n] = r.msg_id
                            self.times.append((began, n))
                            self.spans.append((began, time.monotonic(), n))
                            self.offsets[n] = int(r.offset_msg_id, 16)
                        else:
                            self.unsafe.add(n)
                n += self.threads

    def acked_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def acked_since(self, moment: float) -> bool:
        """Whether a send that began after ``moment`` was acknowledged."""
        with self._lock:
            return any(t > moment for t, _ in self.times[-50:])

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)


def consume_all(
    namesrv: str,
    topic: str,
    group: str = "jepsen-check",
    body: Callable[[bytes], Any] = int,
) -> Counter[Any]:
    """Every message of ``topic`` in the set's consume queues, read from the master: how
    many times each body (``body(bytes)``: a number by default) is there."""
    seen: Counter[Any] = Counter()
    with PullConsumer(namesrv=namesrv, group=group) as consumer:
        for mq in consumer.message_queues(topic, refresh=True):
            offset = 0
            while True:
                res = consumer.pull(
                    topic, mq.queue_id, offset, max_msgs=512, long_poll=0,
                    broker_name=mq.broker_name,
                )  # fmt: skip
                if not res.messages:
                    break
                seen.update(body(m.body) for m in res.messages)
                offset = res.next_offset
    return seen
