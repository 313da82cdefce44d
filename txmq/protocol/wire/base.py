"""Typed headers: a frozen struct per request and per response, keyed by request code.

A request class names its code, its version and (as its type parameter) the response it
gets::

    class GetMaxOffset(Request[Offset], frozen=True, kw_only=True, omit_defaults=True):
        CODE = RequestCode.GET_MAX_OFFSET
        topic: Topic
        queue_id: int

Headers are msgspec structs, encoded as msgpack maps and decoded with validation in C;
:func:`decode` turns a header that does not fit into :class:`BadRequest` naming the field.
Unknown fields are ignored (an older peer skips what a newer one adds); a field added later
has a default.  A change that an older peer would misread gets a new class with a higher
``VERSION`` under the same code.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Generic, NamedTuple, TypeVar, get_args

import msgspec

from txmq.protocol.wire.errors import BadRequest, UnsupportedRequest, UnsupportedVersion, clip

__all__ = [
    "Empty",
    "ErrorAnswer",
    "Key",
    "Name",
    "NameOrEmpty",
    "Request",
    "Response",
    "Topic",
    "WithBody",
    "decode",
    "encode",
    "request_class",
    "requests",
]

R = TypeVar("R", bound="Response")
T = TypeVar("T", bound=msgspec.Struct)

#: a group or client name: not empty, at most 255 characters (RocketMQ's limit for group
#: names; the broker logs them and keeps them in memory and in offsets.json)
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
#: a group or client name that may be left empty
NameOrEmpty = Annotated[str, msgspec.Meta(max_length=255)]
#: what a message is looked up by (its id, one of its keys): not empty
Key = Annotated[str, msgspec.Meta(min_length=1)]
#: a topic name, checked by the broker's topic rules (INVALID_TOPIC, NO_PERMISSION)
Topic = str

_REQUESTS: dict[tuple[int, int], type[Request[Any]]] = {}
_DECODERS: dict[type[msgspec.Struct], msgspec.msgpack.Decoder[Any]] = {}
_encode = msgspec.msgpack.Encoder().encode
_EMPTY_MAP = b"\x80"


class Response(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The header of a successful answer."""


class Empty(Response, frozen=True, kw_only=True, omit_defaults=True):
    """An answer with nothing to say (or whose content is the frame's body)."""


class ErrorAnswer(Response, frozen=True, kw_only=True, omit_defaults=True):
    """The header of an error answer (its response code says which error)."""

    error: str = ""


class Request(msgspec.Struct, Generic[R], frozen=True, kw_only=True, omit_defaults=True):
    """The header of a request; subclasses set ``CODE`` (and ``VERSION``) and name their
    response type as the type parameter."""

    CODE: ClassVar[int]
    VERSION: ClassVar[int] = 1
    RESPONSE: ClassVar[type[Response]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], Response):
                cls.RESPONSE = args[0]
        if "CODE" in cls.__dict__:
            key = (int(cls.CODE), cls.VERSION)
            if key in _REQUESTS:
                raise TypeError(f"request code {key[0]} version {key[1]} is defined twice")
            _REQUESTS[key] = cls


class WithBody(NamedTuple, Generic[R]):
    """An answer whose frame carries a body too (stored records)."""

    header: R
    body: bytes | memoryview


def requests() -> dict[tuple[int, int], type[Request[Any]]]:
    """Every request class by (code, version)."""
    return dict(_REQUESTS)


def request_class(code: int, version: int) -> type[Request[Any]]:
    """The request class for ``code`` at ``version``, or the error to answer."""
    cls = _REQUESTS.get((code, version))
    if cls is not None:
        return cls
    known = sorted(v for c, v in _REQUESTS if c == code)
    if not known:
        raise UnsupportedRequest(f"request code {code} is not supported")
    name = _REQUESTS[(code, known[-1])].__name__
    raise UnsupportedVersion(
        f"{name} (code {code}) version {version} is not supported (versions {known})"
    )


def encode(header: msgspec.Struct) -> bytes:
    """A header as msgpack (an empty one as no bytes)."""
    data = _encode(header)
    return b"" if data == _EMPTY_MAP else data


_WHERE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


_NOT_UTF8 = "{}: the header has a string that is not UTF-8"


def decode(cls: type[T], header: bytes) -> T:
    """``header`` as a ``cls``; :class:`BadRequest` naming the field that does not fit."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(header or _EMPTY_MAP)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise BadRequest(clip(f"{cls.__name__}: {_describe(cls, str(exc))}")) from None
    except msgspec.DecodeError as exc:
        if "utf-8" in str(exc).lower():  # msgspec >= 0.23 (before: a UnicodeDecodeError)
            raise BadRequest(_NOT_UTF8.format(cls.__name__)) from None
        raise BadRequest(clip(f"{cls.__name__}: the header is not valid msgpack ({exc})")) from None
    # msgspec (before 0.23) raises these two as they are, not as a DecodeError
    except UnicodeDecodeError:
        raise BadRequest(_NOT_UTF8.format(cls.__name__)) from None
    except RecursionError:
        raise BadRequest(f"{cls.__name__}: the header is nested too deeply") from None


def _describe(cls: type[msgspec.Struct], message: str) -> str:
    """msgspec's message with the field named as the request header's field (and the
    values a field of fixed choices takes)."""
    if len(message) > 1024:  # it may quote a huge value: keep its start and the field path
        message = f"{message[:400]}…{message[-400:]}"
    m = _WHERE.match(message)
    assert m is not None
    what, path = m.group("what"), (m.group("path") or "").lstrip(".")
    missing = _MISSING.match(what)
    if missing:
        field = ".".join(p for p in (path, missing.group("field")) if p)
        return f"the header misses field {field!r}"
    if not path:
        return f"the header is not a map ({what})" if "`object`" in what else what
    if what.startswith("Invalid enum value"):
        choices = _choices(cls, path)
        if choices:
            what += f" (one of {', '.join(map(repr, choices))})"
    return f"header field {path!r}: {what}"


def _choices(cls: type[msgspec.Struct], field: str) -> tuple[Any, ...]:
    for f in msgspec.structs.fields(cls):
        if f.encode_name == field:
            return tuple(a for a in get_args(f.type) if isinstance(a, str))
    return ()
