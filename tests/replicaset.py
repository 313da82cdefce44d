"""A replicated broker set on real processes, for the failover tests: a name server with
the controller inside, and a master and slaves (``txmq broker start --controller``) that
the tests SIGKILL and start again; producers that send numbered messages and remember
which were acknowledged; the checks made afterwards."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import BrokerProcess, NamesrvProcess, ask, wait_for
from txmq import Message
from txmq.broker.store.commitlog import segment_paths
from txmq.protocol.peer import NoController, ask_controller
from txmq.protocol.wire import (
    MASTER_ID,
    BrokerSetState,
    GetBrokerRuntimeInfo,
    GetClusterInfo,
    GetReplicaInfo,
)
from txmq.protocol.wire.errors import TxmqError
from txmq.sync import Producer, PullConsumer

SET = "a"
SEGMENT = 1024 * 1024


@pytest.fixture
def replica_sets(
    tmp_path: Path, namesrv_process: Callable[..., NamesrvProcess]
) -> Iterator[Callable[..., ReplicaSet]]:
    """Factory: ``replica_sets(replication="sync", replicas=3, controllers=None,
    **broker_settings)`` starts a name server with the controller inside (``controllers``:
    a plain name server, the brokers heartbeating to those controllers) and a replicated
    broker set; every broker still running at the end is SIGKILLed."""
    made: list[ReplicaSet] = []

    def make(
        replication: str = "sync",
        *,
        replicas: int = 3,
        controllers: list[str] | None = None,
        **settings: object,
    ) -> ReplicaSet:
        ns = namesrv_process("ns")
        if controllers is None:  # the controller inside the name server
            ns.args = ["--controller-store", str(tmp_path / "controller")]
        ns.start()
        env = {f"TXMQ_BROKER_{k.upper()}": str(v) for k, v in settings.items()}
        rs = ReplicaSet(
            tmp_path, ns, replication, n=replicas, env=env, controllers=list(controllers or [])
        )
        made.append(rs)
        return rs.start()

    yield make
    for rs in made:
        for b in rs.brokers.values():
            if b.alive():
                b.kill()


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

    @property
    def controller_addresses(self) -> list[str]:
        return self.controllers or [self.namesrv.address]

    def start(self) -> ReplicaSet:
        for i in range(self.n):
            self.brokers[i] = BrokerProcess(
                self.tmp / f"store-{SET}{i}",
                [
                    "--namesrv", self.namesrv.address, "--cluster", "C", "--broker-name", SET,
                    "--broker-id", str(i), "--replication", self.replication,
                    "--controller", ";".join(self.controller_addresses),
                    "--segment-size", str(SEGMENT),
                ],
                self.tmp / f"{SET}{i}.log",
                env={"TXMQ_BROKER_MAX_MESSAGE_SIZE": str(64 * 1024), **self.env},
            )  # fmt: skip
            self.brokers[i].start()
        self.wait_healthy()
        return self

    def state(self) -> BrokerSetState | None:
        """The set as the (leading) controller sees it (None: it knows no set, or none
        leads now)."""
        try:
            _, info = anyio.run(
                lambda: ask_controller(
                    self.controller_addresses, GetReplicaInfo(broker_name=SET), 5.0
                )
            )
        except NoController:
            return None
        return info.sets[0] if info.sets else None

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

    def log_bytes(self, i: int, end: int) -> bytes:
        """Replica ``i``'s commit log from offset 0 up to ``end``."""
        out = bytearray()
        for path in segment_paths(self.brokers[i].store / "commitlog"):
            out += path.read_bytes()
            if len(out) >= end:
                break
        return bytes(out[:end])


@dataclass
class Sender:
    """Producers (one per thread) that send numbered messages to ``topic`` until stopped,
    each number once (``retry_times=0``: a send that fails is not sent again, so nothing
    acknowledged can be stored twice by a retry)."""

    namesrv: str
    topic: str
    threads: int = 4
    send_timeout: float = 5.0
    acked: dict[int, str] = field(default_factory=dict)
    #: numbers answered but not safe (SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT), or failed
    unsafe: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    #: (when its send began, monotonic; number) of every acknowledgement
    times: list[tuple[float, int]] = field(default_factory=list)
    #: (began, answered, number) of every acknowledgement
    spans: list[tuple[float, float, int]] = field(default_factory=list)
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
            namesrv=self.namesrv, retry_times=0, send_timeout=self.send_timeout
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
