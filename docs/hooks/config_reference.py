"""The configuration reference and the sample ``txmq.toml``, made from the settings classes.

Every key of every settings dataclass (the broker's, the name server's, the controller's,
the proxy's and the clients' ``[client]`` table) with its type, its default, its environment
variable, its command-line flag, what it means and RocketMQ's name for it.  What a key means
is the ``#:`` comment above its declaration (the Sphinx convention), in the class or the
base class that declares it; RocketMQ's name is the first ``RocketMQ's `name``` (or
``RocketMQ 5's``) in that comment.  Nothing here is written by hand twice: a key added to a
class is in the reference and the sample the next time they are built, and
``tests/unit/test_docs.py`` fails while it has no comment.

- As an MkDocs hook (``hooks:`` in ``mkdocs.yml``): ``docs/configuration.md``'s
  ``<!-- configuration-reference -->`` becomes the tables, and the build warns (an error
  under ``--strict``) when ``docs/txmq.toml`` is not what :func:`sample_toml` makes.
- As a script, ``python docs/hooks/config_reference.py``: writes ``docs/txmq.toml``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import html
import inspect
import json
import logging
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txmq.broker.state.config import BrokerConfig
from txmq.namesrv.config import ControllerConfig, NamesrvConfig
from txmq.proxy.config import ProxyConfig
from txmq.security.client import ClientSecurity

DOCS = Path(__file__).resolve().parents[1]
SAMPLE = DOCS / "txmq.toml"
MARKER = "<!-- configuration-reference -->"

log = logging.getLogger("mkdocs.plugins.txmq.config_reference")


@dataclass(frozen=True)
class Table:
    """One settings class and where its values come from."""

    section: str  # its table in a TOML file
    cls: type[Any]
    env_prefix: str
    command: tuple[str, ...]  # the txmq command whose flags set it ((): none)
    title: str
    intro: str


TABLES = (
    Table(
        "broker",
        BrokerConfig,
        "TXMQ_BROKER_",
        ("broker", "start"),
        "Broker",
        "`txmq broker start --config FILE` reads the file's `[broker]` table.",
    ),
    Table(
        "namesrv",
        NamesrvConfig,
        "TXMQ_NAMESRV_",
        ("namesrv", "start"),
        "Name server",
        "`txmq namesrv start --config FILE` reads the file's `[namesrv]` table.",
    ),
    Table(
        "controller",
        ControllerConfig,
        "TXMQ_CONTROLLER_",
        ("controller", "start"),
        "Controller",
        "`txmq controller start --config FILE` reads the file's `[controller]` table (a "
        "controller inside a name server, `--controller-store`, takes these defaults).",
    ),
    Table(
        "proxy",
        ProxyConfig,
        "TXMQ_PROXY_",
        ("proxy", "start"),
        "Proxy",
        "`txmq proxy start --config FILE` reads the file's `[proxy]` table (the gRPC proxy "
        "for RocketMQ 5 clients, [RocketMQ 5 clients](guides/grpc.md)).",
    ),
    Table(
        "client",
        ClientSecurity,
        "TXMQ_",
        (),
        "Clients",
        "Every client (`Producer`, `PushConsumer`, `AdminClient`, the `txmq` command, the "
        "console, the outbox relay) reads the `[client]` table of the file named by "
        "`$TXMQ_CONFIG`; a client's constructor arguments come last. Never a command-line "
        "flag: `ps` would show the secret.",
    ),
)

#: a flag whose destination is not its key's name -> the key
FLAG_KEYS = {"ha_master": "ha_master_address", "acl": "acl_file"}
#: a flag that sets a boolean key to False
NEGATIVE_FLAGS = {"no_auto_create_topic": "auto_create_topic"}
#: options of the server commands that are no setting
NOT_SETTINGS = {"help", "config", "ready_file", "log_level"}

_ROCKETMQ = re.compile(r"RocketMQ(?: 5)?'s `([^`]+)`")
#: a description's "(RocketMQ's `name`)" that says nothing but the name
_ALONE = re.compile(r"\s*\(RocketMQ(?: 5)?'s `[^`]+`\)")


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: Any
    description: str
    rocketmq: str | None
    env: str
    flag: str | None


# -- reading the classes ---------------------------------------------------------------------


def descriptions(cls: type[Any]) -> dict[str, str]:
    """Each field's ``#:`` comment, from the class that declares it (a subclass's wins)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        lines, _ = inspect.getsourcelines(klass)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        [node] = tree.body
        assert isinstance(node, ast.ClassDef)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                comment: list[str] = []
                at = stmt.lineno - 2  # the line above, 0-based in ``lines``
                while at >= 0 and lines[at].strip().startswith("#:"):
                    comment.insert(0, lines[at].strip()[2:].strip())
                    at -= 1
                found[stmt.target.id] = " ".join(comment)
    return found


def _declared_at(cls: type[Any], name: str) -> int:
    """How far up ``cls``'s classes ``name`` is declared: the class's own keys first."""
    return next(i for i, k in enumerate(cls.__mro__) if name in inspect.get_annotations(k))


def rocketmq_name(description: str) -> str | None:
    m = _ROCKETMQ.search(description)
    return m[1] if m else None


def type_name(hint: Any) -> str:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        name = " or ".join(f'"{m.value}"' for m in hint)
    else:
        name = {Path: "path", str: "string", int: "integer", float: "number", bool: "boolean"}[hint]
    return f"{name} (optional)" if optional else name


def command_parser(command: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of ``txmq COMMAND...``."""
    from txmq.cli.main import build_parser

    parser = build_parser()
    for word in command:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


@functools.cache
def flags(command: tuple[str, ...]) -> dict[str, str]:
    """Key -> the flag of ``txmq COMMAND...`` that sets it."""
    if not command:
        return {}
    parser = command_parser(command)
    out: dict[str, str] = {}
    for action in parser._actions:
        if action.dest in NOT_SETTINGS:
            continue
        key = NEGATIVE_FLAGS.get(action.dest) or FLAG_KEYS.get(action.dest, action.dest)
        out[key] = max(action.option_strings, key=len)
    return out


def keys(table: Table) -> list[Key]:
    hints = typing.get_type_hints(table.cls)
    said = descriptions(table.cls)
    flag_of = flags(table.command)
    out = []
    for f in sorted(dataclasses.fields(table.cls), key=lambda f: _declared_at(table.cls, f.name)):
        assert f.default is not dataclasses.MISSING, f"{f.name}: a setting needs a default"
        out.append(
            Key(
                name=f.name,
                type=type_name(hints[f.name]),
                default=f.default,
                description=said.get(f.name, ""),
                rocketmq=rocketmq_name(said.get(f.name, "")),
                env=table.env_prefix + f.name.upper(),
                flag=flag_of.get(f.name),
            )
        )
    return out


# -- writing ---------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """``value`` as TOML (None: ``""``, which every optional setting reads as unset)."""
    if value is None:
        return '""'
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path) and not value.is_absolute():
        return json.dumps(f"./{value}")  # as the user would write it
    return json.dumps(str(value))


def _shown_default(key: Key) -> str:
    if key.default is None:
        return "unset"
    text = f"`{toml_value(key.default)}`"
    if isinstance(key.default, int) and not isinstance(key.default, bool):
        if key.default >= 1024 * 1024 and key.default % (1024 * 1024) == 0:
            text += f" ({key.default // (1024 * 1024)} MiB)"
    return text


def _code(text: str) -> str:
    """``text`` as inline code that may break after an underscore or a dot, and nowhere
    else (stylesheets/extra.css)."""
    escaped = html.escape(text).replace("_", "_<wbr>").replace(".", ".<wbr>")
    return f"<code>{escaped}</code>"


def _markdown_text(description: str) -> str:
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", description)  # :mod:`x` -> `x`
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def markdown() -> str:
    """The reference's tables, one section a table."""
    out: list[str] = []
    for table in TABLES:
        found = keys(table)
        out += [
            f"## {table.title}: `[{table.section}]`",
            "",
            f"{table.intro} Environment variables: `{table.env_prefix}<KEY>`. {len(found)} keys.",
            "",
            "| key, variable, flag | type, default | meaning | RocketMQ |",
            "|---|---|---|---|",
        ]
        for key in found:
            where = "<br>".join(_code(text) for text in (key.name, key.env, key.flag) if text)
            rocketmq = _code(key.rocketmq) if key.rocketmq else ""
            meaning = _ALONE.sub("", key.description)  # the name has its column
            out.append(
                f"| {where} | {key.type}<br>{_shown_default(key)} | "
                f"{_markdown_text(meaning)} | {rocketmq} |"
            )
        out.append("")
    return "\n".join(['<div class="config-reference" markdown>', "", *out, "</div>"])


SAMPLE_HEAD = """\
# txmq.toml: every setting of txmq's servers and clients, with its default.
#
# Made from the settings classes by docs/hooks/config_reference.py, the code that makes the
# configuration reference (docs/configuration.md): run `python docs/hooks/config_reference.py`
# to write it again, never edit it by hand.
#
# One file may hold every table: `txmq broker start --config txmq.toml` reads [broker],
# `txmq namesrv start --config txmq.toml` [namesrv], `txmq controller start --config
# txmq.toml` [controller], `txmq proxy start --config txmq.toml` [proxy], and clients read
# [client] from the file named by $TXMQ_CONFIG.
# Lowest precedence first: the defaults, this file, environment variables, command-line
# flags. Uncomment a line to change that setting; "" leaves an optional setting unset.
"""


def sample_toml() -> str:
    out = [SAMPLE_HEAD.rstrip("\n")]
    for table in TABLES:
        out += ["", "", f"[{table.section}]"]
        for key in keys(table):
            plain = re.sub(r":\w+:`~?([^`]+)`", r"\1", key.description).replace("``", "")
            out.append("")
            out += [f"# {line}" for line in textwrap.wrap(plain, 88)]
            where = [key.env] + ([key.flag] if key.flag else [])
            out.append(f"# ({key.type}; also {', '.join(where)})")
            out.append(f"# {key.name} = {toml_value(key.default)}")
    return "\n".join(out) + "\n"


# -- the MkDocs hook -------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    if not SAMPLE.is_file() or SAMPLE.read_text() != sample_toml():
        log.warning(
            "docs/txmq.toml is not what the settings classes say: "
            "run `python docs/hooks/config_reference.py`"
        )


_HELP = re.compile(r"^<!-- txmq-help ([a-z -]+) -->$", re.MULTILINE)


def command_help(command: str) -> str:
    """``txmq COMMAND --help`` as it prints in an 88-column terminal."""
    parser = command_parser(tuple(command.split()))
    parser.formatter_class = functools.partial(argparse.RawDescriptionHelpFormatter, width=88)
    return parser.format_help()


def on_page_markdown(markdown_text: str, page: Any, config: Any, files: Any) -> str:
    """``configuration.md``'s marker becomes the tables; a line ``<!-- txmq-help broker
    start -->`` on any page becomes that command's ``--help``."""
    if page.file.src_uri == "configuration.md":
        if MARKER not in markdown_text:
            log.warning(f"docs/configuration.md lost its {MARKER} line")
        markdown_text = markdown_text.replace(MARKER, markdown())
    return _HELP.sub(lambda m: f"```text\n{command_help(m[1])}```", markdown_text)


if __name__ == "__main__":
    SAMPLE.write_text(sample_toml())
    print(f"wrote {SAMPLE}")
