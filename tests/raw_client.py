"""A client that sends what a real one never would: raw frames, any header."""

from __future__ import annotations

import socket

import msgpack

from txmq import Message
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import Frame, FrameDecoder, FrameKind, encode_frame
from txmq.sync import Producer, PullConsumer

__all__ = ["RawClient", "still_serving"]


class RawClient:
    """A plain socket speaking (or not) the protocol, to send what a client never would."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=10)
        self.decoder = FrameDecoder()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, code: int, header: object, body: bytes = b"", rid: int = 1) -> Frame:
        """``header`` as msgpack, whatever it is."""
        self.send(encode_frame(FrameKind.REQUEST, code, rid, msgpack.packb(header), body))
        frame = self.read_frame()
        assert frame is not None
        return frame

    def read_frame(self) -> Frame | None:
        while True:
            data = self.sock.recv(65536)
            if not data:
                return None
            frames = self.decoder.feed(data)
            if frames:
                return frames[0]

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def still_serving(address: str) -> None:
    with Producer(address) as p, PullConsumer(address) as c:
        r = p.send(Message("still-alive", b"yes"))
        got = c.pull("still-alive", r.queue_id, r.queue_offset, long_poll=0)
        assert [m.body for m in got.messages] == [b"yes"]
