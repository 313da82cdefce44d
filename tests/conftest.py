"""Shared fixtures: embedded brokers and broker processes on temporary stores, and Python
helper processes (``spawn``) whose stdout lines the tests wait for."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import msgpack
import pytest

from bench.common import wait_for as bench_wait_for
from txmq.broker.server import EmbeddedBroker
from txmq.broker.state.config import BrokerConfig
from txmq.client.core import BrokerClient
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import Frame, Request
from txmq.protocol.wire.base import R
from txmq.testing import InProcessBroker
from txmq.transports import loopback

ROOT = Path(__file__).resolve().parent.parent


if importlib.util.find_spec("xdist") is not None:  # scripts/test.sh runs the suite with -n
    from xdist.scheduler import LoadScopeScheduling

    _SECURED = (
        "tests/integration/test_tls.py",
        "tests/integration/test_acl_admin.py",
        "tests/integration/test_grpc_acl.py",
        "tests/console/test_console_login.py",
    )

    class SparkTogether(LoadScopeScheduling):
        """pytest-xdist's work units: every test alone, except the Spark tests, which make
        one unit on one worker (they share one session-scoped Spark session, one JVM; two
        JVMs do not fit 2 cores), sent first as the largest unit; and the orders example's
        tests, one after another on one worker (each runs a whole cluster with its faults
        on deadlines: four at once on 2 cores miss them); and the access-control and TLS
        tests that start clusters and browsers, likewise, so that they do not crowd the
        fault tests' deadlines.  (xdist_group marks do the same
        in principle, but pytest 9.2's node ids no longer take their suffix.)"""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/spark/"):
                return "spark"
            if nodeid.startswith("tests/acceptance/test_orders.py"):
                return "orders"
            if nodeid.startswith(_SECURED):
                return "secured"
            return nodeid

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SparkTogether:
        return SparkTogether(config, log)


@contextlib.contextmanager
def running_async(service: AbstractAsyncContextManager[Any]) -> Iterator[None]:
    """Run an async service (``async with service``) in a background event loop while the
    block runs (e.g. the orders example's inventory service beside sync code)."""

    async def serve(started: anyio.Event, stop: anyio.Event) -> None:
        async with service:
            started.set()
            await stop.wait()

    with anyio.from_thread.start_blocking_portal() as portal:
        started, stop = portal.call(anyio.Event), portal.call(anyio.Event)
        future = portal.start_task_soon(serve, started, stop)
        portal.call(started.wait)
        try:
            yield
        finally:
            portal.call(stop.set)
            future.result(30)


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    try:
        return bench_wait_for(predicate, timeout, interval)
    except TimeoutError:
        raise AssertionError(f"condition not met within {timeout}s") from None


async def raw_request(client: BrokerClient, code: int, header: object, body: bytes = b"") -> Frame:
    """Send ``header`` as msgpack whatever it is (what a typed client never would); error
    answers raise as usual."""
    conn = await client.remoting.connection()
    return await conn.request(code, msgpack.packb(header), body)


@pytest.fixture
def embedded_broker(tmp_path: Path) -> Iterator[Callable[..., EmbeddedBroker]]:
    """Factory: ``embedded_broker(**config_overrides)`` starts a broker in this process
    (``in_process="HOST:PORT"``: also served there to loopback clients)."""
    started: list[EmbeddedBroker] = []
    served: list[str] = []

    def start(*, in_process: str | None = None, **overrides: Any) -> EmbeddedBroker:
        overrides.setdefault("store", tmp_path / f"store{len(started)}")
        overrides.setdefault("port", 0)
        overrides.setdefault("grpc_port", 0)
        overrides.setdefault("metrics_port", 0)
        broker = EmbeddedBroker(BrokerConfig(**overrides)).start()
        started.append(broker)
        if in_process is not None:
            assert broker.broker is not None and broker.loop is not None
            loopback.serve(in_process, broker.broker.router, broker.loop)
            served.append(in_process)
        return broker

    yield start
    for address in served:
        loopback.withdraw(address)
    for broker in started:
        broker.stop()


class ServerProcess:
    """A ``txmq ... start`` command in a process of its own, ready once it has written its
    address to a ready file."""

    proc: subprocess.Popen[bytes] | None
    address: str
    env: dict[str, str]
    log_path: Path

    def _launch(
        self,
        command: list[str],
        ready: Path,
        what: str,
        timeout: float,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        ready.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "txmq.cli", *command, "--ready-file", str(ready)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                preexec_fn=preexec_fn,
            )
        proc = self.proc

        def is_ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{what} exited with {proc.returncode}:\n{self.output()}")
            return ready.exists() and bool(ready.read_text())

        wait_for(is_ready, timeout)
        self.address = ready.read_text()

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process stops where it is (its sockets stay open)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _reap(procs: Sequence[ServerProcess]) -> None:
    """Kill what a test left running (by PID)."""
    for proc in procs:
        if proc.alive():
            proc.kill()


@dataclass
class BrokerProcess(ServerProcess):
    """``txmq broker start`` in a process of its own."""

    store: Path
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    logs: list[str] = field(default_factory=list)
    #: extra environment (TXMQ_BROKER_* settings)
    env: dict[str, str] = field(default_factory=dict)
    #: the process's limit on open files (soft and hard: it cannot raise it)
    max_files: int | None = None
    #: the process's soft limit on open files only (the hard one is left: it may raise it)
    soft_max_files: int | None = None

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        command = ["broker", "start", "--store", str(self.store), "--port", "0", *self.args]
        if "--grpc-port" not in self.args:  # off unless a test asks (8081 is one port)
            command += ["--grpc-port", "0"]
        if "--metrics-port" not in self.args:  # off unless a test asks (5557 is one port)
            command += ["--metrics-port", "0"]
        ready = self.store.parent / f"{self.store.name}.ready"
        limit = self._limit_files if self.max_files or self.soft_max_files else None
        self._launch(command, ready, "broker", timeout, limit)
        return self

    def _limit_files(self) -> None:
        import resource

        if self.max_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_files, self.max_files))
        else:
            assert self.soft_max_files is not None
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.soft_max_files, hard))

    def rss_mib(self) -> float:
        """The broker process's resident memory (VmRSS), in MiB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")


class PeakRss:
    """A broker process's resident memory, sampled every 20 ms while the block runs: the
    value before it (``before``), the highest seen (``peak``) and their difference."""

    def __init__(self, bp: BrokerProcess) -> None:
        self.bp = bp
        self.before = self.peak = bp.rss_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            with contextlib.suppress(OSError, AssertionError):
                self.peak = max(self.peak, self.bp.rss_mib())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        with contextlib.suppress(OSError, AssertionError):  # the last moment counts too
            self.peak = max(self.peak, self.bp.rss_mib())

    @property
    def growth(self) -> float:
        return self.peak - self.before


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Factory: ``broker_process(*cli_args, store=...)`` runs ``txmq broker start``."""
    procs: list[BrokerProcess] = []

    def make(*args: str, store: Path | None = None) -> BrokerProcess:
        bp = BrokerProcess(store or tmp_path / "store", list(args), tmp_path / "broker.log")
        procs.append(bp)
        return bp

    yield make
    _reap(procs)


@pytest.fixture
def in_process_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., InProcessBroker]]:
    """Factory: ``in_process_broker(**settings)`` starts a :class:`txmq.testing.InProcessBroker`
    on a store in ``tmp_path`` and points every client of the test at it (as the
    ``txmq_broker`` fixture does for users: the loopback transport, offsets committed every
    0.05 s); stopped at the end."""
    made: list[InProcessBroker] = []

    def start(**settings: Any) -> InProcessBroker:
        b = InProcessBroker(tmp_path / f"store{len(made)}", **settings)
        for key, value in b.environment().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("TXMQ_NAMESRV_ADDR", raising=False)
        monkeypatch.setenv("TXMQ_PERSIST_INTERVAL_S", "0.05")
        made.append(b)
        b.start()
        return b

    yield start
    for b in made:
        b.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Spawner:
    """Starts Python processes from the repository root, stdout piped (read it with
    :func:`read_line`), stderr to a file in ``tmp_path``; :meth:`kill_all` ends them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[str]] = []

    def __call__(self, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
        """``stdin``: a pipe the test writes to (``proc.stdin``)."""
        log = (self.tmp_path / f"proc{len(self.procs)}.stderr").open("a")
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        self.kill_all()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdout, proc.stdin):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.kill_all()


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 30.0) -> str:
    """The first stdout line starting with ``prefix`` (lines before it are skipped)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {prefix!r} line within {timeout}s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"process exited ({proc.wait()}) before {prefix!r}")
            if line.startswith(prefix):
                return line.strip()


# -- clusters: name servers and brokers that register with them ------------------------------


def ask(address: str, request: Request[R], timeout: float = 5.0) -> R:
    """Send one typed request to ``address`` (a broker or a name server) on a connection of
    its own; its typed answer (error answers raise)."""

    async def go() -> R:
        async with RemotingClient(address, connect_timeout=timeout) as client:
            return (await client.call(request, timeout=timeout)).header

    return anyio.run(go)


def free_port() -> int:
    """A port nothing listens on now (for a server that must come up later on a known
    port; others start on port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class NamesrvProcess(ServerProcess):
    """``txmq namesrv start`` (``kind`` "controller": ``txmq controller start``) in a
    process of its own."""

    workdir: Path
    name: str = "namesrv"
    port: int = 0
    args: list[str] = field(default_factory=list)
    #: extra environment (TXMQ_NAMESRV_* settings)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    kind: str = "namesrv"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, timeout: float = 30.0) -> NamesrvProcess:
        command = [self.kind, "start", "--port", str(self.port), *self.args]
        what = "name server" if self.kind == "namesrv" else self.kind
        self._launch(command, self.workdir / f"{self.name}.ready", what, timeout)
        return self


@pytest.fixture
def namesrv_process(tmp_path: Path) -> Iterator[Callable[..., NamesrvProcess]]:
    """Factory: ``namesrv_process(name="ns1", port=0, env={...}, kind="namesrv")``, not
    started yet (``kind="controller"``: ``txmq controller start``)."""
    procs: list[NamesrvProcess] = []

    def make(
        name: str = "",
        *,
        port: int = 0,
        env: dict[str, str] | None = None,
        kind: str = "namesrv",
    ) -> NamesrvProcess:
        ns = NamesrvProcess(
            tmp_path, name or f"namesrv{len(procs)}", port, env=dict(env or {}), kind=kind
        )
        procs.append(ns)
        return ns

    yield make
    _reap(procs)


@pytest.fixture
def cluster_broker(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Factory: ``cluster_broker("broker-a", [ns1.address, ...], *cli_args, cluster="C",
    env={...})``: a broker process (not started yet) with its own store and log
    (``<tmp>/<name>.log``) that registers with those name servers."""
    procs: list[BrokerProcess] = []

    def make(
        name: str,
        namesrv: list[str],
        *args: str,
        cluster: str = "C",
        env: dict[str, str] | None = None,
    ) -> BrokerProcess:
        cli = ["--namesrv", ";".join(namesrv), "--cluster", cluster, "--broker-name", name]
        bp = BrokerProcess(tmp_path / f"store-{name}", [*cli, *args], tmp_path / f"{name}.log")
        bp.env.update(env or {})
        procs.append(bp)
        return bp

    yield make
    _reap(procs)
