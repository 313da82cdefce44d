"""Client-side routes: queues over broker sets, fault avoidance, how a client is addressed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from txmq.client.core import endpoints
from txmq.client.route import LatencyFaultTolerance, Route, RouteTable
from txmq.consumer.offsets import LocalFileOffsetStore
from txmq.protocol.message import MessageQueue
from txmq.protocol.peer import RemotingClient, parse_namesrv
from txmq.protocol.wire import PERM_READ, PERM_WRITE, BrokerData, QueueData, TopicRoute
from txmq.protocol.wire.errors import BrokerUnavailable


def _route(*brokers: tuple[str, int, int], perm: int = PERM_READ | PERM_WRITE) -> TopicRoute:
    return TopicRoute(
        topic="t",
        queues=[
            QueueData(broker_name=b, read_queue_nums=r, write_queue_nums=w, perm=perm)
            for b, r, w in brokers
        ],
        brokers=[
            BrokerData(cluster="c", broker_name=b, addresses={0: f"10.0.0.{i}:10911"})
            for i, (b, _, _) in enumerate(brokers)
        ],
    )


def test_a_route_lists_queues_by_broker_name_then_queue_id() -> None:
    route = Route.of(_route(("broker-b", 2, 2), ("broker-a", 1, 3)))
    assert route.write_queues == (
        MessageQueue("t", "broker-a", 0),
        MessageQueue("t", "broker-a", 1),
        MessageQueue("t", "broker-a", 2),
        MessageQueue("t", "broker-b", 0),
        MessageQueue("t", "broker-b", 1),
    )
    assert [str(q) for q in route.read_queues] == ["t/broker-a/0", "t/broker-b/0", "t/broker-b/1"]
    assert route.masters == {"broker-b": "10.0.0.0:10911", "broker-a": "10.0.0.1:10911"}
    # a broker alone is reached where the client was told, whatever it calls itself
    assert Route.of(_route(("x", 1, 1)), "127.0.0.1:5").masters == {"x": "127.0.0.1:5"}
    # read-only queues are not sent to; a broker set without a master is left out
    assert Route.of(_route(("a", 2, 2), perm=PERM_READ)).write_queues == ()
    no_master = TopicRoute(
        topic="t",
        queues=[QueueData(broker_name="a", read_queue_nums=1, write_queue_nums=1)],
        brokers=[BrokerData(cluster="c", broker_name="a", addresses={1: "10.0.0.9:1"})],
    )
    assert Route.of(no_master).write_queues == ()


def test_latency_decides_how_long_a_broker_is_left_out() -> None:
    now = [1000.0]
    faults = LatencyFaultTolerance(clock=lambda: now[0])
    # RocketMQ 5's table
    for latency, out_for in [(10, 0), (99, 0), (100, 0), (549, 0), (550, 2), (1799, 2),
                             (1800, 5), (2500, 5), (3000, 6), (4999, 6), (5000, 10),
                             (20000, 30)]:  # fmt: skip
        faults = LatencyFaultTolerance(clock=lambda: now[0])
        faults.update("b", latency)
        assert faults.available("b") == (out_for == 0), latency
        now[0] += max(out_for - 0.001, 0)
        assert faults.available("b") == (out_for == 0), latency
        now[0] += 0.002
        assert faults.available("b"), latency
    faults = LatencyFaultTolerance(clock=lambda: now[0])
    faults.update("b", 5, failed=True)  # a failure counts as 15 s: 30 s
    assert not faults.available("b")
    now[0] += 30.01
    assert faults.available("b")
    off = LatencyFaultTolerance(enabled=False, clock=lambda: now[0])
    off.update("b", 20000, failed=True)
    assert off.available("b")


def test_a_send_slow_enough_to_leave_a_set_out_10_s_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    faults = LatencyFaultTolerance(clock=lambda: 1000.0)
    with caplog.at_level(logging.DEBUG, logger="txmq.route"):
        faults.update("a", 3500)  # 6 s: a debug line
        faults.update("b", 5500)  # 10 s: a warning, naming the send's time
        faults.update("c", 5, failed=True)  # the failed send warned itself: info
    got = {r.getMessage(): r.levelno for r in caplog.records}
    assert got == {
        "leaving broker a out of sends for 6 s (a send took 3500 ms)": logging.DEBUG,
        "leaving broker b out of sends for 10 s (a send took 5500 ms)": logging.WARNING,
        "leaving broker c out of sends for 30 s (a send failed)": logging.INFO,
    }


def _table() -> RouteTable:
    def connect(address: str) -> RemotingClient:
        return RemotingClient(address)

    return RouteTable(broker=None, namesrv=["127.0.0.1:9876"], connect=connect)


def test_sends_steer_around_a_broker_left_out_and_fall_back_when_all_are() -> None:
    table = _table()
    route = Route.of(_route(("a", 2, 2), ("b", 2, 2)))
    picks = [table.pick(route, i).broker_name for i in range(4)]
    assert picks == ["a", "a", "b", "b"]
    table.faults.update("a", 3500)  # 6 s
    assert {table.pick(route, i).broker_name for i in range(4)} == {"b"}
    # a retry avoids the broker that just failed even when it is not left out
    fresh = _table()
    assert {fresh.pick(route, i, avoid="a").broker_name for i in range(4)} == {"b"}
    # every broker left out: the one available soonest
    table.faults.update("b", 0, failed=True)  # 30 s
    assert {table.pick(route, i).broker_name for i in range(4)} == {"a"}


def test_a_client_gets_a_broker_or_name_servers_never_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TXMQ_NAMESRV_ADDR", raising=False)
    monkeypatch.delenv("TXMQ_BROKER_ADDRESS", raising=False)
    assert endpoints("h:1", None) == ("h:1", ())
    assert endpoints(None, "a:1;b:2") == (None, ("a:1", "b:2"))
    assert endpoints(None, ["a:1", "b:2", "a:1"]) == (None, ("a:1", "b:2"))
    assert endpoints(None, None) == ("127.0.0.1:10911", ())
    with pytest.raises(ValueError, match="not both"):
        endpoints("h:1", "a:1")
    with pytest.raises(ValueError, match="'nonsense' is not HOST:PORT"):
        endpoints(None, "a:1;nonsense")
    with pytest.raises(ValueError, match="HOST:PORT"):
        endpoints("h", None)
    monkeypatch.setenv("TXMQ_NAMESRV_ADDR", "n:9876")
    assert endpoints(None, None) == (None, ("n:9876",))
    assert endpoints("h:1", None) == ("h:1", ())  # an argument wins over the environment
    monkeypatch.setenv("TXMQ_BROKER_ADDRESS", "h:2")
    with pytest.raises(ValueError, match="unset one"):
        endpoints(None, None)
    assert parse_namesrv(" a:1, b:2 ;") == ("a:1", "b:2")
    assert parse_namesrv("") == ()


@pytest.mark.anyio
async def test_a_broadcasting_offset_file_keeps_offsets_per_broker_set(tmp_path: Path) -> None:
    path = tmp_path / "offsets.json"
    # written before broker sets: topic@queue, read as whichever broker set has the queue
    path.write_text('{"offsets": {"t@0": 7, "t@1": 9}}')
    store = LocalFileOffsetStore(path)
    a0, b0 = MessageQueue("t", "broker-a", 0), MessageQueue("t", "broker-b", 0)
    assert await store.read(a0) == 7
    assert await store.read(MessageQueue("t", "broker-a", 1)) == 9
    assert await store.read(b0) == -1  # the old offset went to the first to claim it
    store.update(b0, 3)
    store.update(a0, 8)
    store.update(a0, 2)  # never backwards
    await store.persist({a0, b0})
    again = LocalFileOffsetStore(path)
    assert (await again.read(a0), await again.read(b0)) == (8, 3)
    assert '"t@broker-a@0": 8' in path.read_text()


def _set_a(addresses: dict[int, str]) -> TopicRoute:
    return TopicRoute(
        topic="t",
        queues=[QueueData(broker_name="a", read_queue_nums=2, write_queue_nums=2)],
        brokers=[BrokerData(cluster="c", broker_name="a", addresses=addresses)],
    )


@pytest.mark.anyio
async def test_a_failover_drops_the_dead_master_then_forgives_the_new_one() -> None:
    """A master that refuses connections leaves the cached route (no more sends to it); the
    set's reads go to a slave meanwhile; the new master a later route names is not left
    out for what its predecessor did (fault avoidance forgets the set)."""
    table = RouteTable(broker=None, namesrv=["ns:1"], connect=lambda a: None)  # type: ignore[arg-type,return-value]
    answers = [
        _set_a({0: "old:1", 1: "s1:1"}),
        _set_a({1: "s1:1"}),  # the name server dropped the dead master
        _set_a({0: "new:1", 1: "s1:1"}),  # a new master, elected from another replica
    ]

    async def fetch(topic: str, create: bool) -> TopicRoute:
        return answers.pop(0)

    table._fetch = fetch  # type: ignore[method-assign]
    route = await table.route("t")
    assert table.address_of("a") == "old:1" and route.write_queues
    table.faults.update("a", 600, failed=True)
    table.failed(MessageQueue("t", "a", 0), unreachable=True)
    cached = table.cached("t")
    assert cached is not None and cached.write_queues == () and cached.read_queues
    assert table.read_address("a") == "s1:1"  # reads go on from the slave
    assert not table.faults.available("a")
    route = await table.route("t")
    assert route.write_queues == () and table.read_address("a") == "s1:1"
    assert not table.faults.available("a")
    route = await table.route("t", refresh=True)
    assert table.address_of("a") == "new:1" and route.write_queues
    assert table.faults.available("a")  # the new master is tried at once


@pytest.mark.anyio
async def test_a_stalled_request_stops_once_the_route_names_another_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """watch_stalls leaves a request alone while the route still names the master it went
    to (a slow master is not a failover), and stops it once the route names another one
    (or none); a request that answers first is not stopped."""
    import asyncio

    import anyio

    from txmq.client import route as route_module
    from txmq.client.route import Waiting

    table = RouteTable(broker=None, namesrv=["ns:1"], connect=lambda a: None)  # type: ignore[arg-type,return-value]
    table.stall_after_s = 0.05
    masters = [{0: "old:1", 1: "s1:1"}]
    fetches = 0

    async def fetch(topic: str, create: bool) -> TopicRoute:
        nonlocal fetches
        fetches += 1
        return _set_a(masters[0])

    table._fetch = fetch  # type: ignore[method-assign]
    await table.route("t")
    mq = MessageQueue("t", "a", 0)
    monkeypatch.setattr(route_module, "STALL_POLL_S", 0.02)

    async def request(seconds: float) -> Waiting:
        """A request to old:1 that takes ``seconds`` unless stopped (as the producer's)."""
        waiting = table.watch(mq, "old:1")
        try:
            await anyio.sleep(seconds)
        except asyncio.CancelledError:
            if not waiting.stopped():
                raise
        finally:
            table.unwatch(waiting)
        return waiting

    async with anyio.create_task_group() as tg:
        tg.start_soon(table.watch_stalls)
        quick = await request(0.01)  # answered before any check
        assert not quick.moved
        slow = await request(0.3)  # the master is slow, but still the master
        assert not slow.moved and fetches > 1
        moved_at = anyio.current_time()
        masters[0] = {1: "s1:1"}  # an election: no master
        held = await request(10)  # a paused master: no answer
        assert held.moved and anyio.current_time() - moved_at < 1.0
        tg.cancel_scope.cancel()
    with pytest.raises(BrokerUnavailable, match="no master now"):
        table.address_of("a")  # the set has no master in the route fetched


@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_producer_refuses_a_stall_check_that_is_not_positive(bad: float) -> None:
    from txmq.client.producer import Producer

    with pytest.raises(ValueError, match="stall_check_s must be positive or None"):
        Producer(namesrv="127.0.0.1:9876", stall_check_s=bad)
    assert Producer(namesrv="127.0.0.1:9876", stall_check_s=None).routes.stall_after_s is None
