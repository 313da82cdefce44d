"""A fuzz test of the signed-request path, against a broker process with access control.

Frames of every request code go to the broker: unsigned ones (headers from
``tests/fuzzing.py``), and signed ones altered after signing — a bit flipped anywhere in the
auth trailer, the header or the body; the code swapped; another user's access key on the
signature; a random or cut trailer; a stale or future time; replays of frames that were
accepted.  Valid signed sends are mixed in on the same connection.  What must hold:

* no altered, replayed or unsigned frame is ever accepted: each is answered
  AUTHENTICATION_FAILED (a code or version the broker does not serve may instead be
  REQUEST_CODE_NOT_SUPPORTED or VERSION_NOT_SUPPORTED, answered before anyone is asked who
  they are), never SUCCESS, never SYSTEM_ERROR, within a deadline; an altered send is
  always AUTHENTICATION_FAILED;
* the valid sends mixed in are all accepted, and afterwards the topic holds exactly those
  messages (and the background producer's): nothing a refused frame carried was stored;
* a trailer whose length field points outside the frame is MALFORMED_FRAME and closes that
  connection only;
* the broker stays up, logs no stack trace, and a signed producer and consumer work
  beside the fuzzing and after it.

Deterministic for ``TXMQ_FUZZ_SEED``; bounded by ``TXMQ_FUZZ_FRAMES`` and
``TXMQ_FUZZ_BUDGET_S``.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tests.acl_support import secured_broker
from tests.conftest import BrokerProcess
from tests.fuzzing import Gen, Known, pack
from txmq import Message
from txmq.protocol.message import MessageExt
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import (
    Frame,
    FrameDecoder,
    FrameKind,
    GetMaxOffset,
    SendMessage,
    encode,
    encode_frame,
    requests,
)
from txmq.protocol.wire.errors import ResponseCode
from txmq.protocol.wire.frame import PREFIX, encode_signed_frame
from txmq.security.credentials import Credentials
from txmq.security.signing import Signer
from txmq.sync import Producer, PullConsumer

SEED = int(os.environ.get("TXMQ_FUZZ_SEED", "20261125"))
FRAMES = int(os.environ.get("TXMQ_FUZZ_FRAMES", "5000"))
BUDGET_S = float(os.environ.get("TXMQ_FUZZ_BUDGET_S", "30"))
DEADLINE_S = 10.0
TOPIC = "fuzz-orders"
POLICY = f"""
[users.alice]
secret_key = "alice-secret"
rules = [
  {{ resource = "topic:{TOPIC}", actions = ["pub"] }},
  {{ resource = "topic:bg", actions = ["all"] }},
]

[users.ops]
secret_key = "ops-secret-1"
super = true
"""
ALICE = Credentials("alice", "alice-secret")
OPS = Credentials("ops", "ops-secret-1")
REFUSED = {ResponseCode.AUTHENTICATION_FAILED}
#: what a request the broker does not serve is answered, signed or not
UNSERVED = {ResponseCode.REQUEST_CODE_NOT_SUPPORTED, ResponseCode.VERSION_NOT_SUPPORTED}


class Wire:
    """One connection; ``exchange`` writes a request frame and reads its answer."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=DEADLINE_S)
        self.decoder = FrameDecoder()

    def exchange(self, data: bytes) -> Frame:
        self.sock.sendall(data)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the broker closed the connection")
            frames = self.decoder.feed(chunk)
            if frames:
                (frame,) = frames
                return frame
        raise AssertionError(f"no answer within {DEADLINE_S} s")

    def close(self) -> None:
        self.sock.close()


def flip(rng: random.Random, data: bytes, start: int = 0, end: int | None = None) -> bytes:
    end = len(data) if end is None else end
    if end <= start:
        return data
    out = bytearray(data)
    out[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
    return bytes(out)


class Fuzzer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.gen = Gen(rng, Known())
        self.classes = sorted(requests().values(), key=lambda c: (c.CODE, c.VERSION))
        self.signer = Signer(ALICE)
        self.rid = 0
        self.accepted: list[bytes] = []  # valid frames, replayed later

    def next_id(self) -> int:
        self.rid += 1
        return self.rid

    def valid_send(self) -> bytes:
        header = encode(SendMessage(topic=TOPIC, queue_id=self.rng.randrange(4)))
        body = b"valid-%d" % self.rid
        return self.signer.frame(
            FrameKind.REQUEST, SendMessage.CODE, self.next_id(), header, body, 1
        )

    def some_request(self) -> tuple[int, int, bytes, bytes]:
        """A request's (code, version, header, body), sometimes one alice may make."""
        if self.rng.random() < 0.5:
            header = encode(SendMessage(topic=TOPIC, queue_id=self.rng.randrange(4)))
            return SendMessage.CODE, 1, header, b"altered"
        cls = self.rng.choice(self.classes)
        value, _ = self.gen.header(cls)
        return cls.CODE, cls.VERSION, pack(value), self.rng.randbytes(self.rng.randrange(64))

    def altered(self) -> tuple[str, bytes]:
        """A signed frame changed after signing (or never validly signed)."""
        rng = self.rng
        code, version, header, body = self.some_request()
        rid = self.next_id()
        kind = rng.choice(
            ["trailer", "header", "body", "code", "other_key", "random", "cut", "time", "none"]
        )
        trailer_of = self.signer.trailer
        if kind == "time":
            shift = rng.choice([-1, 1]) * rng.uniform(61, 10**7)
            stale = Signer(ALICE, clock=lambda: time.time() + shift)
            return kind, stale.frame(FrameKind.REQUEST, code, rid, header, body, version)
        if kind == "none":
            return kind, encode_frame(FrameKind.REQUEST, code, rid, header, body, version)
        fields_code = code
        frame_header, frame_body = header, body
        if kind == "header" and header:
            frame_header = flip(rng, header)
        elif kind == "body":
            frame_body = flip(rng, body) if body else b"x"
        elif kind == "code":
            fields_code = code
            code = rng.choice(
                [c for c in (10, 11, 14, 15, 30, 34, 37, 222, 3001, 999) if c != code]
            )

        def trailer(fields: bytes, h: bytes, b: bytes | memoryview) -> bytes:
            real = trailer_of(
                struct.pack("<BBHI", version, FrameKind.REQUEST | 0x80, fields_code, len(header)),
                header,
                body,
            )
            if kind == "trailer":
                return flip(rng, real)
            if kind == "other_key":  # ops's name on alice's signature
                return real[:25] + b"ops" + real[-32:]
            if kind == "random":
                return rng.randbytes(rng.randrange(0, 120))
            if kind == "cut":
                return real[: rng.randrange(len(real))]
            return real

        data = encode_signed_frame(
            FrameKind.REQUEST, code, rid, frame_header, frame_body, version, trailer
        )
        if kind == "header" and not header:  # nothing to flip: flip the trailer instead
            kind = "trailer"
            data = data[:-3] + flip(rng, data[-3:-2]) + data[-2:]
        return kind, data


def background(address: str, stop: threading.Event, sent: list[str], errors: list[str]) -> None:
    """A signed producer and consumer working beside the fuzzing."""
    creds = {"access_key": ALICE.access_key, "secret_key": ALICE.secret_key}
    try:
        with Producer(address, **creds) as p:
            while not stop.is_set():
                sent.append(p.send(Message("bg", b"bg-%d" % len(sent))).msg_id)
                stop.wait(0.01)
    except Exception as exc:  # pragma: no cover - reported by the test
        errors.append(repr(exc))


def read_all(address: str, topic: str) -> list[MessageExt]:
    out: list[MessageExt] = []
    creds = {"access_key": OPS.access_key, "secret_key": OPS.secret_key}
    with PullConsumer(address, "fuzz-reader", **creds) as c:
        for qid in c.queues(topic):
            offset = 0
            while True:
                res = c.pull(topic, qid, offset, max_msgs=256, long_poll=0)
                if not res.messages:
                    break
                out += res.messages
                offset = res.next_offset
    return out


@pytest.fixture
def secured(tmp_path: Path, broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    return secured_broker(broker_process, tmp_path, POLICY)


def test_altered_and_replayed_signed_requests_never_authenticate(secured: BrokerProcess) -> None:
    rng = random.Random(SEED)
    print(f"TXMQ_FUZZ_SEED={SEED}")
    address = secured.address
    fuzz = Fuzzer(rng)
    stop, bg_sent, bg_errors = threading.Event(), [], []
    bg = threading.Thread(target=background, args=(address, stop, bg_sent, bg_errors))
    bg.start()
    wire = Wire(address)
    answers: Counter[tuple[str, int]] = Counter()
    valid: list[bytes] = []
    began = time.monotonic()
    done = 0
    try:
        for i in range(FRAMES):
            if time.monotonic() - began > BUDGET_S:
                print(f"budget of {BUDGET_S} s used up after {i} frames")
                break
            done += 1
            roll = rng.random()
            if roll < 0.1:
                data = fuzz.valid_send()
                answer = wire.exchange(data)
                assert answer.code == ResponseCode.SUCCESS, answer
                valid.append(data)
                answers[("valid", answer.code)] += 1
                continue
            if roll < 0.2 and valid:
                what, data = "replay", rng.choice(valid)
            else:
                what, data = fuzz.altered()
            answer = wire.exchange(data)
            answers[(what, answer.code)] += 1
            sends = data[6:8] == struct.pack("<H", SendMessage.CODE)
            allowed = REFUSED if sends and what != "none" else REFUSED | UNSERVED
            assert answer.code in allowed, (what, answer.code, answer.header[:200])
    finally:
        stop.set()
        bg.join(30)
        wire.close()
    print(f"{done} frames in {time.monotonic() - began:.1f} s: {sorted(answers.items())}")
    assert not bg_errors, bg_errors
    assert bg_sent, "the background producer sent nothing"
    assert answers[("valid", ResponseCode.SUCCESS)] == len(valid) > 0
    assert sum(n for (what, _), n in answers.items() if what == "replay") > 0

    # a trailer length pointing outside the frame: malformed, that connection closed only
    broken = bytearray(fuzz.valid_send())
    broken[-2:] = struct.pack("<H", 60_000)
    wire = Wire(address)
    answer = wire.exchange(bytes(broken))
    assert answer.code == ResponseCode.MALFORMED_FRAME
    wire.close()

    # nothing a refused frame carried was stored: the topic holds the valid sends only
    stored = read_all(address, TOPIC)
    bodies = Counter(m.body for m in stored)
    assert all(b.startswith(b"valid-") for b in bodies), [b for b in bodies if b[:6] != b"valid-"]
    assert sum(bodies.values()) == len(valid) == len(bodies)
    assert {m.msg_id for m in read_all(address, "bg")} >= set(bg_sent)

    # the broker serves signed clients after all that, and logged no stack trace
    creds = {"access_key": ALICE.access_key, "secret_key": ALICE.secret_key}
    with Producer(address, **creds) as p:
        assert p.send(Message(TOPIC, b"after")).queue_offset >= 0
    out = secured.output()
    assert "Traceback" not in out
    assert secured.alive()
    wire = Wire(address)
    header = encode(GetMaxOffset(topic=TOPIC, queue_id=0))
    frame = wire.exchange(
        Signer(OPS).frame(FrameKind.REQUEST, GetMaxOffset.CODE, 1, header, b"", 1)
    )
    wire.close()
    assert frame.code == ResponseCode.SUCCESS
    assert msgspec.msgpack.decode(frame.header or b"\x80")["offset"] >= 0
    assert PREFIX.size == 16  # the frame layout the trailer math above assumes
