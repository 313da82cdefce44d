"""A fuzz test of the broker's wire protocol, against a broker process.

Random and mutated frames of every request code (generators: ``tests/fuzzing.py``) go to
one broker while a normal producer and push consumer use it beside them.  What must hold:

* every well-framed request is answered within a deadline with a response frame carrying
  its id and version, never SYSTEM_ERROR (an exception the broker did not expect); the
  answer is exactly BAD_REQUEST when the header does not decode as the request's type,
  REQUEST_CODE_NOT_SUPPORTED for a code the broker does not serve, VERSION_NOT_SUPPORTED
  for an unknown version.  A fuzzed header that does decode may be a valid request: any
  answer but SYSTEM_ERROR is fine then, and SUCCESS must carry a header of the response
  type.  Oneway requests are never answered;
* a malformed or oversized frame (byte-level mutations, each on a connection of its own)
  is answered with MALFORMED_FRAME or FRAME_TOO_LARGE and closes that connection only;
* the broker stays up, logs no stack trace and little in all, and its RSS stays under a
  bound all along (sampled every 20 ms while fuzzing: printed before, at its peak, after);
* every message of the normal producer reaches the normal consumer; after a clean stop the
  state files hold only what is valid (topics with valid names; offsets of groups on topics
  that exist, of queue ids each topic has, none negative), the broker starts again on the
  same store without setting any state file aside, and every acknowledged message reads
  back.

Fuzzed frames never name the normal topic or group (deleting a topic, moving a group's
offsets, locking its queues: a client may do all that).  The run is deterministic for a
seed, ``TXMQ_FUZZ_SEED`` (printed; a fixed one by default), and bounded by
``TXMQ_FUZZ_FRAMES`` frames and ``TXMQ_FUZZ_BUDGET_S`` seconds.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BrokerProcess, PeakRss, wait_for
from tests.fuzzing import Gen, Known, mutate, pack
from tests.raw_client import still_serving
from txmq import Message
from txmq.protocol.connection import error_message
from txmq.protocol.message import MessageExt, validate_topic_name
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import (
    PREFIX,
    ErrorAnswer,
    Frame,
    FrameDecoder,
    FrameKind,
    RequestCode,
    Sent,
    TopicList,
    decode,
    encode_frame,
    request_class,
    requests,
)
from txmq.protocol.wire.errors import (
    MAX_MESSAGE,
    FrameTooLarge,
    MalformedFrame,
    ResponseCode,
    TxmqError,
)
from txmq.sync import AdminClient, Producer, PullConsumer, PushConsumer, TransactionProducer

SEED = int(os.environ.get("TXMQ_FUZZ_SEED", "20240611"))
#: well-framed requests on one long-lived connection (~3 ms each on 2 cores)
FRAMES = int(os.environ.get("TXMQ_FUZZ_FRAMES", "3000"))
#: byte-mutated frames, each on a connection of its own
MUTATED = FRAMES // 10
#: the fuzzing stops early (and says so) after this long
BUDGET_S = float(os.environ.get("TXMQ_FUZZ_BUDGET_S", "30"))
#: an answer must come within this (the broker's long polls are cut to 50 ms)
DEADLINE_S = 10.0
#: The broker's RSS bound.  A broker process sits at ~30 MB here once started and warmed
#: up, and the fuzz run adds ~4 MB (the topics, groups and offsets it creates, the
#: consume-queue and index pages it touches).  96 MB is three times the idle size: a leak
#: of a few KB per request, or a header that makes the broker allocate what a length field
#: claims (up to 4 GiB), crosses it; allocator and Python-version differences do not.
RSS_BOUND_MB = 96
#: what the broker may log for the whole run: a line per topic created or protocol error
LOG_BOUND = 2 * 1024 * 1024

NORMAL_TOPIC = "fuzz-normal"
NORMAL_GROUP = "fuzz-normal-group"
PROTECTED = NORMAL_TOPIC.encode()  # no fuzzed frame holds it (the group's name starts so)
#: requests a broker's client port does not serve: broker-to-client ones, the name
#: server's, the controller's, and replication's (the HA port's)
NOT_ROUTED = {
    RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
    RequestCode.CHECK_TRANSACTION_STATE,
    RequestCode.RESET_CONSUMER_CLIENT_OFFSET,
    RequestCode.REGISTER_BROKER,
    RequestCode.UNREGISTER_BROKER,
    RequestCode.GET_BROKER_CLUSTER_INFO,
    RequestCode.HA_HELLO,
    RequestCode.HA_TRANSFER,
    RequestCode.HA_GET_METADATA,
    RequestCode.HA_HAND_BACK_OFFSETS,
    RequestCode.CONTROLLER_HEARTBEAT,
    RequestCode.CONTROLLER_ELECT_MASTER,
    RequestCode.CONTROLLER_GET_REPLICA_INFO,
}


# -- oracles --------------------------------------------------------------------------------


@dataclass
class Tally:
    codes: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    #: requests answered SUCCESS, by request code: which services were reached
    ok: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(what)


def expected(code: int, version: int, header: bytes) -> tuple[set[int] | None, Any]:
    """The answer codes allowed (None: any but SYSTEM_ERROR) and the request class."""
    try:
        cls = request_class(code, version)
    except TxmqError as exc:
        return {exc.code}, None
    if code in NOT_ROUTED:
        return {ResponseCode.REQUEST_CODE_NOT_SUPPORTED}, cls
    try:
        decode(cls, header)
    except Exception:  # BadRequest; anything else is as bad a header for the broker
        return {ResponseCode.BAD_REQUEST}, cls
    return None, cls


def check_answer(
    tally: Tally, frame: Frame, code: int, version: int, header: bytes, what: str
) -> None:
    allowed, cls = expected(code, version, header)
    got = frame.code
    name = ResponseCode(got).name if got in set(ResponseCode) else str(got)
    tally.codes[name] += 1
    where = f"code {code} v{version} ({what}), header {header[:120]!r}"
    if frame.version != version:
        tally.fail(f"{where}: answered with version {frame.version}")
    if got != ResponseCode.SUCCESS:
        try:
            message = decode(ErrorAnswer, frame.header).error
        except TxmqError:
            tally.fail(f"{where}: error answer {name} with an unreadable header")
            return
        if len(message) > MAX_MESSAGE + 64:
            tally.fail(f"{where}: error message of {len(message)} characters")
    if got == ResponseCode.SYSTEM_ERROR:
        tally.fail(f"{where}: SYSTEM_ERROR {error_message(frame)[:300]}")
    elif allowed is not None and got not in allowed:
        tally.fail(f"{where}: answered {name} ({error_message(frame)[:200]}), not {allowed}")
    elif got == ResponseCode.SUCCESS:
        tally.ok[code] += 1
        try:
            decode(cls.RESPONSE, frame.header)
        except TxmqError as exc:
            tally.fail(f"{where}: SUCCESS with a header that is no {cls.RESPONSE.__name__}: {exc}")


class FuzzConnection:
    """The long-lived raw connection: a request at a time, its answer awaited."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=DEADLINE_S)
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.rid = 0
        self.oneway_ids: set[int] = set()

    def next_id(self) -> int:
        self.rid += 1
        return self.rid

    def note_queue_counts(self, known: Known) -> None:
        """Ask for every topic's queue count (GET_ALL_TOPIC_CONFIG) and keep the most each
        topic had in ``known``."""
        rid = self.next_id()
        self.sock.sendall(encode_frame(FrameKind.REQUEST, RequestCode.GET_ALL_TOPIC_CONFIG, rid))
        answer = self.answer(rid)
        assert answer.code == ResponseCode.SUCCESS, error_message(answer)
        counts = known.queue_counts
        for row in decode(TopicList, answer.header).topics:
            counts[row.topic] = max(counts.get(row.topic, 0), row.queue_nums)

    def answer(self, rid: int) -> Frame:
        """The response to request ``rid`` (the broker's own requests skipped)."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            while self.frames:
                frame = self.frames.pop(0)
                if frame.kind != FrameKind.RESPONSE:
                    continue  # NOTIFY_CONSUMER_IDS_CHANGED, CHECK_TRANSACTION_STATE
                assert frame.request_id not in self.oneway_ids, "a oneway request was answered"
                assert frame.request_id == rid, f"answer to {frame.request_id}, awaited {rid}"
                return frame
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to request {rid} within {DEADLINE_S}s"
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 20)
            assert data, f"the broker closed the connection instead of answering {rid}"
            self.frames.extend(self.decoder.feed(data))


def send_mutated(address: str, data: bytes, tally: Tally) -> None:
    """``data`` on a connection of its own, then its end: the answers (never SYSTEM_ERROR;
    the frame error for a bad frame) and the broker closing the connection."""
    try:
        FrameDecoder().feed(data)
        bad: int | None = None
    except (MalformedFrame, FrameTooLarge) as exc:
        bad = exc.code
    got = bytearray()
    with socket.create_connection(parse_address(address), timeout=DEADLINE_S) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the broker closed first (a bad prefix): what it sent is read below
        deadline = time.monotonic() + DEADLINE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                tally.fail(f"mutated frame {data[:40]!r}: connection not closed by the broker")
                return
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    try:
        frames = FrameDecoder().feed(bytes(got))
    except TxmqError as exc:
        tally.fail(f"mutated frame {data[:40]!r}: the broker's answer is malformed: {exc}")
        return
    frames = [f for f in frames if f.kind == FrameKind.RESPONSE]  # not the broker's NOTIFYs
    for frame in frames:
        tally.codes[f"mutated:{frame.code}"] += 1
        if frame.code == ResponseCode.SYSTEM_ERROR:
            tally.fail(f"mutated frame {data[:40]!r}: SYSTEM_ERROR {error_message(frame)}")
    if bad is not None and not any(f.code == bad for f in frames):
        tally.fail(f"mutated frame {data[:40]!r}: no {bad} answer: {[f.code for f in frames]}")


# -- the normal traffic beside it -----------------------------------------------------------


class NormalTraffic:
    """A producer sending to :data:`NORMAL_TOPIC` and a push consumer receiving it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acked: dict[str, tuple[int, int]] = {}
        self.received: set[str] = set()
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.consumer = PushConsumer(
            address, NORMAL_GROUP, listener=self._on_message, consume_from="FIRST_OFFSET"
        )
        self.consumer.subscribe(NORMAL_TOPIC)
        self.thread = threading.Thread(target=self._produce, name="normal-producer")

    def _on_message(self, msg: MessageExt) -> None:
        with self._lock:
            self.received.add(msg.msg_id)

    def _produce(self) -> None:
        try:
            with Producer(self.address, "fuzz-normal-producer") as producer:
                i = 0
                while not self.stop.is_set() or i < 100:
                    r = producer.send(Message(NORMAL_TOPIC, b"n%d" % i, keys=f"n{i}"))
                    self.acked[r.msg_id] = (r.queue_id, r.queue_offset)
                    i += 1
                    time.sleep(0.01)
        except Exception as exc:  # the test reports it
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> NormalTraffic:
        self.consumer.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        self.consumer.stop()

    def all_received(self) -> bool:
        with self._lock:
            return set(self.acked) <= self.received


# -- the test -------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    config = tmp_path / "broker.toml"
    config.write_text(
        "[broker]\n"
        "long_polling_max_s = 0.05\n"  # fuzzed long polls must not stall the fuzzer
        "export_segments = false\n"
        "offset_persist_interval_s = 0.5\n"
    )
    bp = BrokerProcess(tmp_path / "store", ["--config", str(config)], tmp_path / "broker.log")
    yield bp.start()
    if bp.proc is not None and bp.proc.poll() is None:
        bp.proc.kill()
        bp.proc.wait(10)


def warm_up(address: str, known: Known) -> None:
    """State for fuzzed requests to hit: topics, messages with keys, pending half messages."""
    with AdminClient(address) as admin:
        admin.create_topic(NORMAL_TOPIC, 4)
        admin.create_topic("fz-a", 2)
    with Producer(address, "fzg") as producer:
        for i in range(5):
            r = producer.send(Message("fz-a", b"m%d" % i, keys="k1", tags="a"))
            known.msg_ids.append(r.msg_id)
            known.offsets.append(int(r.offset_msg_id, 16))
    with TransactionProducer(address, "fzg") as tx:
        for i in range(3):
            r = tx.send_half(Message("fz-b", b"half"), transaction_id=f"fz-tx-{i}")
            known.half_offsets.append(r.transaction_offset)
            known.msg_ids.append(r.msg_id)


def fuzz(address: str, rng: random.Random, known: Known, tally: Tally) -> tuple[int, int]:
    """Send the fuzzed frames; (well-framed, mutated) sent."""
    gen = Gen(rng, known)
    codes = sorted(int(c) for c, _ in requests())
    conn = FuzzConnection(address)
    started = time.monotonic()
    sent = mutated = 0

    def one_mutated() -> None:
        nonlocal mutated
        code = rng.choice(codes)
        head = pack(gen.header(request_class(code, 1))[0])
        if PROTECTED not in head:
            valid = encode_frame(FrameKind.REQUEST, code, rng.randrange(2**32), head, b"xy")
            send_mutated(address, mutate(rng, valid), tally)
        mutated += 1

    while sent < FRAMES and time.monotonic() - started < BUDGET_S:
        if rng.random() < 0.05:  # a code nobody defined
            code = rng.choice([0, 1, 9, 13, 999, 65535, rng.randrange(65536)])
            header: Any = gen.random_value(2)
            what = "unknown code"
        else:
            code = rng.choice(codes)
            header, what = gen.header(request_class(code, 1))
        head = pack(header)
        version = rng.choice([1] * 30 + [0, 2, 255])
        if code == RequestCode.UPDATE_AND_CREATE_TOPIC:
            conn.note_queue_counts(known)  # before a topic's queue count may shrink
        kind = rng.choice([FrameKind.REQUEST] * 30 + [FrameKind.ONEWAY, FrameKind.RESPONSE])
        rid = conn.next_id()
        frame = encode_frame(kind, code, rid, head, gen.body(code, header), version)
        if rng.random() < 0.1 and len(frame) > PREFIX.size:  # flips past the prefix
            data = bytearray(frame)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(PREFIX.size, len(data))] ^= 1 << rng.randrange(8)
            frame = bytes(data)
            head = frame[PREFIX.size : PREFIX.size + len(head)]
            what += ", flipped"
        if PROTECTED in frame:
            continue
        conn.sock.sendall(frame)
        sent += 1
        tally.kinds[kind.name] += 1
        if kind == FrameKind.ONEWAY:
            conn.oneway_ids.add(rid)
        elif kind == FrameKind.REQUEST:
            answer = conn.answer(rid)
            check_answer(tally, answer, code, version, head, what)
            if code == RequestCode.SEND_MESSAGE and answer.code == ResponseCode.SUCCESS:
                stored = decode(Sent, answer.header)
                known.offsets.append(int(stored.offset_msg_id, 16))
                known.msg_ids.append(stored.msg_id)
                if stored.transaction_offset >= 0:
                    known.half_offsets.append(stored.transaction_offset)
        if sent % 10 == 0 and mutated < MUTATED:  # interleaved with the rest
            one_mutated()
    while mutated < MUTATED and time.monotonic() - started < BUDGET_S:
        one_mutated()
    conn.sock.close()
    return sent, mutated


def test_fuzzed_frames_get_errors_and_the_broker_serves_on(broker: BrokerProcess) -> None:
    print(f"\nfuzz seed {SEED} (TXMQ_FUZZ_SEED), {FRAMES} frames + {MUTATED} mutated ones")
    assert broker.proc is not None
    pid, address = broker.proc.pid, broker.address
    known = Known()
    warm_up(address, known)
    tally = Tally()
    started = time.monotonic()
    with NormalTraffic(address) as normal:
        with PeakRss(broker) as rss:
            sent, mutated = fuzz(address, random.Random(SEED), known, tally)
        took = time.monotonic() - started
        assert broker.proc.poll() is None, broker.output()[-3000:]
        rss_after = rss_mb(pid)
        still_serving(address)
        normal.stop.set()
        normal.thread.join(60)
        assert not normal.errors, normal.errors
        wait_for(normal.all_received, timeout=30)
    print(
        f"fuzzed {sent} frames {dict(tally.kinds)} and {mutated} mutated ones in {took:.1f}s; "
        f"answers: {dict(sorted(tally.codes.items()))}"
    )
    print(
        f"broker RSS {rss.before:.1f} MB before, peak {rss.peak:.1f} MB while fuzzing, "
        f"{rss_after:.1f} MB after, bound {RSS_BOUND_MB}"
    )
    print(f"normal traffic: {len(normal.acked)} messages sent and received")
    never = sorted(set(codes_served()) - set(tally.ok))
    print(f"request codes never answered SUCCESS: {never or 'none'}")
    if sent < FRAMES:
        print(f"(the time budget of {BUDGET_S:g}s ran out after {sent} of {FRAMES} frames)")
    assert not tally.problems, "\n".join(tally.problems)
    assert rss.peak < RSS_BOUND_MB and rss_after < RSS_BOUND_MB
    log = broker.output()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]
    assert len(log) < LOG_BOUND, f"the broker logged {len(log)} bytes"

    # a clean stop, and a start on the same store: nothing invalid was persisted
    assert broker.terminate() == 0, log[-3000:]
    saved = check_store(broker.store, known.queue_counts)
    print(f"offsets.json: {saved} saved offsets checked against topics.json")
    first = len(broker.output())
    broker.start()
    again = broker.output()[first:]
    assert "is damaged" not in again and "previous stop clean" in again, again
    read_back: set[str] = set()
    with PullConsumer(broker.address, "fuzz-check") as consumer:
        for queue_id in range(4):
            offset = consumer.min_offset(NORMAL_TOPIC, queue_id)
            while offset < consumer.max_offset(NORMAL_TOPIC, queue_id):
                got = consumer.pull(NORMAL_TOPIC, queue_id, offset, max_msgs=256, long_poll=0)
                assert got.next_offset > offset
                read_back.update(m.msg_id for m in got.messages)
                offset = got.next_offset
    assert set(normal.acked) <= read_back
    assert broker.terminate() == 0


def codes_served() -> list[int]:
    return sorted(int(c) for c, _ in requests() if c not in NOT_ROUTED)


def check_store(store: Path, queue_counts: dict[str, int]) -> int:
    """No state file set aside; every saved topic a valid name; every saved offset a
    group's on a saved topic, of a queue id the topic has (or had: ``queue_counts``, the
    most queues each topic had before its count was changed), not negative; consume queues
    only under ``consumequeue/<valid topic>/<queue id>/``.  The number of saved offsets."""
    config = store / "config"
    assert not [p.name for p in config.iterdir() if ".bad-" in p.name]
    topics = json.loads((config / "topics.json").read_text())["topics"]
    assert [t for t in topics if validate_topic_name(t) is not None] == []
    queue_nums = {name: entry["queue_nums"] for name, entry in topics.items()}
    assert all(type(n) is int and n >= 1 for n in queue_nums.values()), queue_nums
    had = {name: max(n, queue_counts.get(name, 0)) for name, n in queue_nums.items()}
    offsets = json.loads((config / "offsets.json").read_text())["offsets"]
    assert offsets, "the normal consumer's offsets were saved"
    bad, saved = [], 0
    for group, by_topic in offsets.items():
        for topic, by_queue in by_topic.items():
            for queue_id, offset in by_queue.items():
                saved += 1
                # JSON keys are strings: a queue id must read back as the int it was
                if not (
                    group
                    and topic in queue_nums
                    and queue_id.isdigit()
                    and queue_id == str(int(queue_id))
                    and int(queue_id) < had[topic]
                    and type(offset) is int
                    and offset >= 0
                ):
                    bad.append((group, topic, queue_id, offset))
    assert bad == [], f"offsets.json holds offsets the broker should have refused: {bad[:20]}"
    for topic_dir in (store / "consumequeue").iterdir():
        assert validate_topic_name(topic_dir.name) is None, topic_dir
        assert all(q.is_dir() and q.name.isdigit() for q in topic_dir.iterdir()), topic_dir
    assert not [p for p in store.iterdir() if p.name.isdigit()]
    return saved
