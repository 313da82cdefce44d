"""The broker's small JSON files (topics, consumer offsets, delay offsets, transaction
offsets): written atomically (temp file, fsync, rename, fsync of the folder), read against
a typed schema.

A file that does not fit its schema never stops the broker: :func:`load_json` keeps every
entry that still fits, moves the file aside (``<name>.bad-<epoch ms>``, for an operator to
look at), saves what it kept in its place, logs one line saying what was dropped, and goes
on.
"""

from __future__ import annotations

import json
import logging
import os
import time
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec

__all__ = ["load_json", "salvage", "write_json_atomic"]

log = logging.getLogger("txmq.broker")

T = TypeVar("T")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` (a schema struct, or plain JSON-able values) as the file's content.

    If that fails (a full disk: ENOSPC), the old file is left as it was and the error
    raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(msgspec.to_builtins(data, str_keys=True), indent=1, sort_keys=True)
    try:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_json(path: Path, schema: type[T]) -> T:
    """The file as a ``schema`` (a msgspec struct whose fields all have defaults); the
    empty schema if the file does not exist.  A damaged file gives what can be salvaged
    of it (see the module's docstring)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return schema()
    try:
        return msgspec.json.decode(data, type=schema, strict=False)
    except msgspec.ValidationError as exc:
        why = str(exc)
    except msgspec.DecodeError as exc:
        why = f"not JSON ({exc})"
    try:
        raw = msgspec.json.decode(data)
        value, dropped = salvage(raw, schema)
    except (msgspec.DecodeError, msgspec.ValidationError):
        value, dropped = schema(), -1
    aside = path.with_name(f"{path.name}.bad-{time.time_ns() // 1_000_000}")
    os.replace(path, aside)
    # what was kept is saved at once: a broker killed before its next write keeps it too
    write_json_atomic(path, value)
    kept = "nothing could be kept" if dropped < 0 else f"{dropped} entries dropped, the rest kept"
    log.warning("%s is damaged: %s; %s; the file is kept as %s", path, _short(why), kept, aside)
    result: T = value
    return result


def salvage(value: Any, kind: Any) -> tuple[Any, int]:
    """``value`` converted to ``kind``, leaving out the entries of mappings and the fields
    of structs that do not fit (a field falls back to its default); (result, how many were
    left out).  Raises :class:`msgspec.ValidationError` if ``value`` itself does not fit."""
    origin = typing.get_origin(kind)
    if origin is dict:
        key_kind, value_kind = typing.get_args(kind)
        if not isinstance(value, dict):
            raise msgspec.ValidationError(f"expected an object, got {type(value).__name__}")
        out: dict[Any, Any] = {}
        dropped = 0
        for k, v in value.items():
            try:
                key = msgspec.convert(k, key_kind, strict=False)
                out[key], n = salvage(v, value_kind)
                dropped += n
            except msgspec.ValidationError:
                dropped += 1
        return out, dropped
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        if not isinstance(value, dict):
            raise msgspec.ValidationError(f"expected an object, got {type(value).__name__}")
        fields: dict[str, Any] = {}
        dropped = 0
        for f in msgspec.structs.fields(kind):
            if f.encode_name not in value:
                continue
            try:
                fields[f.encode_name], n = salvage(value[f.encode_name], f.type)
                dropped += n
            except msgspec.ValidationError:
                dropped += 1
        return msgspec.convert(fields, kind, strict=False), dropped
    return msgspec.convert(value, kind, strict=False), 0


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
