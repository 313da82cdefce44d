"""Produce throughput on one broker vs two broker sets vs the same two through a name server,
and what routing costs a send.

    python bench/cluster_bench.py [--messages 40000] [--producers 2] [--window 128]
                                  [--size 1024] [--rounds 5] [--flush async]
                                  [--scenarios abcd] [--route-iterations 100000]
                                  [--json out.json]

One name server and two broker sets (``txmq namesrv start``, ``txmq broker start
--namesrv ... --cluster bench --broker-name broker-a|broker-b``, real processes on free
ports, stores in a temporary folder); topic ``bench`` with 4 queues on each broker set.
Then, side by side in one run:

- ``(a) one broker``: every producer is given broker-a's address (``Producer(address)``:
  the broker answers routes for itself, 4 queues; broker-b idles);
- ``(b) two brokers, split by hand``: half the producers are given broker-a's address,
  half broker-b's (what one would do without name servers);
- ``(c) two brokers, name server``: every producer is given the name server
  (``Producer(namesrv=...)``) and spreads its sends over the 8 queues of both broker sets;
- ``(d) routing overhead``: in this process, the queue selection a send does before it
  goes out (``Producer._pick``: the cached route, then round robin with fault avoidance,
  or the sharding key's hash over every write queue) and the fault-avoidance update after
  it (``LatencyFaultTolerance.update``), timed over ``--route-iterations`` calls each,
  for a producer given a broker and one given the name server; and the cost of one route
  refresh (a round trip to the name server or the broker), which a producer pays every
  30 s and after a failed send.

Each of (a)-(c) starts ``--producers`` producer processes (``python bench/cluster_bench.py
worker ...``), each one ``txmq.Producer`` on asyncio sending ``--messages / --producers``
messages of ``--size`` bytes with at most ``--window`` unacknowledged; every process
first sends a warm-up of ``2 x --window`` messages (connections made, route cached), then
waits until all are ready, then all start at once. Throughput = all messages / (the last
acknowledgement - the first send) over all processes (one monotonic clock: same machine).
``--rounds N`` runs a, b, c, a, b, c, ... so that a slow spell of the machine hits every
scenario alike; the table gives the median and every round, and "vs (a)" / "vs (b)" as
the median of the ratios within each round. CPU columns: microseconds of CPU per message
in the producer processes and in the two broker processes, and how many cores the whole
machine kept busy (``/proc/stat``, every process on it) while the scenario ran.

At the end the brokers and the name server get SIGTERM (by PID; SIGKILL 30 s later if
still running) and the temporary folder is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Node,
    machine_busy,
    machine_info,
    payload,
    run_windowed,
)

TOPIC = "bench"
QUEUES = 4
CLUSTER = "bench"
BROKERS = ("broker-a", "broker-b")
SCENARIOS = {
    "a": "(a) one broker, its address",
    "b": "(b) two brokers, split by hand",
    "c": "(c) two brokers, name server",
}


# -- processes ------------------------------------------------------------------------------


class Cluster:
    """One name server and two broker sets, topic ``bench`` on both."""

    def __init__(self, flush: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="txmq-clusterbench-"))
        self.servers: list[Node] = []
        self.namesrv = ""
        self.brokers: dict[str, Node] = {}
        self.flush = flush

    def start(self) -> None:
        ns = Node("namesrv", ["namesrv", "start"], self.tmp, timeout=30)
        self.servers.append(ns)
        self.namesrv = ns.start().wait_ready()
        for name in BROKERS:
            argv = [
                *("broker", "start", "--store", str(self.tmp / f"store-{name}")),
                *("--flush", self.flush, "--namesrv", self.namesrv, "--cluster", CLUSTER),
                *("--broker-name", name),
            ]
            self.brokers[name] = Node(name, argv, self.tmp, timeout=30)
            self.servers.append(self.brokers[name].start())
        for b in self.brokers.values():
            b.wait_ready()
        asyncio.run(self._create_topic())

    async def _create_topic(self) -> None:
        from txmq import AdminClient, Producer

        for b in self.brokers.values():
            async with AdminClient(b.address) as admin:
                await admin.create_topic(TOPIC, QUEUES)
        # the brokers register a topic with the name server right after creating it
        async with Producer(namesrv=self.namesrv) as producer:
            deadline = time.monotonic() + 30
            while True:
                route = await producer.route(TOPIC, refresh=True)
                if {mq.broker_name for mq in route.write_queues} == set(BROKERS):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the name server does not route {TOPIC} over {BROKERS}")
                await asyncio.sleep(0.1)

    def address(self, broker: str) -> str:
        return self.brokers[broker].address

    def broker_cpu(self) -> float:
        return sum(b.cpu() for b in self.brokers.values())

    def stop(self) -> None:
        for s in reversed(self.servers):  # brokers first: they unregister from the name server
            s.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- producer processes ---------------------------------------------------------------------


def worker_main(argv: list[str]) -> int:
    """A producer process: ``worker (--broker ADDR | --namesrv ADDRS) --messages N ...``.

    Prints ``ready`` after its warm-up, starts on a line on stdin, prints one JSON line
    with its first-send and last-ack times (``time.monotonic()``), its CPU seconds and its
    sends per broker set."""
    p = argparse.ArgumentParser(prog="cluster_bench.py worker")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--broker")
    target.add_argument("--namesrv")
    p.add_argument("--messages", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    args = p.parse_args(argv)
    return asyncio.run(_worker(args))


async def _worker(args: argparse.Namespace) -> int:
    from txmq import Message, Producer

    producer = Producer(args.broker, "bench-producer", namesrv=args.namesrv)
    await producer.start()
    try:
        msg = Message(TOPIC, payload(args.size))
        per_broker: Counter[str] = Counter()

        async def send_one(i: int) -> None:
            per_broker[(await producer.send(msg)).broker_name] += 1

        await run_windowed(2 * args.window, args.window, send_one)
        per_broker.clear()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        cpu0 = time.process_time()
        t0 = time.monotonic()
        await run_windowed(args.messages, args.window, send_one)
        t1 = time.monotonic()
        cpu = time.process_time() - cpu0
        out = {"start": t0, "end": t1, "cpu": cpu, "sent": args.messages, "per_broker": per_broker}
        print(json.dumps(out), flush=True)
    finally:
        await producer.stop()
    return 0


@dataclass
class Round:
    scenario: str
    round: int
    messages: int
    seconds: float
    client_cpu_s: float
    broker_cpu_s: float
    busy_s: float  # of all cores, while it ran
    per_broker: dict[str, int]

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


def run_scenario(
    key: str, n: int, cluster: Cluster, args: argparse.Namespace, timeout: float
) -> Round:
    if key == "a":
        targets = [["--broker", cluster.address(BROKERS[0])]] * args.producers
    elif key == "b":
        targets = [["--broker", cluster.address(BROKERS[i % 2])] for i in range(args.producers)]
    else:
        targets = [["--namesrv", cluster.namesrv]] * args.producers
    each = args.messages // args.producers
    procs: list[subprocess.Popen[str]] = []
    deadline = time.monotonic() + timeout
    try:
        for target in targets:
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, str(Path(__file__).resolve()), "worker", *target),
                        *("--messages", str(each), "--window", str(args.window)),
                        *("--size", str(args.size)),
                    ],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        for proc in procs:
            _expect(proc, "ready", deadline)
        broker0, busy0, wall0 = cluster.broker_cpu(), machine_busy(), time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(_expect(proc, "{", deadline)) for proc in procs]
        broker1, busy1, wall1 = cluster.broker_cpu(), machine_busy(), time.monotonic()
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"a producer process ended with {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    per_broker: Counter[str] = Counter()
    for r in results:
        per_broker.update(r["per_broker"])
    return Round(
        scenario=key,
        round=n,
        messages=sum(r["sent"] for r in results),
        seconds=max(r["end"] for r in results) - min(r["start"] for r in results),
        client_cpu_s=sum(r["cpu"] for r in results),
        broker_cpu_s=broker1 - broker0,
        busy_s=(busy1 - busy0) / (wall1 - wall0) if wall1 > wall0 else 0.0,
        per_broker=dict(sorted(per_broker.items())),
    )


def _expect(proc: subprocess.Popen[str], prefix: str, deadline: float) -> str:
    """The next stdout line of ``proc``, which must start with ``prefix`` (by ``deadline``)."""
    import select

    assert proc.stdout is not None
    left = deadline - time.monotonic()
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
    if not ready:
        raise TimeoutError(f"no {prefix!r} line from a producer process in time")
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        raise RuntimeError(f"a producer process said {line!r} (exit {proc.poll()})")
    return line


# -- (d) routing overhead -------------------------------------------------------------------


@dataclass
class Overhead:
    client: str
    pick_round_robin_us: float
    pick_sharding_key_us: float
    fault_update_us: float
    refresh_ms: float


async def routing_overhead(cluster: Cluster, iterations: int, refreshes: int) -> list[Overhead]:
    """Per-call cost of what a send does to choose its queue, in this process.

    ``Producer._pick`` is what ``send`` calls first (``await self.route(topic)`` — the
    cached route — then the queue); ``faults.update`` is what it calls after the answer."""
    from txmq import Message, Producer

    out: list[Overhead] = []
    msg = Message(TOPIC, b"x")
    keys = [f"order-{i}" for i in range(1024)]
    clients = {
        "broker address": Producer(cluster.address(BROKERS[0]), "bench-route"),
        "name server": Producer(None, "bench-route", namesrv=cluster.namesrv),
    }
    for label, producer in clients.items():
        async with producer:
            await producer.send(msg)  # route cached, connections made
            pick = producer._pick

            t0 = time.perf_counter()
            for _ in range(iterations):
                await pick(msg, {})
            rr = (time.perf_counter() - t0) / iterations

            t0 = time.perf_counter()
            for i in range(iterations):
                await pick(msg, {"sharding_key": keys[i & 1023]})
            sk = (time.perf_counter() - t0) / iterations

            faults = producer.routes.faults
            t0 = time.perf_counter()
            for i in range(iterations):
                faults.update(BROKERS[i & 1], 0.4)
            fu = (time.perf_counter() - t0) / iterations

            t0 = time.perf_counter()
            for _ in range(refreshes):
                await producer.route(TOPIC, refresh=True)
            rf = (time.perf_counter() - t0) / refreshes

            out.append(Overhead(label, rr * 1e6, sk * 1e6, fu * 1e6, rf * 1e3))
    return out


# -- report ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def ratio(rounds: Sequence[Round], key: str, base: str) -> str:
    """The median over rounds of ``key``'s rate / ``base``'s rate in the same round (rounds
    are interleaved, so a slow spell of the machine cancels out)."""
    rate = {(r.scenario, r.round): r.rate for r in rounds}
    ratios = [rate[(key, n)] / rate[(base, n)] for (k, n) in rate if k == key and (base, n) in rate]
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def throughput_table(rounds: Sequence[Round]) -> str:
    rows = []
    for key, label in SCENARIOS.items():
        mine = [r for r in rounds if r.scenario == key]
        if not mine:
            continue
        n = sum(r.messages for r in mine)
        spread: Counter[str] = Counter()
        for r in mine:
            spread.update(r.per_broker)
        rows.append(
            [
                label,
                f"{statistics.median(r.rate for r in mine):,.0f}",
                " · ".join(f"{r.rate:,.0f}" for r in mine),
                ratio(rounds, key, "a"),
                ratio(rounds, key, "b"),
                " / ".join(f"{100 * spread[b] / n:.0f}" for b in BROKERS),
                f"{1e6 * sum(r.client_cpu_s for r in mine) / n:.0f}",
                f"{1e6 * sum(r.broker_cpu_s for r in mine) / n:.0f}",
                f"{statistics.mean(r.busy_s for r in mine):.2f}",
            ]
        )
    headers = [
        "scenario",
        "msg/s (median)",
        "msg/s each round",
        "vs (a)",
        "vs (b)",
        "% a / b",
        "client µs/msg",
        "broker µs/msg",
        "cores busy",
    ]
    return table(headers, rows, set(range(1, 9)))


def overhead_table(rows: Sequence[Overhead], client_us: float | None) -> str:
    body = []
    for o in rows:
        per_send = o.pick_round_robin_us + o.fault_update_us
        share = f"{100 * per_send / client_us:.1f} %" if client_us else "-"
        body.append(
            [
                o.client,
                f"{o.pick_round_robin_us:.2f}",
                f"{o.pick_sharding_key_us:.2f}",
                f"{o.fault_update_us:.2f}",
                f"{per_send:.2f}",
                share,
                f"{o.refresh_ms:.2f}",
            ]
        )
    headers = [
        "(d) producer given",
        "pick rr µs",
        "pick key µs",
        "fault update µs",
        "per send µs",
        "of client CPU/msg",
        "route refresh ms",
    ]
    return table(headers, body, {1, 2, 3, 4, 5, 6})


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=40_000, help="messages per scenario and round")
    p.add_argument("--producers", type=int, default=2, help="producer processes (even)")
    p.add_argument("--window", type=int, default=128, help="unacknowledged sends per producer")
    p.add_argument("--size", type=int, default=1024, help="message body bytes")
    p.add_argument("--rounds", type=int, default=5, help="a, b, c this many times, interleaved")
    p.add_argument("--flush", choices=["async", "sync"], default="async", help="brokers' flush")
    p.add_argument("--scenarios", default="abcd", help="which of (a)-(d) to run")
    p.add_argument("--route-iterations", type=int, default=100_000, help="(d): calls timed")
    p.add_argument("--refreshes", type=int, default=200, help="(d): route refreshes timed")
    p.add_argument("--pause", type=float, default=1.0, help="idle seconds between scenarios")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a scenario is abandoned"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not args.scenarios or set(args.scenarios) - set("abcd"):
        p.error("--scenarios takes letters from abcd")
    if args.producers < 2 or args.producers % 2:
        p.error("--producers must be even (half of them per broker in (b))")
    if min(args.messages, args.window, args.size, args.rounds, args.route_iterations) < 1:
        p.error("--messages, --window, --size, --rounds, --route-iterations must be positive")
    if args.messages < args.producers:
        p.error("--messages must be at least --producers")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    wall0 = time.monotonic()
    cluster = Cluster(args.flush)
    rounds: list[Round] = []
    overhead: list[Overhead] = []
    errors: list[str] = []
    try:
        print(f"starting a name server and {len(BROKERS)} brokers ({args.flush} flush)", flush=True)
        cluster.start()
        print(f"name server {cluster.namesrv}; " + ", ".join(
            f"{b} {s.address}" for b, s in cluster.brokers.items()), flush=True)  # fmt: skip
        keys = [k for k in SCENARIOS if k in args.scenarios]
        for n in range(args.rounds if keys else 0):
            for key in keys:
                time.sleep(args.pause)
                try:
                    r = run_scenario(key, n + 1, cluster, args, args.timeout)
                except Exception as exc:
                    errors.append(f"{SCENARIOS[key]}, round {n + 1}: {type(exc).__name__}: {exc}")
                    print(f"FAILED {errors[-1]}", flush=True)
                    continue
                rounds.append(r)
                print(
                    f"round {n + 1} {SCENARIOS[key]}: {r.messages} msgs in {r.seconds:.2f} s "
                    f"= {r.rate:,.0f} msg/s; per broker {r.per_broker}",
                    flush=True,
                )
        if "d" in args.scenarios:
            print("(d) routing overhead ...", flush=True)
            overhead = asyncio.run(routing_overhead(cluster, args.route_iterations, args.refreshes))
    finally:
        cluster.stop()
    mi = machine_info()
    print()
    print(f"machine: nproc={mi['nproc']}  cpu={mi['cpu']}  python {mi['python']}")
    print(
        f"{args.producers} producer processes x {args.messages // args.producers} messages of "
        f"{args.size} B, window {args.window} each; brokers: {args.flush} flush; "
        f"{args.rounds} round(s); wall time {time.monotonic() - wall0:.0f} s"
    )
    client_us: float | None = None
    if rounds:
        print()
        print(throughput_table(rounds))
        mine = [r for r in rounds if r.scenario == "c"] or rounds
        client_us = 1e6 * sum(r.client_cpu_s for r in mine) / sum(r.messages for r in mine)
    if overhead:
        print()
        print(overhead_table(overhead, client_us))
        print(
            f"  ({args.route_iterations:,} calls each; 'per send' = a round-robin pick + the "
            "fault update; 'of client CPU/msg' against the producers' CPU per message in (c))"
        )
    for e in errors:
        print(f"ERROR {e}")
    if args.json:
        doc: dict[str, Any] = {
            "machine": mi,
            "params": vars(args),
            "rounds": [{**asdict(r), "rate": r.rate} for r in rounds],
            "overhead": [asdict(o) for o in overhead],
            "errors": errors,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
