"""NATS JetStream with three replicas: a throwaway three-server cluster and a produce phase.

* :class:`NatsCluster`: three ``nats-server`` processes (n1..n3, cluster ``txmqbench``) on
  loopback ports chosen at run time (never 4222), JetStream store dirs in one temporary
  directory.  Ready when every ``/healthz`` is ok and all three name the same meta leader
  of a 3-peer meta group.  stop(): SIGTERM by PID, SIGKILL ``KILL_AFTER`` s later, rm -r.
* :class:`NatsClusterSystem`: :class:`bench.peer_nats.NatsSystem` on the cluster with an R3
  (or R1) file stream; after setup the publisher moves to the stream leader's server (as a
  txmq producer talks to its master: no extra route hop).

An R3 PubAck comes once a quorum (2 of 3) has the message in its RAFT log: page cache,
like R1 (the file store is fsynced every 2 min by default).

Run: ``.venv/bin/python bench/peer_nats_cluster.py --messages 20000 --size 1024 --window 128``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench.common import payload, percentile  # noqa: E402
from bench.peer_nats import NatsSystem  # noqa: E402
from examples.orders.procs import free_port  # noqa: E402

NATS_SERVER = "/usr/sbin/nats-server"
LOOP = "nats://127.0.0.1:"
KILL_AFTER = 5.0
RESERVED_PORTS = {4222, 6222, 8222}  # the machine's own nats-server and the NATS defaults


def _free_ports(k: int) -> list[int]:
    ports: list[int] = []
    for _ in range(100 * k):  # free_port() picks at random below the ephemeral range
        if (port := free_port()) not in RESERVED_PORTS and port not in ports:
            ports.append(port)
            if len(ports) == k:
                return ports
    raise RuntimeError(f"could not find {k} distinct free ports")


class NatsCluster:
    """Three nats-server processes forming a JetStream cluster; a context manager."""

    def __init__(self, cluster_name: str = "txmqbench", ready_timeout: float = 30.0) -> None:
        self.cluster_name = cluster_name
        self.ready_timeout = ready_timeout
        self.names = ["n1", "n2", "n3"]
        self.servers: dict[str, str] = {}  # server name -> client URL
        self.meta_leader = ""
        self.tmp: Path | None = None
        self._monitor_ports: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Start the servers and wait until the cluster is ready; stop them on any error."""
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix="txmq-natscluster-"))
            ports = _free_ports(3 * len(self.names))
            client, route, self._monitor_ports = (ports[i::3] for i in range(3))
            for i, name in enumerate(self.names):
                self.servers[name] = f"{LOOP}{client[i]}"
                routes = ",".join(f"{LOOP}{p}" for j, p in enumerate(route) if j != i)
                argv = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(client[i]), "-n", name]
                argv += ["-m", str(self._monitor_ports[i]), "-js", "-sd", str(self.tmp / name)]
                argv += ["--cluster", f"{LOOP}{route[i]}", "--cluster_name", self.cluster_name]
                argv += ["--routes", routes]
                with (self.tmp / f"{name}.log").open("ab") as log:
                    self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            self.meta_leader = self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _meta_leader(self, port: int) -> str:
        """The meta leader this server follows; "" unless it is healthy in a 3-peer group."""
        docs: list[Any] = []
        try:
            for path in ("healthz", "jsz"):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=2) as r:
                    docs.append(json.load(r))
        except (OSError, ValueError):  # refused, HTTP 503 while unhealthy, bad JSON
            return ""
        meta = docs[1].get("meta_cluster") or {}
        if docs[0].get("status") != "ok" or meta.get("cluster_size") != len(self.names):
            return ""
        return str(meta.get("leader") or "")

    def wait_ready(self) -> str:
        """Poll the monitoring endpoints until all servers agree on a meta leader; return it."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            for name, proc in zip(self.names, self._procs, strict=True):
                if proc.poll() is not None and self.tmp is not None:
                    log = (self.tmp / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"nats-server {name} exited {proc.returncode}:\n{log}")
            leaders = {self._meta_leader(port) for port in self._monitor_ports}
            if len(leaders) == 1 and "" not in leaders:
                return leaders.pop()
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats cluster not ready in {self.ready_timeout}s: {leaders}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM every server by PID, SIGKILL what still runs KILL_AFTER s later; rm tmp."""
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()  # SIGTERM to proc.pid
            deadline = time.monotonic() + KILL_AFTER
            for proc in self._procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()  # SIGKILL to proc.pid
                    proc.wait(10)
        finally:
            self._procs = []
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class ProduceStats:
    """One produce phase: ``messages`` of ``size`` bytes, ``window`` publishes in flight."""

    replicas: int
    messages: int
    size: int
    window: int
    elapsed_s: float
    p50_ms: float  # of the per-message times from js.publish call to PubAck
    p99_ms: float
    stream_leader: str  # at the end of the phase
    publisher_on: str  # the server the publisher was connected to

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        return (
            f"nats-jetstream R{self.replicas} file (leader {self.stream_leader}, publisher on "
            f"{self.publisher_on}) {self.messages} x {self.size} B window {self.window}: "
            f"{self.msgs_per_s:,.0f} msg/s, p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms"
        )


class NatsClusterSystem(NatsSystem):
    """NatsSystem on ``servers`` (name -> client URL), publisher on the stream leader."""

    def __init__(
        self, servers: Mapping[str, str], num_replicas: int = 3, window: int = 256
    ) -> None:
        stream = f"TXMQBENCHR{num_replicas}"
        super().__init__(list(servers.values()), stream, window, num_replicas=num_replicas)
        self.servers = dict(servers)
        self.publisher_on = ""
        self.key = f"nats-r{num_replicas}"
        self.name = f"nats-jetstream R{num_replicas} (file)"
        quorum = f"{num_replicas // 2 + 1} of {num_replicas}"
        self.durability = f"page cache on {quorum} before PubAck, fsync every 2 min (default)"

    async def _stream_leader(self) -> str:
        assert self._pub_js is not None
        info = await self._pub_js.stream_info(self.stream)
        return (info.cluster.leader if info.cluster is not None else None) or ""

    async def setup(self) -> None:
        """NatsSystem.setup, then the publisher reconnects to the stream leader's server."""
        await super().setup()
        assert self._pub is not None
        self.publisher_on = await self._stream_leader()
        await self._pub.close()
        self._pub = await nats.connect(self.servers[self.publisher_on], name="txmq-bench-pub")
        self._pub_js = self._pub.jetstream(timeout=self.timeout)

    async def produce_stats(self, n: int, size: int, window: int) -> ProduceStats:
        """produce() ``n`` x ``payload(size)``; check the stream then holds ``n`` messages."""
        elapsed = await self.produce(n, payload(size), window)
        assert self._pub_js is not None
        stored = (await self._pub_js.stream_info(self.stream)).state.messages
        if stored != n:
            raise RuntimeError(f"{self.stream}: {stored} messages stored, {n} published")
        p50, p99 = (percentile(self.publish_latencies_ms, q) for q in (50, 99))
        leader, on = await self._stream_leader(), self.publisher_on
        return ProduceStats(self.num_replicas, n, size, window, elapsed, p50, p99, leader, on)


async def run_produce(
    servers: Mapping[str, str], replicas: int, n: int, size: int, window: int
) -> ProduceStats:
    """setup, produce_stats, teardown of a fresh NatsClusterSystem."""
    system = NatsClusterSystem(servers, num_replicas=replicas, window=window)
    try:
        await system.setup()
        return await system.produce_stats(n, size, window)
    finally:
        await system.teardown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="NATS JetStream R3 (and R1) produce benchmark")
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--replicas", default="3,1", help="comma-separated, e.g. 3 or 3,1")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    with NatsCluster() as c:
        print(f"cluster {c.servers} pids {c.pids} meta leader {c.meta_leader}", flush=True)
        for r in (int(x) for x in args.replicas.split(",")):
            run = run_produce(c.servers, r, args.messages, args.size, args.window)
            print(asyncio.run(run).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
