"""Shared fixtures: embedded brokers and broker processes on temporary stores, and Python
helper processes (``spawn``) whose stdout lines the tests wait for."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import msgpack
import pytest

from txmq.broker.config import BrokerConfig
from txmq.broker.server import EmbeddedBroker
from txmq.client import BrokerClient
from txmq.wire import Frame

ROOT = Path(__file__).resolve().parent.parent



if importlib.util.find_spec("xdist") is not None:  # scripts/test.sh runs the suite with -n
    from xdist.scheduler import LoadScopeScheduling

    class SparkTogether(LoadScopeScheduling):
        """pytest-xdist's work units: every test alone, except the Spark tests, which make
        one unit on one worker (they share one session-scoped Spark session, one JVM; two
        JVMs do not fit 2 cores), sent first as the largest unit.  (xdist_group marks do
        the same in principle, but pytest 9.2's node ids no longer take their suffix.)"""

        def _split_scope(self, nodeid: str) -> str:
            return "spark" if nodeid.startswith("tests/spark/") else nodeid

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
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


async def raw_request(client: BrokerClient, code: int, header: object, body: bytes = b"") -> Frame:
    """Send ``header`` as msgpack whatever it is (what a typed client never would); error
    answers raise as usual."""
    conn = await client.remoting.connection()
    return await conn.request(code, msgpack.packb(header), body)


@pytest.fixture
def embedded_broker(tmp_path: Path) -> Iterator[Callable[..., EmbeddedBroker]]:
    """Factory: ``embedded_broker(**config_overrides)`` starts a broker in this process."""
    started: list[EmbeddedBroker] = []

    def start(**overrides: Any) -> EmbeddedBroker:
        overrides.setdefault("store", tmp_path / f"store{len(started)}")
        overrides.setdefault("port", 0)
        broker = EmbeddedBroker(BrokerConfig(**overrides)).start()
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@dataclass
class BrokerProcess:
    store: Path
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    logs: list[str] = field(default_factory=list)

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        ready = self.store.parent / f"{self.store.name}.ready"
        ready.unlink(missing_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "txmq.cli",
                "broker",
                "start",
                "--store",
                str(self.store),
                "--port",
                "0",
                "--ready-file",
                str(ready),
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        proc = self.proc

        def is_ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"broker exited with {proc.returncode}:\n{self.output()}")
            return ready.exists() and bool(ready.read_text())

        wait_for(is_ready, timeout)
        self.address = ready.read_text()
        return self

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Factory: ``broker_process(*cli_args, store=...)`` runs ``txmq broker start``."""
    procs: list[BrokerProcess] = []

    def make(*args: str, store: Path | None = None) -> BrokerProcess:
        bp = BrokerProcess(store or tmp_path / "store", list(args), tmp_path / "broker.log")
        procs.append(bp)
        return bp

    yield make
    for bp in procs:
        if bp.proc is not None and bp.proc.poll() is None:
            bp.proc.kill()
            bp.proc.wait(10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Spawner:
    """Starts Python processes from the repository root, stdout piped (read it with
    :func:`read_line`), stderr to a file in ``tmp_path``; :meth:`kill_all` ends them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[str]] = []

    def __call__(self, *args: str) -> subprocess.Popen[str]:
        log = (self.tmp_path / f"proc{len(self.procs)}.stderr").open("a")
        proc = subprocess.Popen(
            [sys.executable, *args],
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
            if proc.stdout is not None:
                proc.stdout.close()


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

