"""Frames: how requests and answers travel on a connection, in either direction.

    offset  size  field
    0       4     length of the rest of the frame (little-endian)
    4       1     version of the request (a response carries its request's)
    5       1     kind: 0 request, 1 response, 2 oneway request
    6       2     request code (requests) or response code (responses)
    8       4     request id (a response carries its request's id)
    12      4     header length H
    16      H     header: a msgpack map (the typed request or response,
                  :mod:`txmq.protocol.wire.base`)
    16+H    ...   body: raw bytes (message bodies, stored records)

A *signed* request (the kind byte's bit 0x80, :data:`SIGNED`) ends with an auth trailer
(who signed it, when, a nonce and the signature: :mod:`txmq.security.signing`) followed by the
trailer's length (2 bytes, little-endian); the body is what lies between the header and the
trailer.  A response may end with a trailer the same way: the server's notice about the
connection's authentication (:data:`NOTICE_AUTHENTICATED`, :data:`NOTICE_SIGN_AGAIN`; the
stateful strategy of :mod:`txmq.security.acl.binding`), which older clients ignore.

Framing is the same for every version and code, so the decoder checks only the frame
itself; the header is decoded by whoever knows its type (the request's code and version).
An error answer has a non-zero response code and the header field ``error``.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from txmq.protocol.wire.errors import FrameTooLarge, MalformedFrame

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "NOTICE_AUTHENTICATED",
    "NOTICE_SIGN_AGAIN",
    "PREFIX",
    "SIGNED",
    "SIGNED_FIELDS",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "encode_frame",
    "encode_signed_frame",
]

PREFIX = struct.Struct("<IBBHII")
#: the kind byte's flag of a signed request (an auth trailer ends the frame)
SIGNED = 0x80
_TRAILER_LEN = struct.Struct("<H")
#: the prefix fields a signature covers: version, kind (with SIGNED), code, header length
SIGNED_FIELDS = struct.Struct("<BBHI")
#: a response's notice (its trailer's first byte): the connection is authenticated, its
#: requests need not be signed; then the number (8 bytes LE) of the signed request answered
NOTICE_AUTHENTICATED = 1
#: a response's notice: the connection is not (or no longer) authenticated: sign requests
NOTICE_SIGN_AGAIN = 2
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
_EMPTY_MAP = b"\x80"
#: a decoder keeps a buffer up to this size for the next partial frame; a bigger one goes
_KEEP_BUFFER = 1024 * 1024
_encode = msgspec.msgpack.Encoder().encode


class FrameKind(enum.IntEnum):
    REQUEST = 0
    RESPONSE = 1
    ONEWAY = 2


@dataclass(slots=True)
class Frame:
    kind: FrameKind
    code: int
    request_id: int
    #: the msgpack header, undecoded (empty: an empty map)
    header: bytes = b""
    body: bytes = b""
    version: int = 1
    #: a signed request's auth trailer (empty: the request is not signed); a response's
    #: notice
    auth: bytes = b""
    #: a request being served: the notice its answer carries (set by the server's access
    #: control; empty: none)
    notice: bytes = b""


def encode_frame(
    kind: FrameKind | int,
    code: int,
    request_id: int,
    header: msgspec.Struct | bytes | None = None,
    body: bytes | memoryview = b"",
    version: int = 1,
    trailer: bytes = b"",
) -> bytes:
    """One frame; ``header`` is a typed struct (encoded here) or msgpack bytes;
    ``trailer``: a response's notice."""
    if header is None:
        head = b""
    elif isinstance(header, bytes):
        head = header
    else:
        head = _encode(header)
        if head == _EMPTY_MAP:
            head = b""
    length = PREFIX.size - 4 + len(head) + len(body)
    if trailer:
        length += len(trailer) + _TRAILER_LEN.size
        prefix = PREFIX.pack(length, version, int(kind) | SIGNED, int(code), request_id, len(head))
        return b"".join((prefix, head, body, trailer, _TRAILER_LEN.pack(len(trailer))))
    return b"".join(
        (PREFIX.pack(length, version, int(kind), int(code), request_id, len(head)), head, body)
    )


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole frames back.

    Raises :class:`FrameTooLarge` or :class:`MalformedFrame`; after that the stream cannot
    be resynchronised and the connection should answer and close.  The exception's
    ``request_id`` attribute carries the offending frame's id when known.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buf)

    def clear(self) -> None:
        """Forget what was buffered (the connection is closed)."""
        self._buf = bytearray()

    @property
    def next_frame_size(self) -> int | None:
        """The size of the frame being received, once its length has arrived."""
        if len(self._buf) < 4:
            return None
        return int.from_bytes(self._buf[:4], "little") + 4

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        if buf:
            buf += data
            src: bytes | memoryview = memoryview(buf)
        else:  # nothing pending (the common case): frames straight from what was read
            src = data
        frames: list[Frame] = []
        pos = 0
        n = len(src)
        try:
            while n - pos >= PREFIX.size:
                length, version, kind, code, request_id, hlen = PREFIX.unpack_from(src, pos)
                if length + 4 > self.max_frame_size:
                    err = FrameTooLarge(
                        f"frame of {length + 4} bytes is over the limit of "
                        f"{self.max_frame_size} bytes"
                    )
                    err.request_id = request_id
                    raise err
                signed = kind & SIGNED
                kind &= ~SIGNED
                room = length - (PREFIX.size - 4) - (_TRAILER_LEN.size if signed else 0)
                if kind > FrameKind.ONEWAY or not 0 <= hlen <= room:
                    raise _malformed(request_id, kind, length, hlen)
                end = pos + 4 + length
                if end > n:
                    break
                hstart = pos + PREFIX.size
                bend = end
                auth = b""
                if signed:
                    (alen,) = _TRAILER_LEN.unpack_from(src, end - _TRAILER_LEN.size)
                    if alen > room - hlen:
                        raise _malformed(request_id, kind, length, hlen, alen)
                    bend = end - _TRAILER_LEN.size - alen
                    auth = bytes(src[bend : end - _TRAILER_LEN.size])
                frames.append(
                    Frame(
                        FrameKind(kind),
                        code,
                        request_id,
                        bytes(src[hstart : hstart + hlen]),
                        bytes(src[hstart + hlen : bend]),
                        version,
                        auth,
                    )
                )
                pos = end
        finally:
            if src is data:
                if pos < n:
                    buf += data[pos:]
            else:
                src.release()  # type: ignore[union-attr]
                if pos == n and sys.getsizeof(buf) > _KEEP_BUFFER:
                    self._buf = bytearray()  # a big frame's memory goes with it
                elif pos:
                    del buf[:pos]
        return frames


def _malformed(
    request_id: int, kind: int, length: int, hlen: int, alen: int | None = None
) -> MalformedFrame:
    what = f"kind={kind}, length={length}, header length={hlen}"
    if alen is not None:
        what += f", auth trailer length={alen}"
    err = MalformedFrame(f"malformed frame ({what})")
    err.request_id = request_id
    return err


def encode_signed_frame(
    kind: FrameKind | int,
    code: int,
    request_id: int,
    header: bytes,
    body: bytes | memoryview,
    version: int,
    sign: Callable[[bytes, bytes, bytes | memoryview], bytes],
) -> bytes:
    """A signed request: ``sign(fields, header, body)`` gives its auth trailer, ``fields``
    being the prefix fields a signature covers (version, kind with its signed flag, code,
    header length)."""
    kind_byte = int(kind) | SIGNED
    hlen = len(header)
    trailer = sign(SIGNED_FIELDS.pack(version, kind_byte, code, hlen), header, body)
    length = PREFIX.size - 4 + hlen + len(body) + len(trailer) + _TRAILER_LEN.size
    prefix = PREFIX.pack(length, version, kind_byte, int(code), request_id, hlen)
    return b"".join((prefix, header, body, trailer, _TRAILER_LEN.pack(len(trailer))))
