"""Frozen settings dataclasses readable from a TOML file and environment variables.

Precedence, lowest first: the dataclass defaults, the TOML file's section, environment
variables ``<PREFIX><FIELD NAME IN CAPITALS>``, explicit overrides (for example CLI flags).
Unknown keys and values of the wrong type are errors that name the key and the source.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["DEFAULT_DELAY_LEVELS", "SettingsError", "load_settings", "parse_delay_levels"]

T = TypeVar("T")


class SettingsError(ValueError):
    """Bad configuration: an unknown key, a value of the wrong type, an unreadable file."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(name: str, value: Any, target: Any, source: str) -> Any:
    origin = typing.get_origin(target)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(target) if a is not type(None)]
        if value is None or (isinstance(value, str) and value == "" and len(args) == 1):
            return None
        target = args[0]
    try:
        if isinstance(target, type) and issubclass(target, enum.Enum):
            return target(value.lower() if isinstance(value, str) else value)
        if target is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if target is int:
            if isinstance(value, bool):
                raise ValueError("a boolean is not an integer")
            return int(value)
        if target is float:
            if isinstance(value, bool):
                raise ValueError("a boolean is not a number")
            return float(value)
        if target is Path:
            return Path(str(value)).expanduser()
        if target is str:
            if not isinstance(value, str):
                raise ValueError(f"not a string: {value!r}")
            return value
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"setting {name!r} from {source}: {exc}") from None
    return value


def _did_you_mean(name: str, known: set[str]) -> str:
    """``: did you mean 'port'?`` for the known names close to ``name`` (at most three),
    else where the known names are listed."""
    import difflib  # only on this error path: starting a process need not load it

    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    if not close:
        return " (no known key is close; docs/configuration.md lists every key)"
    return f": did you mean {' or '.join(repr(c) for c in close)}?"


def load_settings(
    cls: type[T],
    *,
    file: str | Path | None = None,
    section: str,
    env_prefix: str,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if file is not None:
        path = Path(file)
        try:
            with path.open("rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise SettingsError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise SettingsError(f"config file {path}: [{section}] is not a table")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise SettingsError(
                    f"config file {path}: unknown key {key!r} in [{section}]"
                    f"{_did_you_mean(name, fields)}"
                )
            values[name] = _convert(name, value, hints[name], f"{path} [{section}]")
    environ = os.environ if env is None else env
    for name in fields:
        var = env_prefix + name.upper()
        if var in environ:
            values[name] = _convert(name, environ[var], hints[name], f"${var}")
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in fields:
            raise SettingsError(f"unknown setting {name!r}{_did_you_mean(name, fields)}")
        values[name] = _convert(name, value, hints[name], "the command line")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from None


#: RocketMQ's ``messageDelayLevel``: level 1 is the first entry
DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_LEVEL = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_delay_levels(text: str, *, setting: str = "message_delay_levels") -> tuple[int, ...]:
    """The delays of ``"1s 5s 10s 30s 1m ..."`` in milliseconds (units ms, s, m, h, d).

    Raises :class:`SettingsError` naming ``setting`` for an empty list, an unknown unit or
    a delay that is not positive.
    """
    if not isinstance(text, str):
        raise SettingsError(f"setting {setting!r} must be a string like {DEFAULT_DELAY_LEVELS!r}")
    levels: list[int] = []
    for token in text.replace(",", " ").split():
        m = _LEVEL.fullmatch(token.strip().lower())
        if m is None:
            raise SettingsError(
                f"setting {setting!r}: {token!r} is not a delay like 500ms, 10s, 2m, 1h or 1d"
            )
        ms = round(float(m.group(1)) * _UNIT_MS[m.group(2)])
        if ms <= 0:
            raise SettingsError(f"setting {setting!r}: delay {token!r} must be positive")
        levels.append(ms)
    if not levels:
        raise SettingsError(f"setting {setting!r} needs at least one delay level")
    return tuple(levels)
