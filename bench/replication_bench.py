"""Produce throughput and latency: no replication, ASYNC_MASTER, SYNC_MASTER, NATS R3.

    python bench/replication_bench.py [--messages 50000] [--size 1024] [--window 128]
                                      [--rounds 3] [--scenarios abcde] [--flush async]
                                      [--json out.json]

One run starts, as a user would (real processes, free ports, stores in a temporary
folder): a name server with the controller inside (``txmq namesrv start
--controller-store``), and three broker sets registered with it (cluster ``bench``):

- ``(a) solo``: one broker, no replication (``txmq broker start --namesrv NS --cluster bench
  --broker-name solo``);
- ``(b) async``: three brokers ``--broker-name async --broker-id 0|1|2 --replication async
  --controller NS``: the controller elects an ASYNC_MASTER, which acknowledges at once;
- ``(c) sync``: the same with ``--replication sync`` and ``all_ack_in_sync = false``: the
  SYNC_MASTER acknowledges a send once a slave of the sync state set has its bytes;
- ``(f) allack``: as (c) with ``all_ack_in_sync = true``, the default (RocketMQ 5's
  allAckInSyncStateSet: the ack waits for every slave of the sync state set, not one; the
  controller may then elect any in-sync slave that reports, without waiting for the rest);
- ``(d) nats``: NATS JetStream, three ``nats-server`` processes in a cluster on loopback
  (bench/peer_nats_cluster.py), a file stream with three replicas (R3: the PubAck comes
  once 2 of 3 have it), the publisher connected to the stream leader.

Every txmq broker set gets topic ``bench-<set>`` with 4 queues (created through the name
server).  Then, interleaved (a, b, c, d, a, b, c, d, ... ``--rounds`` times, so a slow
spell of the shared machine hits every scenario alike), one producer in this process
(``txmq.Producer(namesrv=NS)`` on asyncio, or nats-py's ``js.publish``) sends a warm-up of
``2 x --window`` messages, then ``--messages`` messages of ``--size`` bytes with at most
``--window`` unacknowledged.  Throughput = messages / (first send .. last
acknowledgement); latency = each send's call-to-acknowledgement time (p50, p99) at that
load. "vs (a)" is the median over the rounds of each round's ratio to (a). The goals
(issue 33), printed at the end: SYNC_MASTER at least as fast as NATS JetStream R3 (the
median of each round's ratio), and the master's CPU per message under SYNC_MASTER at most
10 µs more than one broker's without replication. CPU columns: CPU per message of this
process (the client), of the master (the stream leader for NATS), of the other replicas
together, and how many of the machine's cores were busy meanwhile (``/proc/stat``, every
process on it), and of those, how many were busy with anything but the client and the
scenario's servers (other people's work on a shared machine: compare rounds with little of
it).

Durability is the same everywhere: txmq's async flush (page cache, fsync every 500 ms;
``--flush sync`` to fsync before the ack) and NATS's default (page cache, fsync every
2 min).  At the end every server gets SIGTERM by PID (SIGKILL if it lingers) and the
temporary folder is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    machine_busy,
    machine_info,
    payload,
    percentile,
    proc_cpu,
    run_windowed,
)
from bench.replicas import BrokerSet, Node, create_topic, git_head, namesrv_node  # noqa: E402

#: issue 33's goals: SYNC_MASTER's rate / NATS JetStream R3's, and the master's CPU per
#: message over an unreplicated broker's (µs)
GOAL_VS_NATS = 1.0
GOAL_MASTER_EXTRA_US = 10.0

SCENARIOS = {
    "a": "(a) one broker, no replication",
    "b": "(b) ASYNC_MASTER + 2 slaves",
    "c": "(c) SYNC_MASTER + 2 slaves",
    "d": "(d) NATS JetStream R3",
    "e": "(e) SYNC_MASTER + 1 slave",
    "f": "(f) SYNC_MASTER + 2 slaves, all ack",
}
SETS = {
    "a": ("solo", 1, None),
    "b": ("async", 3, "async"),
    "c": ("sync", 3, "sync"),
    "e": ("sync2", 2, "sync"),
    "f": ("allack", 3, "sync"),
}
QUEUES = 4


@dataclass
class Round:
    scenario: str
    round: int
    messages: int
    seconds: float
    p50_ms: float
    p99_ms: float
    client_cpu_s: float
    master_cpu_s: float  # the master, or the NATS stream leader
    others_cpu_s: float  # the slaves together, or the other two nats-servers
    busy: float  # cores busy on the whole machine while it ran
    statuses: dict[str, int] = field(default_factory=dict)
    master: str = ""
    wall_s: float = 0.0  # how long the CPU was measured (about ``seconds``)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


class Measure:
    """CPU of this process and of the given server processes, and of the machine, over
    the block between :meth:`begin` and :meth:`end`."""

    def __init__(self, master: Node | int, others: Sequence[Node | int]) -> None:
        self.master = master
        self.others = list(others)

    @staticmethod
    def _cpu(p: Node | int) -> float:
        return p.cpu() if isinstance(p, Node) else proc_cpu(p)

    def begin(self) -> None:
        self.c0 = time.process_time()
        self.m0 = self._cpu(self.master)
        self.o0 = sum(self._cpu(p) for p in self.others)
        self.b0, self.w0 = machine_busy(), time.monotonic()

    def end(self) -> tuple[float, float, float, float]:
        client = time.process_time() - self.c0
        master = self._cpu(self.master) - self.m0
        others = sum(self._cpu(p) for p in self.others) - self.o0
        self.wall = time.monotonic() - self.w0
        busy = (machine_busy() - self.b0) / self.wall if self.wall > 0 else 0.0
        return client, master, others, busy


async def txmq_round(
    key: str, n: int, bs: BrokerSet, master: int, namesrv: str, args: argparse.Namespace
) -> Round:
    """One round on broker set ``bs`` whose master is replica ``master``."""
    from txmq import Message, Producer

    others = [node for i, node in bs.nodes.items() if i != master]
    measure = Measure(bs.nodes[master], others)
    lat: list[float] = []
    statuses: Counter[str] = Counter()
    producer = Producer(namesrv=namesrv, group="bench-producer")
    await producer.start()
    try:
        msg = Message(f"bench-{bs.name}", payload(args.size))

        async def send_one(_i: int) -> None:
            t0 = time.perf_counter_ns()
            result = await producer.send(msg)
            lat.append((time.perf_counter_ns() - t0) / 1e6)
            statuses[result.status] += 1

        await run_windowed(2 * args.window, args.window, send_one)  # warm-up
        lat.clear()
        statuses.clear()
        measure.begin()
        seconds = await run_windowed(n, args.window, send_one)
        client, master_cpu, others_cpu, busy = measure.end()
    finally:
        await producer.stop()
    return Round(
        key,
        0,
        n,
        seconds,
        percentile(lat, 50),
        percentile(lat, 99),
        client,
        master_cpu,
        others_cpu,
        busy,
        dict(statuses),
        f"{bs.name}{master}",
        measure.wall,
    )


async def nats_round(n: int, cluster: Any, args: argparse.Namespace) -> Round:
    from bench.peer_nats_cluster import NatsClusterSystem

    system = NatsClusterSystem(cluster.servers, num_replicas=3, window=args.window)
    await system.setup()
    try:
        body = payload(args.size)
        await system.produce(2 * args.window, body, args.window)  # warm-up
        leader = await system._stream_leader()
        pids = dict(zip(cluster.names, cluster.pids, strict=True))
        measure = Measure(pids[leader], [p for name, p in pids.items() if name != leader])
        measure.begin()
        seconds = await system.produce(n, body, args.window)
        client, master_cpu, others_cpu, busy = measure.end()
        lat = system.publish_latencies_ms
        assert system._pub_js is not None
        stored = (await system._pub_js.stream_info(system.stream)).state.messages
        if stored != n + 2 * args.window:
            raise RuntimeError(f"{system.stream}: {stored} stored, {n + 2 * args.window} sent")
    finally:
        await system.teardown()
    return Round(
        "d",
        0,
        n,
        seconds,
        percentile(lat, 50),
        percentile(lat, 99),
        client,
        master_cpu,
        others_cpu,
        busy,
        {"PubAck": len(lat)},
        leader,
        measure.wall,
    )


# -- report ---------------------------------------------------------------------------------


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _others(r: Round) -> float:
    """Cores kept busy by processes outside this scenario (other work on the machine)."""
    mine = r.client_cpu_s + r.master_cpu_s + r.others_cpu_s
    return max(0.0, r.busy - mine / r.wall_s) if r.wall_s > 0 else float("nan")


def report(rounds: list[Round], keys: str) -> str:
    by: dict[str, list[Round]] = {k: [r for r in rounds if r.scenario == k] for k in keys}
    base: dict[int, float] = {r.round: r.rate for r in by.get("a", [])}
    headers = [
        "scenario",
        "msg/s median",
        "each round",
        "vs (a)",
        "p50 ms",
        "p99 ms",
        "client µs/msg",
        "master µs/msg",
        "replicas µs/msg",
        "cores busy",
        "of which others'",
        "acks",
    ]
    rows = []
    for k in keys:
        rs = by[k]
        if not rs:
            continue
        ratios = [r.rate / base[r.round] for r in rs if base.get(r.round)]
        per = 1e6 / sum(r.messages for r in rs)
        statuses: Counter[str] = Counter()
        for r in rs:
            statuses.update(r.statuses)
        rows.append(
            [
                SCENARIOS[k],
                f"{_med([r.rate for r in rs]):,.0f}",
                " · ".join(f"{r.rate:,.0f}" for r in rs),
                f"{_med(ratios):.2f}" if ratios else "-",
                f"{_med([r.p50_ms for r in rs]):.2f}",
                f"{_med([r.p99_ms for r in rs]):.2f}",
                f"{sum(r.client_cpu_s for r in rs) * per:.0f}",
                f"{sum(r.master_cpu_s for r in rs) * per:.0f}",
                f"{sum(r.others_cpu_s for r in rs) * per:.0f}" if k != "a" else "-",
                f"{_med([r.busy for r in rs]):.2f}",
                f"{_med([_others(r) for r in rs]):.2f}",
                ", ".join(f"{s} {c}" for s, c in sorted(statuses.items())),
            ]
        )
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    peer = {r.round: r.rate for r in by.get("d", [])}
    for k, what in (("c", "2 slaves"), ("e", "1 slave")):
        if k not in keys:
            continue
        if "d" in keys:  # issue 33: SYNC_MASTER >= NATS JetStream R3, round by round
            ratios = [r.rate / peer[r.round] for r in by[k] if peer.get(r.round)]
            if ratios:
                goal = "met" if _med(ratios) >= GOAL_VS_NATS else "NOT met"
                out.append("")
                out.append(
                    f"SYNC_MASTER ({what}) / NATS JetStream R3: median {_med(ratios):.2f} "
                    + "(rounds: "
                    + " · ".join(f"{x:.2f}" for x in ratios)
                    + f"); goal >= {GOAL_VS_NATS:.1f}: {goal}"
                )
        if "a" in keys and by["a"] and by[k]:  # the master's CPU per message
            solo = sum(r.master_cpu_s for r in by["a"]) / sum(r.messages for r in by["a"])
            sync = sum(r.master_cpu_s for r in by[k]) / sum(r.messages for r in by[k])
            extra = (sync - solo) * 1e6
            goal = "met" if extra <= GOAL_MASTER_EXTRA_US else "NOT met"
            out.append(
                f"SYNC_MASTER ({what}) master CPU {sync * 1e6:.0f} µs/msg, {extra:+.0f} over one "
                f"broker without replication; goal <= +{GOAL_MASTER_EXTRA_US:.0f}: {goal}"
            )
    return "\n".join(out)


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--messages", type=int, default=50000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--scenarios",
        default="abcde",
        help="any of a, b, c, d, e, f (e: SYNC_MASTER with one slave, RocketMQ's usual pair; "
        "f: SYNC_MASTER + 2 slaves with all_ack_in_sync, to compare with c)",
    )
    ap.add_argument("--flush", choices=("async", "sync"), default="async")
    ap.add_argument("--json", help="write every round's numbers here")
    args = ap.parse_args(argv)
    keys = "".join(k for k in "abcdef" if k in args.scenarios)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    tmp = Path(tempfile.mkdtemp(prefix="txmq-replbench-"))
    ns = namesrv_node(tmp)
    sets: dict[str, BrokerSet] = {}
    nats_cluster: Any = None
    rounds: list[Round] = []
    load0 = os.getloadavg()
    try:
        namesrv = ns.start().wait_ready()
        for k in keys:
            if k in SETS:
                name, replicas, replication = SETS[k]
                extra = []
                if k in "cf":  # one ack, or every in-sync slave's (the default)
                    toml = tmp / f"{k}.toml"
                    toml.write_text(f"[broker]\nall_ack_in_sync = {str(k == 'f').lower()}\n")
                    extra = ["--config", str(toml)]
                sets[k] = BrokerSet(
                    tmp, namesrv, name, replicas, replication, flush=args.flush, extra=extra
                )
                sets[k].start()
        for k, bs in sets.items():
            master = bs.wait_healthy()
            asyncio.run(create_topic(namesrv, f"bench-{bs.name}", bs.name, QUEUES))
            pids = ", ".join(f"{n.name}={n.pid}" for n in bs.nodes.values())
            print(f"{SCENARIOS[k]}: master {bs.name}{master}, pids {pids}", flush=True)
        if "d" in keys:
            from bench.peer_nats_cluster import NatsCluster

            nats_cluster = NatsCluster()
            nats_cluster.start()
            print(f"{SCENARIOS['d']}: pids {nats_cluster.pids}", flush=True)
        for i in range(args.rounds):
            for k in keys:
                if k == "d":
                    r = asyncio.run(nats_round(args.messages, nats_cluster, args))
                else:
                    master = sets[k].wait_healthy()
                    run = txmq_round(k, args.messages, sets[k], master, namesrv, args)
                    r = asyncio.run(run)
                r.round = i
                rounds.append(r)
                print(
                    f"round {i + 1} {SCENARIOS[k]}: {r.rate:,.0f} msg/s, p50 {r.p50_ms:.2f} ms, "
                    f"p99 {r.p99_ms:.2f} ms, master {r.master}, {r.statuses}; cores busy "
                    f"{r.busy:.2f}, others' {_others(r):.2f}",
                    flush=True,
                )
    finally:
        if nats_cluster is not None:
            nats_cluster.stop()
        for bs in sets.values():
            bs.stop()
        ns.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    info = machine_info()
    print()
    print(
        f"{args.messages} messages x {args.size} B, window {args.window}, {args.rounds} rounds, "
        f"flush {args.flush}; {info['nproc']} cores {info['cpu']}, Python {info['python']}; "
        f"load average before {load0[0]:.2f} / {load0[1]:.2f}, after {load1[0]:.2f} / "
        f"{load1[1]:.2f} (1 / 5 min); {git_head()}"
    )
    print(report(rounds, keys))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            doc = {"machine": info, "params": vars(args), "rounds": [asdict(r) for r in rounds]}
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
