"""What one peer may take of a broker process: file descriptors, memory for answers it does
not read and for frames it never finishes, a connection it never uses (issue 16, items 2
and 4).  Each test prints the broker's resident memory and holds it under a stated bound."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

import msgpack

from tests.conftest import BrokerProcess, wait_for
from tests.raw_client import RawClient, still_serving
from txmq import Message
from txmq.errors import ResponseCode
from txmq.remoting import parse_address
from txmq.sync import Producer
from txmq.wire import PREFIX, FrameKind, RequestCode, encode_frame

#: the most a broker may grow through one of these tests.  Without the limits it grew by
#: hundreds of MiB (a peer not reading 300 answers of 2 MiB: ~600 MiB; sixteen peers each
#: holding 15 MiB of a frame: 240 MiB); with them a peer is owed at most the write buffer
#: (4 MiB) and one answer more, and unfinished frames share 64 MiB (incoming_frame_memory).
RSS_GROWTH_BOUND_MIB = 100


class PeakRss:
    """The broker's resident memory, sampled every 20 ms while the block runs."""

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

    @property
    def growth(self) -> float:
        return self.peak - self.before


def _count(output: str, text: str) -> int:
    return sum(text in line for line in output.splitlines())


def test_out_of_file_descriptors_refuses_new_connections_and_serves_the_open_ones(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process()
    bp.max_files = 64  # soft and hard: the broker cannot raise it
    bp.start()
    first = RawClient(bp.address)
    socks: list[socket.socket] = []
    try:
        # far more connections than the broker has descriptors: the kernel completes the
        # handshakes (backlog), the broker's accept() fails with EMFILE
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
    assert bp.terminate() == 0, bp.output()[-3000:]


def test_a_peer_that_does_not_read_its_answers_is_not_read_either(
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
    with PeakRss(bp) as rss, socket.create_connection(parse_address(bp.address)) as greedy:
        greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        greedy.settimeout(10)
        # 300 pulls, each answered with 2 MiB that the peer never reads (600 MiB if kept)
        greedy.sendall(
            b"".join(
                encode_frame(FrameKind.REQUEST, RequestCode.PULL_MESSAGE, i, pull)
                for i in range(300)
            )
        )
        # others are served meanwhile
        for _ in range(3):
            still_serving(bp.address)
        # after the idle timeout without taking its answers, the peer is closed
        wait_for(lambda: "has not read its answers" in bp.output(), timeout=20)
    print(f"broker RSS {rss.before:.0f} MiB, grew at most {rss.growth:.0f} MiB (peer not reading)")
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
