"""Generators for the protocol fuzz test (tests/integration/test_fuzz.py): request headers
built from each request type's fields, with fields made hostile; random msgpack values;
byte-level mutations of whole frames."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec.inspect as mi

from txmq.protocol.message import Prop
from txmq.protocol.wire import Request, RequestCode

__all__ = ["Gen", "Known", "Pairs", "Raw", "mutate", "pack"]


@dataclass(frozen=True)
class Raw:
    """msgpack bytes spliced in verbatim (what msgpack-python would not produce)."""

    data: bytes


@dataclass(frozen=True)
class Pairs:
    """A msgpack map given as pairs: any keys (unhashable ones too), duplicates allowed."""

    items: list[tuple[Any, Any]]


def pack(value: Any) -> bytes:
    """``value`` as msgpack, with :class:`Raw` pieces and :class:`Pairs` maps anywhere."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Pairs | dict):
        items = value.items if isinstance(value, Pairs) else list(value.items())
        return _head(len(items), 0x80, b"\xde", b"\xdf") + b"".join(
            pack(k) + pack(v) for k, v in items
        )
    if isinstance(value, list | tuple):
        return _head(len(value), 0x90, b"\xdc", b"\xdd") + b"".join(pack(v) for v in value)
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def _head(n: int, fix: int, sixteen: bytes, thirty_two: bytes) -> bytes:
    if n < 16:
        return bytes([fix | n])
    return sixteen + struct.pack(">H", n) if n < 65536 else thirty_two + struct.pack(">I", n)


def deep(depth: int) -> Raw:
    """A list nested ``depth`` deep (msgpack-python refuses to build one)."""
    return Raw(b"\x91" * depth + b"\x00")


TOPICS = [
    *("fz-a", "fz-b", "fz.c", "fz_d|e", "%RETRY%fzg", "%DLQ%fzg", "x" * 127, "x" * 128),
    *("RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX"),
    "TRANS_CHECK_MAX_TIME_TOPIC",
]
GROUPS = ["fzg", "fzg-2", "fz.g", "%fz"]
CLIENTS = ["fzc-1", "fzc-2"]
HOSTILE_STRINGS = [
    *("", " ", ".", "..", "...", "/", "../../etc/passwd", "a/b", "a\\b", "C:\\x", "\x00"),
    *("fz\x00a", "\n\r\t", "\u202etxt.exe", "\ufeff", "\U0001f4a9", "é", "日本", "*"),
    *("a || || b", "||", "%RETRY%", "%DLQ%", "%RETRY%%DLQ%x", "x" * 4096, "y" * 300_000),
]
HOSTILE: list[Any] = [
    *(None, True, False, [], [1, "a", None], {}, {"a": 1}, {1: 2}, {None: None}),
    *(0, -1, -(2**31), 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)),
    *(1.5, -0.0, 1e308, math.nan, math.inf, -math.inf, b"", b"\x00\xff" * 8),
    msgpack.ExtType(5, b"abc"),
    Raw(b"\xd6\xff\x00\x00\x00\x01"),  # a msgpack timestamp
    Raw(b"\xc1"),  # never used
    Raw(b"\xd9\x03\xed\xa0\x80"),  # a string that is not UTF-8
    Raw(b"\xdd\xff\xff\xff\xff"),  # an array claiming 2**32-1 items
    Raw(b"\xdf\xff\xff\xff\xff"),  # a map claiming 2**32-1 pairs
    Raw(b"\xdb\xff\xff\xff\xff"),  # a string claiming 4 GiB
    Raw(b"\xc6\x7f\xff\xff\xff"),  # bytes claiming 2 GiB
    Raw(b"\xcb" + struct.pack(">d", math.nan)),
    deep(200),
    deep(20_000),
    *HOSTILE_STRINGS,
]
HUGE_INTS = [2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**31) - 1, 2**32 + 1]
PROPERTY_VALUES = [
    *("true", "TRUE", "1", "0", "-1", "2", "18", "99", "1e309", "nan", "inf", "-inf", "x", ""),
    *("99999999999999999999", "-99999999999999999999", "k1 k2", "  ", "v" * 40_000),
]


@dataclass
class Known:
    """Values the broker has really seen (commit-log offsets, message ids), so that fuzzed
    requests reach the code behind the lookups too."""

    offsets: list[int] = field(default_factory=lambda: [0])
    half_offsets: list[int] = field(default_factory=list)
    msg_ids: list[str] = field(default_factory=list)
    #: the most queues each topic had at any time (a topic's queue count may shrink; the
    #: offsets saved for the queues it had stay, as RocketMQ keeps them)
    queue_counts: dict[str, int] = field(default_factory=dict)


class Gen:
    """Headers for a request type: valid-looking ones, and ones with fields made hostile."""

    def __init__(self, rng: random.Random, known: Known) -> None:
        self.rng = rng
        self.known = known

    # -- valid-looking values, by field name and type -------------------------------------

    def value(self, t: mi.Type, name: str) -> Any:
        rng = self.rng
        if isinstance(t, mi.UnionType):
            return self.value(rng.choice(t.types), name)
        if isinstance(t, mi.NoneType):
            return None
        if isinstance(t, mi.LiteralType):
            return rng.choice(t.values)
        if isinstance(t, mi.BoolType):
            return rng.random() < 0.5
        if isinstance(t, mi.IntType):
            return self.int_for(name)
        if isinstance(t, mi.StrType):
            return self.str_for(name)
        if isinstance(t, mi.DictType):
            if name == "properties":
                return self.properties()
            return {self.str_for("topic"): rng.choice(["*", "a || b", ""])}
        if isinstance(t, mi.ListType):
            return [self.value(t.item_type, name) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        if isinstance(t, mi.TupleType):  # (topic, queue id)
            return [self.str_for("topic"), self.int_for("queue_id")]
        if isinstance(t, mi.StructType):
            return self.struct(t)
        raise AssertionError(f"no generator for {t!r} ({name})")

    def struct(self, t: mi.StructType) -> dict[str, Any]:
        return {
            f.encode_name: self.value(f.type, f.encode_name)
            for f in t.fields
            if f.required or self.rng.random() < 0.6
        }

    def int_for(self, name: str) -> int:
        rng = self.rng
        if name in ("queue_id", "queue_nums"):
            return rng.choice([0, 1, 2, 3, 4, 7, 1024, 1025])
        if name == "transaction_offset":
            return rng.choice(self.known.half_offsets or [0])
        if name in ("commit_log_offset", "offset"):
            return rng.choice([*self.known.offsets, 1, 2**40])
        if name == "suspend_ms":
            return rng.choice([0, 0, 0, 10, 5000])
        if name == "size":
            return rng.choice([0, 1, 3, 16])
        if name == "delay_level":
            return rng.choice([0, 1, 2, -1, 18, 19, 1000])
        return rng.choice([0, 1, 2, 16, 32, 1000, 100_000])

    def str_for(self, name: str) -> str:
        rng = self.rng
        if name == "topic":
            return rng.choice(TOPICS)
        if name in ("group", "producers", "consumer_groups", "producer_groups"):
            return rng.choice(GROUPS)
        if name == "client_id":
            return rng.choice(CLIENTS)
        if name == "key":  # the warm-up's messages have key k1
            return rng.choice(["k1", "k1", "k2", "0000000000000000"])
        if name in ("msg_id", "msg_ids", "origin_msg_id"):
            ids = self.known.msg_ids[-20:] or ["00000000000000000000000000000000"]
            return rng.choice([*ids, "0000000000000000", "k1", "ZZZZZZZZZZZZZZZZ"])
        if name == "subscription":
            return rng.choice(["*", "a", "a || b", ""])
        return rng.choice(["fz", "x", "1", ""])

    def properties(self) -> dict[str, str]:
        rng = self.rng
        keys = [*sorted(Prop.ALL), "custom", "k" * 300]
        return {
            rng.choice(keys): rng.choice([*PROPERTY_VALUES, *TOPICS, *GROUPS])
            for _ in range(rng.choice([0, 1, 2, 3, 5]))
        }

    def hostile(self) -> Any:
        return self.rng.choice(HUGE_INTS if self.rng.random() < 0.2 else HOSTILE)

    # -- whole headers --------------------------------------------------------------------

    def header(self, cls: type[Request[Any]]) -> tuple[Any, str]:
        """A header for ``cls`` (a value for :func:`pack`) and how it was made."""
        rng = self.rng
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        base = self.struct(info)
        roll = rng.random()
        required = [f.encode_name for f in info.fields if f.required]
        if roll < 0.15:
            return base, "valid"
        if roll < 0.55:
            return base, f"hostile {self._mutate_one(info, base)}"
        if roll < 0.65 and required:
            del base[rng.choice(required)]
            return base, "missing field"
        if roll < 0.75:
            extra = {rng.choice(["zz", "", "topic ", "TOPIC"]): self.hostile()}
            if rng.random() < 0.3:
                extra["x"] = deep(rng.choice([100, 5000, 50_000]))
            return {**base, **extra}, "unknown fields"
        if roll < 0.85:
            for _ in range(rng.randint(2, 4)):
                self._mutate_one(info, base)
            return base, "several hostile"
        if roll < 0.9 and base:
            key = rng.choice(list(base))
            return Pairs([*base.items(), (key, self.hostile())]), "duplicate key"
        return self.random_value(3), "random header"

    def _mutate_one(self, info: mi.StructType, base: dict[str, Any]) -> str:
        """Make one field (or a field of a nested struct) hostile; its path."""
        rng = self.rng
        if not info.fields:
            base[rng.choice(["zz", "topic"])] = self.hostile()
            return "(unknown)"
        f = rng.choice(info.fields)
        t, name = f.type, f.encode_name
        if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
            items = base.get(name) or [self.struct(t.item_type)]
            inner = dict(items[0])
            path = self._mutate_one(t.item_type, inner)
            base[name] = [inner, *items[1:]]
            return f"{name}[0].{path}"
        if isinstance(t, mi.DictType) and rng.random() < 0.5:
            key = rng.choice([*sorted(Prop.ALL), "k"]) if rng.random() < 0.7 else self.hostile()
            base[name] = Pairs([(key, self.hostile() if rng.random() < 0.5 else "v")])
            return f"{name}[...]"
        if isinstance(t, mi.ListType) and rng.random() < 0.5:
            base[name] = [self.hostile()]
            return f"{name}[0]"
        base[name] = self.hostile()
        return name

    def random_value(self, depth: int) -> Any:
        """Any msgpack value (maps and arrays ``depth`` deep at most)."""
        rng = self.rng
        kind = rng.randrange(7 if depth > 0 else 5)
        if kind == 0:
            return self.hostile()
        if kind == 1:
            return rng.randint(-(2**63), 2**64 - 1)
        if kind == 2:
            return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(12)))
        if kind == 3:
            return rng.randbytes(rng.randrange(16))
        if kind == 4:
            return rng.random() * 10 ** rng.randrange(-5, 300)
        if kind == 5:
            return [self.random_value(depth - 1) for _ in range(rng.randrange(4))]
        keys = ["topic", "group", "queue_id", "x", 1, None]
        return {rng.choice(keys): self.random_value(depth - 1) for _ in range(rng.randrange(5))}

    def body(self, code: int, header: Any) -> bytes:
        """A frame body: for a batch mostly one whose size fits its entries."""
        rng = self.rng
        if code == RequestCode.SEND_BATCH_MESSAGE and isinstance(header, dict):
            entries = header.get("messages")
            sizes = [m.get("size") for m in entries if isinstance(m, dict)] if entries else []
            fit = [s for s in sizes if isinstance(s, int) and 0 <= s < 4096]
            if len(fit) == len(sizes) and rng.random() < 0.8:
                return rng.randbytes(sum(fit))
        if code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE) or rng.random() < 0.1:
            return rng.randbytes(rng.choice([0, 1, 10, 100, 3000]))
        return b""


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """A byte-level mutation of a whole valid frame, its prefix included."""
    data = bytearray(frame)
    how = rng.randrange(7)
    if how == 0:  # flip bits anywhere
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:  # truncate
        del data[rng.randrange(len(data)) :]
    elif how == 2:  # junk after it
        data += rng.randbytes(rng.randint(1, 64))
    elif how == 3:  # a wrong total length
        struct.pack_into("<I", data, 0, rng.choice([0, 1, 11, 12, 2**24, 2**31, 2**32 - 1]))
    elif how == 4:  # a wrong header length
        struct.pack_into("<I", data, 12, rng.choice([0, 1, 2**16, 2**31, 2**32 - 1]))
    elif how == 5:  # a wrong kind
        data[5] = rng.choice([3, 4, 127, 255])
    else:  # a frame, then a half of one
        data += frame[: rng.randrange(1, len(frame))]
    return bytes(data)
