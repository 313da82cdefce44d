"""The harness of the controllers-on-etcd tests, tested: a real 3-member etcd cluster
(tests/etcd_cluster.py) takes a write on one member and serves it from another, keeps
taking writes after its leader is SIGKILLed, and the restarted member catches up; the TCP
proxy (tests/tcp_proxy.py) in front of a member forwards, black-holes, heals and cuts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aetcd  # type: ignore[import-untyped]  # no type information shipped (aetcd 1.0)
import anyio
import anyio.to_thread
import pytest

from tests.conftest import wait_for
from tests.etcd_cluster import EtcdCluster, etcd_cluster
from tests.tcp_proxy import TcpProxy

__all__ = ["etcd_cluster"]  # the fixture

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

T = TypeVar("T")


def client(endpoint: str, timeout: float = 2.0) -> Any:
    """An aetcd client of ``endpoint`` ("host:port"); every call's deadline ``timeout`` s."""
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host, int(port), timeout=timeout)


async def until(attempt: Callable[[], Awaitable[T]], timeout: float = 20.0) -> T:
    """Repeat ``attempt`` until it returns something truthy without an etcd client error
    (an election going on, a member not back yet); fails after ``timeout`` s."""
    with anyio.fail_after(timeout):
        while True:
            try:
                if result := await attempt():
                    return result
            except aetcd.ClientError:
                pass
            await anyio.sleep(0.1)


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """A blocking harness call (kill, restart, leader: polls that wait) off the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


@pytest.fixture
def cluster(etcd_cluster: Callable[..., EtcdCluster]) -> EtcdCluster:
    return etcd_cluster(3)


async def test_writes_survive_the_leader_and_the_restarted_member_catches_up(
    cluster: EtcdCluster,
) -> None:
    assert cluster.healthy() and len(set(cluster.endpoints)) == 3
    assert cluster.endpoints_arg == ",".join(cluster.endpoints)
    clients = [client(e) for e in cluster.endpoints]
    try:
        await clients[0].put(b"k", b"v1")
        got = await clients[1].get(b"k")
        assert got is not None and got.value == b"v1"

        leader = await blocking(cluster.leader)
        await blocking(cluster.kill, leader)
        assert not cluster.members[leader].running()
        others = [i for i in range(3) if i != leader]
        for i in others:  # a new leader is elected: both take writes again

            async def write(i: int = i) -> Any:
                return await clients[i].put(f"down{i}".encode(), b"written")

            await until(write)
        assert await blocking(cluster.leader) in others

        await blocking(cluster.restart, leader)
        back = clients[leader]

        async def caught_up() -> bool:
            """The restarted member's own store (a serializable read is answered locally)
            has what was written while it was down."""
            for i in others:
                got = await back.get(f"down{i}".encode(), serializable=True)
                if got is None or got.value != b"written":
                    return False
            return True

        await until(caught_up)
        got = await back.get(f"down{others[0]}".encode())  # linearizable, through it
        assert got is not None and got.value == b"written"
        assert await blocking(cluster.healthy)
    finally:
        for c in clients:
            await c.close()


async def test_proxy_forwards_blackholes_heals_and_cuts(
    etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    cluster = await blocking(etcd_cluster, 1)
    proxy = TcpProxy(cluster.endpoints[0]).start()
    opened: list[Any] = []

    def through_proxy(timeout: float = 2.0) -> Any:
        opened.append(client(proxy.address, timeout))
        return opened[-1]

    try:
        old = through_proxy(timeout=1.0)
        await old.put(b"k", b"v")
        assert (await old.get(b"k")).value == b"v"

        proxy.blackhole()
        with pytest.raises(aetcd.ConnectionTimeoutError):  # the 1 s deadline passes
            await old.get(b"k")
        with pytest.raises(aetcd.ConnectionTimeoutError):  # a new connection: silence too
            await through_proxy(timeout=1.0).get(b"k")

        proxy.heal()
        assert (await through_proxy().get(b"k")).value == b"v"
        # the connection black-holed before stays open and resumes
        assert (await until(lambda: old.get(b"k"))).value == b"v"

        proxy.cut()
        await blocking(wait_for, lambda: proxy.connections() == 0, 5.0)
        started = time.monotonic()
        with pytest.raises(aetcd.ConnectionFailedError):  # reset at once, not a deadline
            await through_proxy(timeout=10.0).get(b"k")
        assert time.monotonic() - started < 5.0

        proxy.heal()
        assert (await until(lambda: through_proxy().get(b"k"))).value == b"v"
    finally:
        for c in opened:
            await c.close()
        proxy.stop()


@pytest.fixture
def echo() -> Iterator[str]:
    """A TCP echo server on a free loopback port (one thread per connection)."""
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threads.append(threading.Thread(target=serve, args=(conn,), daemon=True))
            threads[-1].start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    acceptor.join(5)
    for t in threads:
        t.join(5)


def test_blackhole_holds_bytes_and_heal_delivers_them_in_order(echo: str) -> None:
    with TcpProxy(echo) as proxy:
        host, _, port = proxy.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"one ")
            assert s.recv(100) == b"one "
            proxy.blackhole()
            s.sendall(b"two ")
            s.sendall(b"three")
            s.shutdown(socket.SHUT_WR)  # not even the end of the stream gets through
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(100)
            proxy.heal()
            s.settimeout(5)
            received = b""
            while chunk := s.recv(100):
                received += chunk
            assert received == b"two three"
        wait_for(lambda: proxy.connections() == 0, 5.0)
    # stopped: the port is free again, nothing listens on it
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()
