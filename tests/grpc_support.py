"""The official RocketMQ 5 Python client (``rocketmq-python-client``) against a real
``txmq broker start`` process with its gRPC endpoint: fixtures and small helpers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# the official client: it configures its own file logging (~/logs/rocketmq_python) on import
from rocketmq.v5.client import ClientConfiguration, Credentials
from rocketmq.v5.client.connection.rpc_client import RpcClient
from rocketmq.v5.consumer import (
    ConsumeResult,
    MessageListener,
    PushConsumer,
    SimpleConsumer,
)
from rocketmq.v5.model import FilterExpression, Message
from rocketmq.v5.producer import Producer, TransactionChecker

from tests.conftest import BrokerProcess, ServerProcess, free_port, wait_for

__all__ = [
    "ClientConfiguration",
    "ConsumeResult",
    "Credentials",
    "FilterExpression",
    "GrpcBroker",
    "Message",
    "Producer",
    "ProxyProcess",
    "PushConsumer",
    "Recorder",
    "SimpleConsumer",
    "TransactionChecker",
    "grpc_broker",
    "grpc_closed_loops",
    "make_message",
    "receive_all",
    "started",
    "startup",
]


@pytest.fixture
async def grpc_closed_loops() -> AsyncIterator[None]:
    """grpc.aio binds every event loop that made a call to its one completion queue, and a
    completion meant for an earlier test's loop, closed by now, fails in grpc's poller inside
    the loop that runs next ("Event loop is closed" from PollerCompletionQueue._handle_events;
    grpc/grpc#25364): nothing waits for it any more.  Exactly that error is ignored in the
    test's loop; everything else goes to the handler that was there (the test fails)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            frames = traceback.extract_tb(exc.__traceback__)
            if any(f.name == "_handle_events" and "completion_queue" in f.filename for f in frames):
                return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)


#: short delay levels: a consumer retry waits 1 s (levels 3 on are the retry back-off)
FAST_LEVELS = "1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s 1s"


@dataclass
class GrpcBroker:
    process: BrokerProcess
    grpc_port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def address(self) -> str:
        return self.process.address

    def config(self) -> Any:
        return ClientConfiguration(self.endpoint, Credentials(), request_timeout=5)


@pytest.fixture
def grpc_broker(tmp_path: Path) -> Iterator[Callable[..., GrpcBroker]]:
    """Factory: ``grpc_broker(*cli_args, env={...})`` runs a broker serving gRPC on a free
    port (fast transaction checks and retries unless ``env`` says otherwise)."""
    procs: list[BrokerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> GrpcBroker:
        settings = {
            "TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "1",
            "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "2",
            "TXMQ_BROKER_MESSAGE_DELAY_LEVELS": FAST_LEVELS,
            **(env or {}),
        }
        for attempt in range(3):
            port = free_port()
            bp = BrokerProcess(
                tmp_path / f"store{len(procs)}-{attempt}",
                ["--grpc-port", str(port), *args],
                tmp_path / f"broker{len(procs)}-{attempt}.log",
                env=settings,
            )
            try:
                bp.start()
            except AssertionError as exc:
                # the port, free when picked, was taken before the broker bound it (other
                # tests pick ports too): once more with another
                if "is in use or cannot be bound" in str(exc) and attempt < 2:
                    continue
                raise
            procs.append(bp)
            return GrpcBroker(bp, port)
        raise AssertionError("unreachable")

    yield make
    for bp in procs:
        if bp.alive():
            bp.kill()


@dataclass
class ProxyProcess(ServerProcess):
    """``txmq proxy start --namesrv ...`` on a free gRPC port, in a process of its own
    (stopped by its PID); :attr:`address` is its gRPC endpoint once started."""

    workdir: Path
    namesrv: str
    name: str = "proxy"
    args: list[str] = field(default_factory=list)
    #: extra environment (TXMQ_PROXY_* settings)
    env: dict[str, str] = field(default_factory=dict)
    proc: Any = None
    address: str = ""

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, timeout: float = 30.0) -> ProxyProcess:
        command = ["proxy", "start", "--namesrv", self.namesrv, "--grpc-port", "0", *self.args]
        self._launch(command, self.workdir / f"{self.name}.ready", "proxy", timeout)
        return self


def startup(client: Any) -> None:
    """``client.startup()``, in a thread of its own whose current event loop is the
    official client's I/O loop.

    During its start the client may open a gRPC channel, or its Telemetry stream, in the
    calling thread (when a route query is answered before the client has registered its
    callback, the callback runs there); grpc.aio then binds them to that thread's current
    event loop.  A pytest worker's main thread has none once an earlier test's asyncio
    runner has closed ("There is no current event loop in thread 'MainThread'": the
    stream fails and the route is never cached, "failed to fetch topic ... route"), or
    one that never runs.  The I/O loop is the one that runs the client's calls."""
    failed: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(RpcClient.get_channel_io_loop())
        try:
            client.startup()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="rocketmq-startup")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


@contextlib.contextmanager
def started(client: Any) -> Iterator[Any]:
    """:func:`startup` now, ``client.shutdown()`` at the end of the block."""
    startup(client)
    try:
        yield client
    finally:
        client.shutdown()


def make_message(topic: str, body: bytes, **fields: Any) -> Any:
    m = Message()
    m.topic = topic
    m.body = body
    for name, value in fields.pop("properties", {}).items():
        m.add_property(name, value)
    for name, value in fields.items():
        setattr(m, name, value)
    return m


def receive_all(
    consumer: Any, count: int, *, timeout: float = 30.0, invisible: int = 15, ack: bool = True
) -> list[Any]:
    """Receive (and ack) until ``count`` messages came, or fail at the deadline."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count} messages"
        for m in consumer.receive(32, invisible):
            got.append(m)
            if ack:
                consumer.ack(m)
    return got


@dataclass
class Recorder(MessageListener):  # type: ignore[misc]
    """A PushConsumer listener recording what it got; ``fail(message)`` says whether this
    delivery fails."""

    fail: Callable[[Any], bool] = lambda m: False
    got: list[tuple[str, bytes, int, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def consume(self, message: Any) -> Any:
        with self.lock:
            self.got.append(
                (message.message_id, message.body, message.delivery_attempt, time.time())
            )
        return ConsumeResult.FAILURE if self.fail(message) else ConsumeResult.SUCCESS

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [b for _, b, _, _ in self.got]

    def wait(self, count: int, timeout: float = 30.0) -> None:
        wait_for(lambda: len(self.got) >= count, timeout)
