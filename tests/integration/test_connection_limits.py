"""What one peer may take of a broker process: file descriptors, memory for answers it does
not read and for frames it never finishes, a connection it never uses (issue 16, items 2
and 4).  Each test prints the broker's resident memory and holds it under a stated bound."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.conftest import BrokerProcess, PeakRss, wait_for
from tests.raw_client import RawClient, still_serving
from txmq import Message
from txmq.broker.state.config import BrokerConfig
from txmq.namesrv.config import NamesrvConfig
from txmq.protocol.connection import error_message
from txmq.protocol.flow import ConnectionLimits
from txmq.protocol.message import MessageExt
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import PREFIX, FrameKind, RequestCode, encode_frame
from txmq.protocol.wire.errors import ResponseCode
from txmq.server.serving import ConnectionSettings
from txmq.sync import AdminClient, Producer, PullConsumer, PushConsumer

#: the most a broker may grow through one of these tests.  Without the limits it grew by
#: hundreds of MiB (a peer not reading 300 answers of 2 MiB: ~600 MiB; sixteen peers each
#: holding 15 MiB of a frame: 240 MiB); with them a peer is owed at most the write buffer
#: (4 MiB) and one answer more, and unfinished frames share 64 MiB (incoming_frame_memory).
RSS_GROWTH_BOUND_MIB = 100
#: the longest another client's send and pull may take while a peer does not read its
#: answers (before the write buffer's bound such a peer stalled others for 677 ms)
LATENCY_BOUND_MS = 500
#: long polls on queue ids that do not exist, and how soon all must be answered: each asks
#: to be held 15 s, so a single one held shows as a wait past this
LONG_POLLS = 30_000
ANSWERED_WITHIN_S = 10.0
#: what the broker may grow by through those 30,000 polls (it kept ~33 MB of them, for good)
LONG_POLL_RSS_BOUND_MIB = 16
#: quiet connections against a broker with an idle timeout of 3 s, and how soon after they
#: went quiet all must be closed (the broker looks every 0.75 s)
IDLE_CONNECTIONS = 700
IDLE_CLOSED_WITHIN_S = 20.0


def _count(output: str, text: str) -> int:
    return sum(text in line for line in output.splitlines())


def fields_of(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_out_of_file_descriptors_refuses_new_connections_and_serves_the_open_ones(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process()
    bp.max_files = 64  # soft and hard: the broker cannot raise it
    bp.start()
    first = RawClient(bp.address)
    socks: list[socket.socket] = []
    try:
        with PeakRss(bp) as rss:
            # far more connections than the broker has descriptors: the kernel completes
            # the handshakes (backlog), the broker's accept() fails with EMFILE
            for _ in range(120):
                socks.append(socket.create_connection(parse_address(bp.address), timeout=5))
            wait_for(lambda: "cannot accept connections" in bp.output(), timeout=20)
            assert bp.alive(), bp.output()[-3000:]
            answer = first.request(RequestCode.GET_BROKER_RUNTIME_INFO, {})
            assert answer.code == ResponseCode.SUCCESS
            assert _count(bp.output(), "cannot accept connections") == 1, bp.output()[-3000:]
            for s in socks:
                s.close()
            socks.clear()
            # the broker accepts (and drops) what waited in the backlog, then serves new ones
            wait_for(lambda: "accepting connections again" in bp.output(), timeout=20)
            still_serving(bp.address)
            assert first.request(RequestCode.GET_BROKER_RUNTIME_INFO, {}).code == 0
            assert bp.alive()
    finally:
        for s in socks:
            s.close()
        first.sock.close()
    print(
        f"broker RSS {rss.before:.0f} MiB, grew at most {rss.growth:.1f} MiB (out of file "
        f"descriptors, 120 connections refused), bound {RSS_GROWTH_BOUND_MIB} MiB"
    )
    assert rss.growth < RSS_GROWTH_BOUND_MIB
    assert bp.terminate() == 0, bp.output()[-3000:]


def test_a_peer_that_does_not_read_its_answers_is_not_read_either_nor_stalls_others(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process()
    bp.env = {"TXMQ_BROKER_IDLE_TIMEOUT_S": "4", "TXMQ_BROKER_LONG_POLLING_MAX_S": "1"}
    bp.start()
    body = b"x" * (64 * 1024)
    with Producer(bp.address) as p:
        for _ in range(32):
            p.send(Message("big", body), queue_id=0)
    pull = msgpack.packb({"topic": "big", "queue_id": 0, "offset": 0, "max_msgs": 32})
    latencies: list[float] = []
    with (
        Producer(bp.address) as other,
        PullConsumer(bp.address) as reader,
        PeakRss(bp) as rss,
        socket.create_connection(parse_address(bp.address)) as greedy,
    ):
        sent = other.send(Message("latency", b"warm-up"), queue_id=0)  # connected, topic made
        greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        greedy.settimeout(10)
        # 300 pulls, each answered with 2 MiB that the peer never reads (600 MiB if kept)
        greedy.sendall(
            b"".join(
                encode_frame(FrameKind.REQUEST, RequestCode.PULL_MESSAGE, i, pull)
                for i in range(300)
            )
        )
        # another client's requests, timed, for as long as the broker keeps the peer: until
        # it closes it for not having read its answers within the idle timeout
        deadline = time.monotonic() + 20
        while "has not read its answers" not in bp.output():
            assert time.monotonic() < deadline, "the peer not reading was never closed"
            t0 = time.perf_counter()
            sent = other.send(Message("latency", b"ping"), queue_id=0)
            got = reader.pull("latency", 0, sent.queue_offset, long_poll=0)
            latencies.append(time.perf_counter() - t0)
            assert [m.body for m in got.messages] == [b"ping"]
    latencies.sort()
    p50, worst = latencies[len(latencies) // 2] * 1000, latencies[-1] * 1000
    print(
        f"another client, while the peer did not read: {len(latencies)} send+pull round "
        f"trips, p50 {p50:.1f} ms, max {worst:.1f} ms (bound {LATENCY_BOUND_MS} ms)"
    )
    print(
        f"broker RSS {rss.before:.0f} MiB, grew at most {rss.growth:.0f} MiB (peer not "
        f"reading), bound {RSS_GROWTH_BOUND_MIB} MiB"
    )
    assert len(latencies) >= 20  # the peer was kept ~4 s: many round trips fit
    assert worst < LATENCY_BOUND_MS
    assert rss.growth < RSS_GROWTH_BOUND_MIB
    still_serving(bp.address)
    assert bp.terminate() == 0, bp.output()[-3000:]


def test_partial_frames_and_idle_connections_are_closed_busy_ones_are_not(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process()
    bp.env = {
        "TXMQ_BROKER_FRAME_TIMEOUT_S": "1",
        "TXMQ_BROKER_IDLE_TIMEOUT_S": "3",
        "TXMQ_BROKER_LONG_POLLING_MAX_S": "1",
    }
    bp.start()
    with PeakRss(bp) as rss:
        # sixteen peers each holding most of a 15 MiB frame
        hoarders = []
        big = encode_frame(FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 1, b"", b"y" * 15 * 2**20)
        for _ in range(16):
            c = RawClient(bp.address)
            c.send(big[: len(big) - 10])
            hoarders.append(c)
        half_header = RawClient(bp.address)
        heartbeat = encode_frame(FrameKind.REQUEST, RequestCode.HEARTBEAT, 1)
        half_header.send(heartbeat[: PREFIX.size - 3])
        idle = RawClient(bp.address)
        with Producer(bp.address) as producer:
            producer.send(Message("busy", b"first"))
            conn = producer.aio.remoting._conn
            assert conn is not None
            for c in [*hoarders, half_header]:
                wait_for(c.closed_by_peer, timeout=10)
            # a producer that used its connection within the idle timeout keeps it
            producer.send(Message("busy", b"second"))
            assert producer.aio.remoting._conn is conn
            wait_for(idle.closed_by_peer, timeout=10)
            out = bp.output()
            assert _count(out, "was not completed within 1 s") == 17, out[-3000:]
            assert _count(out, "idle for 3 s") >= 1, out[-3000:]
            # idle past the timeout, it is closed too, and reconnects by itself to send again
            wait_for(lambda: conn.closed, timeout=10)
            producer.send(Message("busy", b"after idle"))
            assert producer.aio.remoting._conn is not conn
    after = bp.rss_mib() - rss.before
    print(
        f"broker RSS {rss.before:.0f} MiB, grew at most {rss.growth:.0f} MiB (16 partial "
        f"frames of 15 MiB), {after:.0f} MiB after"
    )
    assert rss.growth < RSS_GROWTH_BOUND_MIB
    for c in [*hoarders, half_header, idle]:
        c.sock.close()
    assert bp.terminate() == 0, bp.output()[-3000:]


def test_long_polls_on_queues_that_do_not_exist_are_refused_at_once_and_kept_nowhere(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    """30,000 long polls (15 s suspend) on queue ids the topic does not have, pipelined on
    one connection: each is answered BAD_REQUEST at once, none is held, and the broker keeps
    nothing of them (it kept ~33 MB per 30,000 ids, for good, in its arrival events)."""
    bp = broker_process().start()
    with AdminClient(bp.address) as admin:
        admin.create_topic("polled", 4)
    # queue ids 4, 5, ... and -1, -2, ...: none of them exists
    queue_ids = [4 + i if i % 10 else -1 - i for i in range(LONG_POLLS)]
    data = b"".join(
        encode_frame(
            FrameKind.REQUEST,
            RequestCode.PULL_MESSAGE,
            rid,
            msgpack.packb({"topic": "polled", "queue_id": q, "offset": 0, "suspend_ms": 15_000}),
        )
        for rid, q in enumerate(queue_ids, 1)
    )
    codes: Counter[int] = Counter()
    answered: set[int] = set()
    messages: list[str] = []
    raw = RawClient(bp.address)
    try:
        with PeakRss(bp) as rss:
            started = time.monotonic()
            # sent from a thread while the answers are read here: both directions move
            sender = threading.Thread(target=raw.sock.sendall, args=(data,), daemon=True)
            sender.start()
            while len(answered) < LONG_POLLS:
                left = started + ANSWERED_WITHIN_S - time.monotonic()
                assert left > 0, f"{len(answered)} answered within {ANSWERED_WITHIN_S} s"
                raw.sock.settimeout(left)
                chunk = raw.sock.recv(1 << 20)
                assert chunk, "the broker closed the connection"
                for frame in raw.decoder.feed(chunk):
                    answered.add(frame.request_id)
                    codes[frame.code] += 1
                    if len(messages) < 3:
                        messages.append(error_message(frame))
            took = time.monotonic() - started
            sender.join(10)
    finally:
        raw.sock.close()
    after = bp.rss_mib()
    print(
        f"{LONG_POLLS} long polls on queues that do not exist answered in {took:.2f} s "
        f"({dict(codes)}); broker RSS {rss.before:.1f} MiB before, peak {rss.peak:.1f} MiB, "
        f"{after:.1f} MiB after (bound: {LONG_POLL_RSS_BOUND_MIB} MiB growth)"
    )
    assert answered == set(range(1, LONG_POLLS + 1))
    assert codes == {ResponseCode.BAD_REQUEST: LONG_POLLS}, messages
    assert all("out of range for topic 'polled'" in m for m in messages), messages
    assert rss.growth < LONG_POLL_RSS_BOUND_MIB
    # a long poll on a queue that exists is still held (for its 1 s here)
    with PullConsumer(bp.address) as c:
        t0 = time.monotonic()
        assert c.pull("polled", 2, 0, long_poll=1.0).messages == []
        assert time.monotonic() - t0 >= 0.9
    still_serving(bp.address)
    assert bp.terminate() == 0, bp.output()[-3000:]


@contextlib.contextmanager
def _files_allowed(count: int) -> Iterator[None]:
    """This process's soft limit on open files at least ``count`` while the block runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= count:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < count:
        pytest.skip(f"the hard limit on open files ({hard}) is below {count}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_hundreds_of_idle_connections_are_closed_while_clients_work_on(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    """700 connections that go quiet (a third after one request, the rest at once) are all
    closed by the broker once idle for its timeout; a producer and a push consumer that keep
    working beside them are not, and lose nothing."""
    bp = broker_process()
    bp.env = {"TXMQ_BROKER_IDLE_TIMEOUT_S": "3", "TXMQ_BROKER_LONG_POLLING_MAX_S": "1"}
    bp.start()
    received: set[str] = set()
    lock = threading.Lock()

    def listener(msg: MessageExt) -> None:
        with lock:
            received.add(msg.msg_id)

    consumer = PushConsumer(bp.address, "idle-test", listener=listener, consume_from="FIRST_OFFSET")
    consumer.subscribe("working")
    acked: list[str] = []
    idle: dict[int, tuple[socket.socket, float]] = {}  # fd -> (socket, when it went quiet)
    closed_after: list[float] = []
    poller = select.poll()  # select.select() stops at descriptor 1023
    with _files_allowed(IDLE_CONNECTIONS + 256), consumer, Producer(bp.address) as producer:
        acked.append(producer.send(Message("working", b"first")).msg_id)
        producer_conn = producer.aio.remoting._conn
        assert producer_conn is not None
        try:
            with PeakRss(bp) as rss:
                last_send = time.monotonic()
                for i in range(IDLE_CONNECTIONS):
                    if time.monotonic() - last_send > 0.5:  # the producer works on while they
                        # open (a slow machine may take longer than the idle timeout)
                        acked.append(producer.send(Message("working", b"%d" % len(acked))).msg_id)
                        last_send = time.monotonic()
                    raw = RawClient(bp.address)
                    if i % 3 == 0:
                        answer = raw.request(RequestCode.GET_BROKER_RUNTIME_INFO, {})
                        assert answer.code == ResponseCode.SUCCESS
                    sock = raw.sock
                    idle[sock.fileno()] = (sock, time.monotonic())
                    poller.register(sock, select.POLLIN)
                opened = time.monotonic()
                # the others work on, a message every 50 ms at most, until every quiet
                # connection is closed (the poll's timeout paces the producer)
                deadline = opened + IDLE_CLOSED_WITHIN_S
                while idle:
                    assert time.monotonic() < deadline, (
                        f"{len(idle)} of {IDLE_CONNECTIONS} idle connections still open "
                        f"{IDLE_CLOSED_WITHIN_S} s after they went quiet"
                    )
                    acked.append(producer.send(Message("working", b"%d" % len(acked))).msg_id)
                    for fd, _ in poller.poll(50):
                        sock, quiet_since = idle.pop(fd)
                        with contextlib.suppress(OSError):
                            assert sock.recv(1) == b""  # closed by the broker, nothing sent
                        closed_after.append(time.monotonic() - quiet_since)
                        poller.unregister(fd)
                        sock.close()
                # the producer used its connection all along: the broker kept it (checked
                # now: waiting below for the consumer, the producer is idle itself, and
                # past the 3 s timeout its connection is closed like any other)
                assert producer.aio.remoting._conn is producer_conn
                assert not producer_conn.closed
                wait_for(lambda: set(acked) <= received, timeout=30)
        finally:
            for sock, _ in idle.values():
                sock.close()
        acked.append(producer.send(Message("working", b"last")).msg_id)
        wait_for(lambda: set(acked) <= received, timeout=30)
    print(
        f"{IDLE_CONNECTIONS} idle connections closed {min(closed_after):.2f}-"
        f"{max(closed_after):.2f} s after they went quiet (idle timeout 3 s); "
        f"{len(acked)} messages sent and received beside them; broker RSS "
        f"{rss.before:.0f} MiB, grew at most {rss.growth:.1f} MiB, bound "
        f"{RSS_GROWTH_BOUND_MIB} MiB"
    )
    assert len(closed_after) == IDLE_CONNECTIONS
    # not before their time (less a little: the broker's clock for a connection starts
    # when it accepts it or answers, ours a moment before or after)
    assert min(closed_after) > 2.9
    assert _count(bp.output(), "idle for 3 s") >= IDLE_CONNECTIONS, bp.output()[-3000:]
    assert rss.growth < RSS_GROWTH_BOUND_MIB
    assert bp.terminate() == 0, bp.output()[-3000:]


def test_idle_connections_are_closed_after_120_s_by_default() -> None:
    """RocketMQ closes channels idle for 120 s (serverChannelMaxIdleTimeSeconds): so do
    txmq's servers unless told otherwise."""
    assert fields_of(ConnectionSettings)["idle_timeout_s"].default == 120.0
    assert fields_of(ConnectionLimits)["idle_timeout"].default == 120.0
    for config in (BrokerConfig.load(env={}), NamesrvConfig.load(env={})):
        assert config.idle_timeout_s == 120.0
        assert config.connection_limits().idle_timeout == 120.0


def test_the_broker_raises_its_soft_open_file_limit_to_the_hard_one(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    low = 256
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit on open files ({hard}) leaves nothing to raise")
    bp = broker_process()
    bp.soft_max_files = low
    # the control: a process started so has the low soft limit, and the same hard one
    control = subprocess.run(
        [sys.executable, "-c", _PRINT_LIMITS],
        preexec_fn=bp._limit_files,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert control.stdout.split() == [str(low), str(hard)]
    bp.start()
    assert bp.proc is not None
    limits = Path(f"/proc/{bp.proc.pid}/limits").read_text()
    [line] = [x for x in limits.splitlines() if x.startswith("Max open files")]
    soft_now, hard_now = line.split()[3:5]
    print(f"broker started with open files {low} (soft) / {hard} (hard); /proc: {line}")
    assert (soft_now, hard_now) == (str(hard), str(hard))
    assert f"open-file limit {hard} " in bp.output()
    assert bp.terminate() == 0, bp.output()[-3000:]


_PRINT_LIMITS = "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
