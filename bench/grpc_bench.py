"""Produce and receive throughput of the official RocketMQ 5 Python client over gRPC, and
what each message costs the broker's CPU: through the broker's own gRPC endpoint, through
one ``txmq proxy start`` and through two proxies (a client process on each), in alternating
rounds of one run on one cluster (a name server, one broker, two proxies).

    .venv/bin/python bench/grpc_bench.py --messages 4000 --rounds 2
    .venv/bin/python bench/grpc_bench.py --txmq-clients    # also txmq's own client, once

Each round runs every setup once, the order rotating; every run gets topics of its own (4
queues).  A client is a process of its own (this script with ``--client``): it sends
``--messages`` (split between the clients) of ``--size`` bytes with at most ``--window``
unacknowledged (``send_async`` futures), then its SimpleConsumer drains them (batches of 32,
each message acked by a pool of 16 threads).  Both phases start together in every client.
Numbers are messages per second and CPU microseconds per message — the broker's (the goal:
at most 100 µs for a message sent and received) and the proxies' — for each phase.

``--txmq-clients``: as before this benchmark had proxies, txmq's own client on txmq's
protocol and on its gRPC transport, against the same broker (its endpoint), once.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, Node, free_port, machine_info, payload, run_windowed

QUEUES = 4
#: the broker's CPU per message (sent and received) the proxy is for
GOAL_BROKER_US = 100.0
SETUPS = ("embedded endpoint", "one proxy", "two proxies")


class Cluster:
    """A name server, one broker (async flush; its gRPC endpoint on a free port) and two
    proxies, in a temporary folder; every process stopped by its PID."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="txmq-grpc-bench-"))
        self.nodes: list[Node] = []
        try:
            ns = self._start(Node("namesrv", ["namesrv", "start"], self.tmp))
            self.grpc_port = free_port()
            argv = ["broker", "start", "--store", str(self.tmp / "store"), "--namesrv", ns]
            broker = Node("broker", argv, self.tmp, extra=["--grpc-port", str(self.grpc_port)])
            self.address = self._start(broker)
            self.broker = broker
            self.proxies = [
                Node(
                    f"proxy{i}",
                    ["proxy", "start", "--namesrv", ns],
                    self.tmp,
                    port_flag="--grpc-port",
                )
                for i in (1, 2)
            ]
            self.proxy_endpoints = [self._start(p) for p in self.proxies]
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"127.0.0.1:{self.grpc_port}"

    def _start(self, node: Node) -> str:
        self.nodes.append(node)
        return node.start().wait_ready(60)

    def endpoints(self, setup: str) -> list[str]:
        """The endpoint each client of ``setup`` is given."""
        if setup == "embedded endpoint":
            return [self.endpoint]
        if setup == "one proxy":
            return self.proxy_endpoints[:1]
        return list(self.proxy_endpoints)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the broker's, the proxies' together."""
        return self.broker.cpu(), sum(p.cpu() for p in self.proxies)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _create_topic(address: str, topic: str) -> None:
    from txmq import AdminClient

    async with AdminClient(address) as admin:
        await admin.create_topic(topic, QUEUES)


# -- a client process (--client) ------------------------------------------------------------


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _startup(client: Any) -> None:
    """``client.startup()`` with the official client's I/O loop as this thread's event loop:
    during its start the client may open a channel or stream in the calling thread, which
    grpc.aio binds to that thread's loop (see tests/grpc_support.py's ``startup``)."""
    from rocketmq.v5.client.connection.rpc_client import RpcClient

    asyncio.set_event_loop(RpcClient.get_channel_io_loop())
    client.startup()


def _wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the benchmark went away")


async def client(endpoint: str, topic: str, n: int, body: bytes, window: int) -> None:
    """Start, say ``ready``; at ``go`` send ``n`` messages, say ``produced`` (seconds), start
    the consumer, say ``ready``; at ``go`` drain them, say ``received`` (and own CPU)."""
    from rocketmq.v5.client import ClientConfiguration, Credentials
    from rocketmq.v5.consumer import SimpleConsumer
    from rocketmq.v5.model import FilterExpression, Message
    from rocketmq.v5.producer import Producer

    cfg = ClientConfiguration(endpoint, Credentials(), request_timeout=10)
    producer = Producer(cfg, (topic,))
    await asyncio.to_thread(_startup, producer)

    async def send_one(i: int) -> None:
        m = Message()
        m.topic = topic
        m.body = body
        await asyncio.wrap_future(producer.send_async(m))

    _say(ready=True)
    await asyncio.to_thread(_wait_go)
    try:
        produce_s = await run_windowed(n, window, send_one)
    finally:
        await asyncio.to_thread(producer.shutdown)
    _say(produced=produce_s)
    consumer = SimpleConsumer(cfg, topic, {topic: FilterExpression("*")}, await_duration=5)
    await asyncio.to_thread(_startup, consumer)
    _say(ready=True)
    await asyncio.to_thread(_wait_go)

    def drain() -> float:
        # the client's ack_async needs an event loop in the calling thread: acks go to a
        # pool of threads instead, as an application's workers would ack
        pool = concurrent.futures.ThreadPoolExecutor(16)
        acks: list[concurrent.futures.Future[Any]] = []
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        while got < n and time.monotonic() < deadline:
            for m in consumer.receive(32, 60):
                acks.append(pool.submit(consumer.ack, m))
                got += 1
            if len(acks) > window:
                for f in acks:
                    f.result()
                acks.clear()
        for f in acks:
            f.result()
        pool.shutdown()
        if got < n:
            raise RuntimeError(f"the official SimpleConsumer received {got} of {n}")
        return time.perf_counter() - t0

    try:
        consume_s = await asyncio.to_thread(drain)
    finally:
        await asyncio.to_thread(consumer.shutdown)
    _say(received=consume_s, cpu=_own_cpu())


# -- the benchmark's side -------------------------------------------------------------------


class Client:
    """One client process, stepped through its phases."""

    def __init__(self, endpoint: str, topic: str, n: int, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--client", endpoint, "--topic", topic]
        cmd += ["--messages", str(n), "--size", str(args.size), "--window", str(args.window)]
        self.log = (Path(tempfile.gettempdir()) / f"{topic}.client.log").open("w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # (a thread: lines a pipe delivers at once all count)
            self.lines.put(line)
        self.lines.put("")

    def read(self, key: str, timeout: float = 600) -> dict[str, Any]:
        """The next thing the client says that has ``key``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise RuntimeError(
                    f"a client said no {key!r} in {timeout} s ({self.log.name})"
                ) from None
            if not line:
                raise RuntimeError(f"a client ended before {key!r}: see {self.log.name}")
            if line.startswith("{"):
                said = json.loads(line)
                if key in said:
                    return dict(said)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.close()


@dataclass
class Run:
    setup: str
    round: int
    messages: int
    produce_s: float
    receive_s: float
    #: CPU seconds of each phase (produce, receive)
    broker_cpu: tuple[float, float]
    proxy_cpu: tuple[float, float]
    client_cpu: float

    def per_msg(self, cpu: tuple[float, float]) -> tuple[float, float, float]:
        n = self.messages
        return cpu[0] / n * 1e6, cpu[1] / n * 1e6, (cpu[0] + cpu[1]) / n * 1e6

    def line(self) -> str:
        b = self.per_msg(self.broker_cpu)
        p = self.per_msg(self.proxy_cpu)
        proxy = f"{p[0]:>6.0f} {p[1]:>6.0f} {p[2]:>6.0f}" if self.setup != SETUPS[0] else " " * 20
        return (
            f"{self.setup:<18} {self.round:>5} {self.messages / self.produce_s:>9,.0f} "
            f"{self.messages / self.receive_s:>9,.0f}   {b[0]:>6.0f} {b[1]:>6.0f} {b[2]:>6.0f}"
            f"   {proxy}   {'yes' if b[2] <= GOAL_BROKER_US else 'no':>4}"
        )


HEADER = (
    f"{'setup':<18} {'round':>5} {'produce/s':>9} {'receive/s':>9}   "
    f"{'broker CPU µs/msg':^20}   {'proxy CPU µs/msg':^20}   {'goal':>4}\n"
    f"{'':<18} {'':>5} {'':>9} {'':>9}   {'send':>6} {'recv':>6} {'total':>6}   "
    f"{'send':>6} {'recv':>6} {'total':>6}   {'≤100':>4}"
)


async def run_setup(cluster: Cluster, setup: str, rnd: int, args: argparse.Namespace) -> Run:
    endpoints = cluster.endpoints(setup)
    share = args.messages // len(endpoints)
    topics = [
        f"bench-{setup.replace(' ', '-')}-{rnd}-{i}-{os.getpid()}" for i in range(len(endpoints))
    ]
    for topic in topics:
        await _create_topic(cluster.address, topic)
    clients = [Client(e, t, share, args) for e, t in zip(endpoints, topics, strict=True)]
    try:
        for c in clients:
            await asyncio.to_thread(c.read, "ready")
        b0, p0 = cluster.cpu()
        for c in clients:
            c.go()
        produced = [(await asyncio.to_thread(c.read, "produced"))["produced"] for c in clients]
        b1, p1 = cluster.cpu()
        for c in clients:
            await asyncio.to_thread(c.read, "ready")
        b2, p2 = cluster.cpu()
        for c in clients:
            c.go()
        done = [await asyncio.to_thread(c.read, "received") for c in clients]
        b3, p3 = cluster.cpu()
    finally:
        for c in clients:
            c.close()
    return Run(
        setup,
        rnd,
        share * len(clients),
        max(produced),
        max(d["received"] for d in done),
        (b1 - b0, b3 - b2),
        (p1 - p0, p3 - p2),
        sum(d["cpu"] for d in done),
    )


async def txmq_clients(cluster: Cluster, n: int, body: bytes, window: int) -> list[str]:
    """txmq's own client on txmq's protocol and on its gRPC transport (the broker's own
    endpoint): a line each (produce/s, receive/s, broker CPU µs per message)."""
    out = []
    for transport in ("txmq", "grpc"):
        b0 = cluster.broker.cpu()
        produce_s, consume_s = await _txmq_client(cluster, n, body, window, transport)
        us = (cluster.broker.cpu() - b0) / n * 1e6
        name = f"txmq client -> {'txmq protocol' if transport == 'txmq' else 'gRPC transport'}"
        out.append(f"{name:<34} {n / produce_s:>9,.0f} {n / consume_s:>9,.0f}   {us:>6.0f}")
    return out


async def _txmq_client(
    cluster: Cluster, n: int, body: bytes, window: int, transport: str
) -> tuple[float, float]:
    from txmq import Message, Producer, PushConsumer

    topic = f"bench-txmq-{transport}-{os.getpid()}"
    await _create_topic(cluster.address, topic)
    address = cluster.address if transport == "txmq" else cluster.endpoint
    kw: dict[str, Any] = {} if transport == "txmq" else {"transport": transport}
    producer = Producer(address, "bench-producer", **kw)
    await producer.start()
    msg = Message(topic, body)

    async def send_one(i: int) -> None:
        await producer.send(msg)

    try:
        produce_s = await run_windowed(n, window, send_one)
    finally:
        await producer.stop()
    done = asyncio.Event()
    count = 0
    lock = threading.Lock()

    async def listener(m: Any) -> None:
        nonlocal count
        with lock:
            count += 1
            if count >= n:
                done.set()

    consumer = PushConsumer(
        address, "bench-consume", listener=listener, consume_from="FIRST_OFFSET", **kw
    )
    consumer.subscribe(topic)
    t0 = time.perf_counter()
    await consumer.start()
    try:
        await asyncio.wait_for(done.wait(), 600)
        return produce_s, time.perf_counter() - t0
    finally:
        await consumer.stop()


def summary(runs: Sequence[Run]) -> list[str]:
    """The median of each setup's rounds."""
    lines = []
    for setup in SETUPS:
        mine = [r for r in runs if r.setup == setup]
        if not mine:
            continue
        produce = statistics.median(r.messages / r.produce_s for r in mine)
        receive = statistics.median(r.messages / r.receive_s for r in mine)
        broker = statistics.median(r.per_msg(r.broker_cpu)[2] for r in mine)
        proxy = statistics.median(r.per_msg(r.proxy_cpu)[2] for r in mine)
        shown = f"{proxy:>6.0f}" if setup != SETUPS[0] else "     -"
        lines.append(
            f"{setup:<18} {produce:>9,.0f} {receive:>9,.0f}   {broker:>6.0f}   {shown}   "
            f"{'yes' if broker <= GOAL_BROKER_US else 'no'}"
        )
    return lines


async def main(args: argparse.Namespace) -> None:
    if args.client:
        await client(args.client, args.topic, args.messages, payload(args.size), args.window)
        return
    cluster = Cluster()
    runs: list[Run] = []
    extra: list[str] = []
    try:
        for rnd in range(args.rounds):
            order = SETUPS[rnd % len(SETUPS) :] + SETUPS[: rnd % len(SETUPS)]
            for setup in order:
                run = await run_setup(cluster, setup, rnd + 1, args)
                runs.append(run)
                print(run.line(), file=sys.stderr, flush=True)
        if args.txmq_clients:
            extra = await txmq_clients(cluster, args.messages, payload(args.size), args.window)
    finally:
        cluster.stop()
    info = machine_info()
    print(f"# {args.messages} messages of {args.size} B per run, window {args.window}, "
          f"{args.rounds} rounds; one broker (async flush), two proxies; "
          f"{info.get('nproc')} CPUs, Python {info.get('python')}")  # fmt: skip
    print(HEADER)
    for run in sorted(runs, key=lambda r: (SETUPS.index(r.setup), r.round)):
        print(run.line())
    print("\nmedians of the rounds (CPU µs per message sent and received; goal: the broker's "
          f"≤ {GOAL_BROKER_US:.0f})")  # fmt: skip
    print(f"{'setup':<18} {'produce/s':>9} {'receive/s':>9}   {'broker':>6}   {'proxy':>6}   goal")
    for line in summary(runs):
        print(line)
    if extra:
        print(f"\n{'txmq client':<34} {'produce/s':>9} {'receive/s':>9}   broker µs/msg")
        for line in extra:
            print(line)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=4000, help="per run (split between clients)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--txmq-clients", action="store_true", help="also txmq's own client, once")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # a client process: its endpoint
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    asyncio.run(main(ap.parse_args()))
