"""Failover time of a replicated broker set under faults: time until sends succeed again.

    python bench/failover_bench.py [--faults kill,pause,isolate,slave-cut,ctl-kill]
                                   [--kills 10] [--replication sync|async] [--threads 4]
                                   [--send-timeout 3] [--partition blackhole|cut]
                                   [--heal-after 8] [--broker-setting NAME=VALUE ...]
                                   [--cost-messages 20000] [--seed 18] [--json out.json]
                                   [--keep]   # keep the logs and stores (printed path)

For each fault kind of ``--faults`` (all five by default), one run starts, as a user would
(real processes, free ports, stores in a temporary folder, every setting at its default
unless ``--broker-setting`` says otherwise): a name server with the controller inside
(``txmq namesrv start --controller-store``) and one broker set of three brokers (``txmq
broker start --namesrv NS --cluster bench --broker-name failover --broker-id 0|1|2
--replication sync|async --controller NS``), topic ``failover`` with 4 queues.  For the
partitions (``isolate``, ``slave-cut``) every broker reaches the controller through a TCP
proxy of its own and its HA port only through a proxy in front of it (``--ha-port``, and
``--ha-advertised-address`` naming the proxy); producers and the name server reach the
brokers directly.  The proxy is ``bench/tcp_proxy.py`` (the tests use the same one).
For ``ctl-kill`` the controllers are not in the name server: a three-member etcd cluster
(``bench/etcd_cluster.py``; Debian's ``etcd-server``, else the kind is skipped) in the
run's folder, three controllers on it (``txmq controller start --etcd E1,E2,E3 --port P``,
each on a port of its own kept across restarts), a name server without a controller, and
brokers given all three (``--controller 'C1;C2;C3'``, not proxied); the bench reads the
view of whichever controller leads (a follower's refusal names the leader).

``--threads`` producers (``txmq.sync.Producer(namesrv=NS, retry_times=0)``, one per
thread) send numbered messages through the name server without a pause: each number is
sent once (a failed send is not retried, so nothing acknowledged can be stored twice by a
retry); the bench remembers when each send began, when it was acknowledged (status
SEND_OK; a SYNC_MASTER's SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT counts as not
acknowledged, "unsafe") and the commit-log offset the acknowledgement names.

Then ``--kills`` times per kind: wait until the set is whole (the controller names a master
and every other replica is alive and in its sync state set) and a send was acknowledged
since, wait a random 0-1 s (``--seed``), make the fault, and measure

- **elected**: fault -> the controller names another master (``GetReplicaInfo`` polled
  every 20 ms; of the leading controller);
- **failover**: fault -> the first acknowledgement, *by the new master*, of a send that
  *began* after the fault (the issue's failover time; goal p50 under 3 s, max under 5 s).
  "By the new master": its commit-log offset is at or past where the new master's epoch
  begins (its ``config/epochs.json``) — an old master still reachable (paused, isolated)
  must not be counted;

then undo the fault and time until the set is whole again.  The kinds:

- ``kill``: SIGKILL the master (by PID); afterwards start it again on its store (it rejoins
  as a slave, cutting any tail the new master never had).
- ``pause``: SIGSTOP the master past its lease (until the failover is measured); then
  SIGCONT (it learns it was deposed and rejoins as a slave).
- ``isolate``: the master's path to the controller and the slaves' paths to its HA port
  black-holed (``--partition blackhole``: nothing delivered, nothing closed) or cut
  (``cut``: connections closed, new ones reset), producers still reaching it; healed once
  the failover is measured (it rejoins as a slave).
- ``slave-cut``: one in-sync slave's path to the controller black-holed or cut until the
  controller counts it dead (its heartbeat time-out; it still copies, so it stays in the
  sync state set), then SIGKILL the master; the slave's path heals ``--heal-after`` s
  after the kill, or as soon as the failover is measured if that is earlier (an election
  that waits for every in-sync slave to report waits that long); the master is started
  again.
- ``ctl-kill``: the controller leader killed mid-election.  SIGKILL the master (the
  fault's moment), poll the leading controller's view every 20 ms until it shows the
  election running, and SIGKILL the controller that leads (the one answering
  ``GetReplicaInfo`` rather than ControllerNotLeader) at once: another controller takes
  over from etcd, where the dead master is still the master, and elects.  (If the view
  shows a new master already, the controller kill came too late: it is still made, and
  the fault says so.)  The per-fault line says how long after the master's kill the
  controller died.  Afterwards the master is started again on its store and the
  controller on its port.

At the end of each kind the producers stop, the replicas' commit logs converge, and every
message of the topic is read from the final master (pull through the name server):
**lost** = acknowledged numbers that are not there, each charged to the first fault after
its acknowledgement; **duplicates** = numbers stored more than once.  A SYNC_MASTER must
lose nothing; an ASYNC_MASTER loses what its slaves had not copied when it died.  Every
process (brokers, name server, controllers, etcd members) is stopped by PID, every proxy
stopped, and the temporary folder (stores, logs, etcd data) removed unless ``--keep``.

Last (``--cost-messages``, SYNC only), what the default election rule costs:
``bench/replication_bench.py --scenarios cf`` in the same run — produce throughput and
latency of a SYNC set with one ack (``all_ack_in_sync = false``) against every in-sync
slave's (the default), alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Node, free_port, machine_info  # noqa: E402
from bench.etcd_cluster import EtcdCluster, etcd_available, start_cluster_in  # noqa: E402
from bench.replicas import (  # noqa: E402
    BrokerSet,
    ask,
    commit_log_end,
    consume_all,
    controller_node,
    create_topic,
    git_head,
    namesrv_node,
    plain_namesrv_node,
)
from bench.tcp_proxy import TcpProxy  # noqa: E402

SET = "failover"
TOPIC = "failover"
KINDS = ("kill", "pause", "isolate", "slave-cut", "ctl-kill")
#: the kinds that need the proxies
PARTITIONS = ("isolate", "slave-cut")
#: the kind with three controllers on etcd, the leading one killed mid-election
CTL_KILL = "ctl-kill"
#: how long the bench waits for the election to show, and for a controller to lead
CTL_WAIT_S = 30.0
#: the goal (issue 32): failover p50 and max, seconds
GOAL_P50_S, GOAL_MAX_S = 3.0, 5.0
#: how long one fault may take to fail over before the bench gives up
FAULT_TIMEOUT_S = 60.0

EXAMPLES = """\
examples:
  python bench/failover_bench.py                          # every kind, 10 faults each
  python bench/failover_bench.py --faults kill,pause      # only these kinds
  python bench/failover_bench.py --faults isolate --partition cut --kills 20
  python bench/failover_bench.py --faults slave-cut --heal-after 12 --json out.json
  python bench/failover_bench.py --broker-setting all_ack_in_sync=false  # the one-ack rule
  python bench/failover_bench.py --replication async --kills 3 --keep
  python bench/failover_bench.py --faults pause --kills 3 --cost-messages 0   # no cost run
  python bench/failover_bench.py --faults ctl-kill --kills 5   # controllers on etcd (needs etcd)
"""


@dataclass
class Sender:
    """Producer threads sending numbered messages, each number once (``retry_times=0``)."""

    namesrv: str
    threads: int = 4
    send_timeout: float = 3.0
    #: number -> (when its send began, when it was acknowledged), monotonic
    acked: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: (began, acknowledged, number, commit-log offset) in the order they were recorded
    ack_log: list[tuple[float, float, int, int]] = field(default_factory=list)
    unsafe: set[int] = field(default_factory=set)  # SLAVE_NOT_AVAILABLE / FLUSH_SLAVE_TIMEOUT
    failed: set[int] = field(default_factory=set)  # an exception (not stored, or unknown)
    errors: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Sender:
        for t in range(self.threads):
            worker = threading.Thread(target=self._run, args=(t,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def _run(self, t: int) -> None:
        from txmq import Message
        from txmq.protocol.wire.errors import TxmqError
        from txmq.sync import Producer

        n = t
        with Producer(
            namesrv=self.namesrv, retry_times=0, send_timeout=self.send_timeout
        ) as producer:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    r = producer.send(Message(TOPIC, str(n).encode(), keys=[str(n)]))
                except TxmqError as exc:
                    with self._lock:
                        self.failed.add(n)
                        kind = type(exc).__name__
                        self.errors[kind] = self.errors.get(kind, 0) + 1
                    time.sleep(0.02)
                else:
                    done = time.monotonic()
                    with self._lock:
                        if r.status == "SEND_OK":
                            self.acked[n] = (began, done)
                            self.ack_log.append((began, done, n, int(r.offset_msg_id, 16)))
                        else:
                            self.unsafe.add(n)
                            self.errors[r.status] = self.errors.get(r.status, 0) + 1
                n += self.threads

    def count(self) -> int:
        with self._lock:
            return len(self.ack_log)

    def more_than(self, count: int) -> bool:
        return self.count() > count

    def first_ack_after(
        self, moment: float, since: int, *, min_offset: int = 0, not_before: float = 0.0
    ) -> float | None:
        """The earliest acknowledgement, at ``not_before`` or later, of a send that began
        after ``moment`` and was stored at ``min_offset`` or later, among those recorded
        from index ``since`` on (None: none yet)."""
        with self._lock:
            times = [
                done
                for began, done, _, offset in self.ack_log[since:]
                if began > moment and offset >= min_offset and done >= not_before
            ]
        return min(times) if times else None

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)


class Paths:
    """The TCP proxies of one broker: to each controller, and in front of its HA port."""

    def __init__(self, controller: str, ha_port: int) -> None:
        self.to_controller = TcpProxy(controller).start()
        self.ha_in = TcpProxy(f"127.0.0.1:{ha_port}").start()

    def stop(self) -> None:
        self.to_controller.stop()
        self.ha_in.stop()


class ProxiedBrokerSet(BrokerSet):
    """A :class:`BrokerSet` whose brokers reach the controller through a proxy each
    (``--controller`` names it) and whose HA ports are reached only through a proxy each
    (a free ``--ha-port``, kept across restarts, and ``--ha-advertised-address``)."""

    def __init__(
        self,
        tmp: Path,
        namesrv: str,
        name: str,
        replicas: int = 3,
        replication: str = "sync",
        *,
        log_level: str = "WARNING",
    ) -> None:
        super().__init__(tmp, namesrv, name, replicas, replication, log_level=log_level)
        self.paths: dict[int, Paths] = {}
        for i, node in self.nodes.items():
            port = free_port()
            paths = self.paths[i] = Paths(self.namesrv, port)
            at = node.argv.index("--controller")
            node.argv[at + 1] = paths.to_controller.address
            node.argv += ["--ha-port", str(port)]
            node.argv += ["--ha-advertised-address", paths.ha_in.address]

    def stop(self) -> None:
        super().stop()
        for paths in self.paths.values():
            paths.stop()


class Controllers:
    """``ctl-kill``'s controllers: three ``txmq controller start --etcd`` processes on a
    three-member etcd cluster of their own (in ``tmp/etcd<n>/``), each on a port of its own
    that it keeps across restarts (the brokers were given those three addresses)."""

    def __init__(self, tmp: Path, log_level: str = "INFO", election_ms: int = 500) -> None:
        self.tmp = tmp
        self.log_level = log_level
        self.election_ms = election_ms
        self.etcd: EtcdCluster | None = None
        self.nodes: list[Node] = []

    def start(self) -> list[str]:
        """Start etcd, then the controllers; their addresses once each listens."""
        heartbeat_ms = max(self.election_ms // 10, 10)  # etcd's advice: a tenth
        self.etcd = start_cluster_in(
            self.tmp, 3, heartbeat_ms=heartbeat_ms, election_ms=self.election_ms
        )
        endpoints = self.etcd.endpoints
        for i in range(3):  # each reaches another etcd member first, as on three machines
            order = ",".join(endpoints[i:] + endpoints[:i])
            self.nodes.append(controller_node(self.tmp, f"ctl{i}", order, self.log_level))
        for node in self.nodes:
            node.start()
        return [node.wait_ready() for node in self.nodes]

    def pids(self) -> str:
        assert self.etcd is not None
        ctl = ", ".join(f"{n.name}={n.pid}" for n in self.nodes)
        etcd = ", ".join(f"{m.name}={self.etcd.pid(i)}" for i, m in enumerate(self.etcd.members))
        return f"controllers {ctl}; etcd {etcd}"

    def leading(self) -> int | None:
        """The index of the controller that answers as the leader now (None: none does)."""
        from txmq.protocol.wire import GetReplicaInfo
        from txmq.protocol.wire.errors import TxmqError

        for i, node in enumerate(self.nodes):
            if not node.alive():
                continue
            try:
                ask(node.address, GetReplicaInfo(broker_name=SET), timeout=2.0)
            except TxmqError:  # ControllerNotLeader, or no answer
                continue
            return i
        return None

    def restart(self, i: int) -> str:
        """Start controller ``i`` again after its kill, on its port (if another process
        took that port meanwhile, on a new one: the brokers learn it once it is named
        leader to them)."""
        node = self.nodes[i]
        try:
            return node.start().wait_ready()
        except RuntimeError as exc:
            print(f"{node.name}: not started again on port {node.port}, on a new one: {exc}")
            node.port = 0
            return node.start().wait_ready()

    def stop(self) -> None:
        """SIGTERM every controller (SIGKILL if it hangs), then SIGKILL every etcd member,
        all by PID.  Their folders are in the run's, removed with it."""
        for node in self.nodes:
            node.stop()
        if self.etcd is not None:
            self.etcd.stop_all()


@dataclass
class Fault:
    kind: str
    number: int
    master: int  # broker id of the master at the fault
    at: float  # monotonic
    acked_before: int
    #: slave-cut: the slave cut from the controller
    slave: int = -1
    new_master: int = -1
    new_epoch: int = -1
    elected_s: float = float("nan")
    failover_s: float = float("nan")
    whole_again_s: float = float("nan")  # undone -> the set is whole again
    #: slave-cut: fault -> the slave's path healed
    healed_s: float = float("nan")
    #: ctl-kill: the controller killed (its index), and the master's kill -> its kill
    controller: int = -1
    ctl_killed_s: float = float("nan")
    #: ctl-kill: the controllers' view showed a new master before the controller's kill
    #: (the kill came too late to be mid-election)
    ctl_late: bool = False
    lost: int = 0
    #: how long before the fault the oldest lost message was acknowledged
    lost_span_s: float = 0.0


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout}s")
        time.sleep(0.02)


def _signal(bs: BrokerSet, i: int, sig: signal.Signals) -> None:
    proc = bs.nodes[i].proc
    assert proc is not None and proc.poll() is None, f"broker {i} is not running"
    proc.send_signal(sig)


def _epoch_start(tmp: Path, broker: int, epoch: int) -> int | None:
    """Where ``epoch`` begins in broker ``broker``'s commit log, once it wrote so in its
    epoch history (None: not yet)."""
    from txmq.broker.ha.epochs import EpochLog

    path = tmp / f"store-{SET}{broker}" / "config" / "epochs.json"
    if not path.exists():
        return None
    entries = EpochLog(path).entries
    return next((e.start for e in entries if e.epoch == epoch), None)


def _in_sync_slave_silent(bs: BrokerSet, slave: int) -> bool:
    s = bs.state()
    if s is None:
        return False
    dead = any(r.broker_id == slave and not r.alive for r in s.replicas)
    return dead and slave in s.in_sync


def _partition(proxy: TcpProxy, how: str) -> None:
    if how == "cut":
        proxy.cut()
    else:
        proxy.blackhole()


def _kill_leading_controller(fault: Fault, bs: BrokerSet, ctls: Controllers, epoch: int) -> None:
    """``ctl-kill``, the master dead since ``fault.at`` (it was the master of ``epoch``):
    as soon as the leading controller's view shows the election running (polled every
    20 ms), SIGKILL the controller that leads.  A view showing a new master already is
    recorded (elected, too late for mid-election), and the controller killed still."""
    deadline = fault.at + CTL_WAIT_S
    while True:
        s = bs.state()
        if s is not None and s.electing:
            break
        if s is not None and s.epoch > epoch and s.master_id not in (-1, fault.master):
            fault.ctl_late = True
            fault.new_master, fault.new_epoch = s.master_id, s.epoch
            fault.elected_s = time.monotonic() - fault.at
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no election seen within {CTL_WAIT_S:.0f} s of the master's kill")
        time.sleep(0.02)
    lead = ctls.leading()
    while lead is None:  # (the one that answered a moment ago may be between two leases)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no controller led within {CTL_WAIT_S:.0f} s")
        time.sleep(0.02)
        lead = ctls.leading()
    ctls.nodes[lead].kill()
    fault.controller = lead
    fault.ctl_killed_s = time.monotonic() - fault.at


def _inflict(
    fault: Fault,
    bs: BrokerSet,
    args: argparse.Namespace,
    rng: random.Random,
    ctls: Controllers | None = None,
) -> None:
    """Make the fault (``fault.at``: when it happened; ``ctl-kill``: the master's kill)."""
    old = fault.master
    if fault.kind == CTL_KILL:
        assert ctls is not None
        s = bs.state()
        assert s is not None, "the controllers know no broker set"
        bs.nodes[old].kill()
        fault.at = time.monotonic()
        _kill_leading_controller(fault, bs, ctls, s.epoch)
        return
    if fault.kind == "kill":
        bs.nodes[old].kill()
    elif fault.kind == "pause":
        _signal(bs, old, signal.SIGSTOP)
    elif fault.kind == "isolate":
        assert isinstance(bs, ProxiedBrokerSet)
        _partition(bs.paths[old].to_controller, args.partition)
        _partition(bs.paths[old].ha_in, args.partition)
    else:  # slave-cut
        assert isinstance(bs, ProxiedBrokerSet)
        fault.slave = rng.choice(sorted(i for i in bs.nodes if i != old))
        _partition(bs.paths[fault.slave].to_controller, args.partition)
        _wait(
            functools.partial(_in_sync_slave_silent, bs, fault.slave),
            30,
            f"the controller to count slave {fault.slave} dead while in sync",
        )
        bs.nodes[old].kill()
    fault.at = time.monotonic()


def _heal_slave(fault: Fault, bs: BrokerSet) -> None:
    if fault.kind == "slave-cut" and math.isnan(fault.healed_s):  # (not healed yet)
        assert isinstance(bs, ProxiedBrokerSet)
        bs.paths[fault.slave].to_controller.heal()
        fault.healed_s = time.monotonic() - fault.at


def _measure(
    fault: Fault, bs: BrokerSet, sender: Sender, args: argparse.Namespace, tmp: Path
) -> None:
    """Until a new master is elected and acknowledged a send that began after the fault:
    an acknowledgement read after the new master was seen elected, of a record at or past
    the start of its epoch (an old master still running — an ASYNC_MASTER isolated but
    inside its lease — may acknowledge sends that began after the fault, before the
    election; those are not the new master's)."""
    deadline = fault.at + FAULT_TIMEOUT_S
    start: int | None = None
    # (ctl-kill: the new master may have been seen while the controller was being killed)
    elected_at = fault.at + fault.elected_s if fault.new_master >= 0 else 0.0
    while time.monotonic() < deadline:
        now = time.monotonic()
        if fault.kind == "slave-cut" and now - fault.at >= args.heal_after:
            _heal_slave(fault, bs)
        if fault.new_master < 0:
            s = bs.state()
            if s is not None and not s.electing and s.master_id not in (-1, fault.master):
                fault.new_master, fault.new_epoch = s.master_id, s.epoch
                elected_at = time.monotonic()
                fault.elected_s = elected_at - fault.at
        if fault.new_master >= 0 and start is None:
            start = _epoch_start(tmp, fault.new_master, fault.new_epoch)
        if start is not None:
            first = sender.first_ack_after(
                fault.at, fault.acked_before, min_offset=start, not_before=elected_at
            )
            if first is not None:
                fault.failover_s = first - fault.at
                return
        time.sleep(0.02)
    raise TimeoutError(
        f"{fault.kind} {fault.number}: no acknowledged send on a new master within "
        f"{FAULT_TIMEOUT_S:.0f} s"
    )


def _undo(fault: Fault, bs: BrokerSet, ctls: Controllers | None = None) -> None:
    old = fault.master
    if fault.kind in ("kill", "slave-cut", CTL_KILL):
        _heal_slave(fault, bs)
        bs.nodes[old].start().wait_ready()
        if fault.kind == CTL_KILL and fault.controller >= 0:
            assert ctls is not None
            ctls.restart(fault.controller)
    elif fault.kind == "pause":
        _signal(bs, old, signal.SIGCONT)
    else:  # isolate
        assert isinstance(bs, ProxiedBrokerSet)
        bs.paths[old].to_controller.heal()
        bs.paths[old].ha_in.heal()


def run_kind(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    """``args.kills`` faults of one kind on a broker set of its own."""
    rng = random.Random(f"{args.seed}-{kind}")
    tmp.mkdir()
    # ctl-kill: controllers of their own on etcd, the name server without one
    ns = plain_namesrv_node(tmp, "INFO") if kind == CTL_KILL else namesrv_node(tmp, "INFO")
    ctls: Controllers | None = None
    bs: BrokerSet | None = None
    sender: Sender | None = None
    faults: list[Fault] = []
    try:
        controllers: list[str] | None = None
        if kind == CTL_KILL:
            ctls = Controllers(tmp, log_level="INFO", election_ms=args.etcd_election_ms)
            controllers = ctls.start()
        namesrv = ns.start().wait_ready()
        if kind in PARTITIONS:
            bs = ProxiedBrokerSet(tmp, namesrv, SET, 3, args.replication, log_level="INFO")
        else:
            bs = BrokerSet(
                tmp, namesrv, SET, 3, args.replication, log_level="INFO", controllers=controllers
            )
        bs.start()
        master = bs.wait_healthy()
        asyncio.run(create_topic(namesrv, TOPIC, SET))
        pids = ", ".join(f"{n.name}={n.pid}" for n in bs.nodes.values())
        if ctls is not None:
            pids += f"; {ctls.pids()}"
        proxied = " behind proxies" if kind in PARTITIONS else ""
        print(f"{kind}: {args.replication} set whole{proxied}, master {master}; {pids}", flush=True)
        sender = Sender(namesrv, args.threads, args.send_timeout).start()
        t_start = time.monotonic()
        for k in range(args.kills):
            master = bs.wait_healthy(timeout=120)
            _wait(functools.partial(sender.more_than, sender.count()), 60, "an acknowledgement")
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment while messages flow
            fault = Fault(kind, k + 1, master, time.monotonic(), sender.count())
            _inflict(fault, bs, args, rng, ctls)
            try:
                _measure(fault, bs, sender, args, tmp)
            finally:
                undone = time.monotonic()
                _undo(fault, bs, ctls)
            bs.wait_healthy(timeout=120)
            fault.whole_again_s = time.monotonic() - undone
            faults.append(fault)
            extra = ""
            if kind == "slave-cut":
                extra = f" (slave {fault.slave} cut, healed after {fault.healed_s:.2f} s)"
            elif kind == CTL_KILL:
                when = "too late: a new master was elected" if fault.ctl_late else "mid-election"
                extra = (
                    f" (leading controller ctl{fault.controller} killed "
                    f"{fault.ctl_killed_s:.2f} s after the master, {when})"
                )
            print(
                f"{kind} {fault.number}: master {fault.master} -> {fault.new_master}{extra}: "
                f"elected after {fault.elected_s:.2f} s, first acknowledged send on it after "
                f"{fault.failover_s:.2f} s; whole again {fault.whole_again_s:.2f} s after "
                "the fault was undone",
                flush=True,
            )
        time.sleep(1.0)  # some acknowledgements on the last master too
        sender.stop()
        elapsed = time.monotonic() - t_start
        master = bs.wait_healthy(timeout=120)
        end = commit_log_end(bs.nodes[master].address)
        _wait(
            lambda: all(commit_log_end(n.address) == end for n in bs.nodes.values()),
            60,
            "the replicas' commit logs to converge",
        )
        seen = consume_all(namesrv, TOPIC)
        return _result(kind, sender, faults, seen, master, elapsed)
    finally:
        if sender is not None:
            sender.stop()
        if bs is not None:
            for i, node in bs.nodes.items():  # a paused broker cannot stop: go on first
                if node.alive():
                    _signal(bs, i, signal.SIGCONT)
            bs.stop()  # (before the controllers: a stopping master hands over through them)
        ns.stop()
        if ctls is not None:
            ctls.stop()


def run(args: argparse.Namespace) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="txmq-failoverbench-"))
    for setting in args.broker_setting:
        name, _, value = setting.partition("=")
        os.environ[f"TXMQ_BROKER_{name.upper()}"] = value  # the brokers started here
    keep = args.keep
    try:
        kinds = {}
        for kind in args.faults:
            if kind == CTL_KILL and not etcd_available():
                print(f"{kind}: skipped: etcd not found (apt-get install etcd-server)", flush=True)
                continue
            kinds[kind] = run_kind(kind, args, tmp / kind)
    except BaseException:
        keep = True  # a run that failed keeps its evidence
        raise
    finally:
        if keep:
            print(f"logs and stores kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"replication": args.replication, "kinds": kinds}


def _result(
    kind: str,
    sender: Sender,
    faults: list[Fault],
    seen: dict[bytes, int],
    master: int,
    elapsed: float,
) -> dict[str, object]:
    numbers = {int(body): c for body, c in seen.items()}
    lost = sorted(n for n in sender.acked if n not in numbers)
    dups = sorted(n for n, c in numbers.items() if c > 1)
    moments = [f.at for f in faults]
    after_last = 0
    for n in lost:  # charged to the first fault after the acknowledgement
        acked_at = sender.acked[n][1]
        i = bisect.bisect_left(moments, acked_at)
        if i < len(faults):
            faults[i].lost += 1
            faults[i].lost_span_s = max(faults[i].lost_span_s, faults[i].at - acked_at)
        else:
            after_last += 1
    stored_unacked = sum(1 for n in numbers if n in sender.failed or n in sender.unsafe)
    return {
        "kind": kind,
        "faults": [asdict(f) for f in faults],
        "acknowledged": len(sender.acked),
        "unsafe": len(sender.unsafe),
        "failed": len(sender.failed),
        "errors": dict(sorted(sender.errors.items())),
        "stored": sum(numbers.values()),
        "stored_not_acknowledged": stored_unacked,
        "lost": len(lost),
        "lost_after_last_fault": after_last,
        "lost_sample": lost[:20],
        "duplicates": len(dups),
        "duplicate_sample": dups[:20],
        "final_master": master,
        "seconds": elapsed,
    }


def _goal(fo: list[float]) -> str:
    p50, top = statistics.median(fo), fo[-1]
    met = p50 < GOAL_P50_S and top < GOAL_MAX_S
    return "met" if met else "NOT met"


def report(res: dict[str, object]) -> str:
    kinds = res["kinds"]
    assert isinstance(kinds, dict)
    mode = "SYNC_MASTER" if res["replication"] == "sync" else "ASYNC_MASTER"
    out = [
        f"{mode} + 2 slaves; goal: failover p50 < {GOAL_P50_S:g} s and max < "
        f"{GOAL_MAX_S:g} s for every kind",
        "",
        "| fault | faults | failover p50 s | failover max s | goal | elected p50 / max s "
        "| whole again p50 / max s | acknowledged | lost | duplicates | unsafe / failed sends |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for kind, r in kinds.items():
        faults = r["faults"]
        fo = sorted(f["failover_s"] for f in faults)
        el = sorted(f["elected_s"] for f in faults)
        wh = sorted(f["whole_again_s"] for f in faults)
        out.append(
            f"| {kind} | {len(faults)} | {statistics.median(fo):.2f} | {fo[-1]:.2f} "
            f"| {_goal(fo)} | {statistics.median(el):.2f} / {el[-1]:.2f} "
            f"| {statistics.median(wh):.2f} / {wh[-1]:.2f} | {r['acknowledged']:,} "
            f"| {r['lost']} | {r['duplicates']} | {r['unsafe']} / {r['failed']} |"
        )
        lines += [
            f"{kind}: failover per fault (s): "
            + " · ".join(f"{f['failover_s']:.2f}" for f in faults),
            f"{kind}: lost per fault, acknowledged within how long before it (s): "
            + " · ".join(f"{f['lost']} ({f['lost_span_s']:.2f})" for f in faults),
            f"{kind}: send errors and unsafe answers: {r['errors']}; stored but not "
            f"acknowledged: {r['stored_not_acknowledged']}; lost after the last fault: "
            f"{r['lost_after_last_fault']}",
        ]
        if kind == CTL_KILL:
            late = sum(1 for f in faults if f["ctl_late"])
            lines.append(
                f"{kind}: leading controller killed after the master (s): "
                + " · ".join(f"{f['ctl_killed_s']:.2f}" for f in faults)
                + f"; too late (a new master elected already): {late}"
            )
    return "\n".join([*out, "", *lines])


def _faults(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in KINDS]
    if wrong or not kinds:
        raise argparse.ArgumentTypeError(
            f"{', '.join(wrong) or 'nothing'}: the fault kinds are {', '.join(KINDS)}"
        )
    return list(dict.fromkeys(kinds))


def _setting(text: str) -> str:
    name, eq, _ = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--faults",
        type=_faults,
        default=list(KINDS),
        help=f"fault kinds, comma-separated (default: all, {','.join(KINDS)})",
    )
    ap.add_argument("--kills", type=int, default=10, help="faults of each kind (default 10)")
    ap.add_argument("--replication", choices=("sync", "async"), default="sync")
    ap.add_argument("--threads", type=int, default=4, help="producer threads")
    ap.add_argument("--send-timeout", type=float, default=3.0, help="the producer's default")
    ap.add_argument(
        "--partition",
        choices=("blackhole", "cut"),
        default="blackhole",
        help="isolate, slave-cut: drop everything, closing nothing (default), or close the "
        "connections and reset new ones",
    )
    ap.add_argument(
        "--heal-after",
        type=float,
        default=8.0,
        help="slave-cut: heal the slave's path this many seconds after the master's kill "
        "(at the latest; default 8)",
    )
    ap.add_argument(
        "--broker-setting",
        type=_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a broker setting for every broker (TXMQ_BROKER_NAME=VALUE), e.g. "
        "all_ack_in_sync=false; repeatable",
    )
    ap.add_argument(
        "--etcd-election-ms",
        type=int,
        default=500,
        help="ctl-kill: etcd's --election-timeout (default 500, with a heartbeat of a tenth: "
        "what the replication guide advises for controllers on a LAN; etcd grants leases "
        "of at least 1.5 of it rounded up to whole seconds, so the controllers' etcd_lease_s "
        "of 1 s holds; 1000, etcd's own default, makes it 2 s)",
    )
    ap.add_argument(
        "--cost-messages",
        type=int,
        default=20000,
        help="after the faults, what all_ack_in_sync costs: bench/replication_bench.py's "
        "scenarios c (one ack) and f (every in-sync slave's) with this many messages, 3 "
        "rounds (0: skip)",
    )
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--keep", action="store_true", help="keep the logs and stores")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    if args.kills < 1:
        ap.error("--kills must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    load0 = os.getloadavg()
    began = time.monotonic()
    res = run(args)
    ran = res["kinds"]
    assert isinstance(ran, dict)
    load1 = os.getloadavg()
    info = machine_info()
    print()
    settings = f", broker settings {' '.join(args.broker_setting)}" if args.broker_setting else ""
    print(
        f"{args.kills} faults of each kind ({', '.join(ran) or 'none ran'}), {args.threads} "
        f"producer threads, send timeout {args.send_timeout} s, partitions by {args.partition}, "
        f"slave-cut healed after {args.heal_after:g} s at the latest{settings}, seed "
        f"{args.seed}, {time.monotonic() - began:.0f} s; {info['nproc']} cores {info['cpu']}, "
        f"Python {info['python']}; load average before {load0[0]:.2f} / {load0[1]:.2f}, "
        f"after {load1[0]:.2f} / {load1[1]:.2f} (1 / 5 min); {git_head()}"
    )
    print(report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "params": vars(args), "result": res}, f, indent=2)
            f.write("\n")
    if args.cost_messages > 0 and args.replication == "sync":
        from bench import replication_bench

        print("\nwhat the default election rule (all_ack_in_sync) costs produce throughput:")
        cost = ["--scenarios", "cf", "--messages", str(args.cost_messages), "--rounds", "3"]
        return replication_bench.main(cost)
    return 0


if __name__ == "__main__":
    sys.exit(main())
