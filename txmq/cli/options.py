"""How the ``txmq`` command builds its parsers: examples in every ``--help``, and the
options a command group shares accepted before or after the subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

__all__ = [
    "CommandError",
    "Shared",
    "SubParsers",
    "acl_overrides",
    "add_acl_server",
    "add_command",
    "add_endpoints",
    "add_tls_server",
    "endpoints",
    "leaves",
    "non_negative_float",
    "positive_int",
    "share",
    "tls_overrides",
]

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    SubParsers = argparse._SubParsersAction


class CommandError(Exception):
    """A command cannot go on; ``txmq`` prints the message as one line and exits 1."""


#: adds options to a parser; ``default`` is None on the group, SUPPRESS on its subcommands
Shared = Callable[[argparse.ArgumentParser, object], None]


def add_command(
    sub: SubParsers,
    name: str,
    *,
    help: str,
    description: str | None = None,
    examples: str = "",
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with its examples."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=description or help[:1].upper() + help[1:] + ".",
        epilog=f"examples:\n{examples}" if examples else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers under ``parser`` that have no subcommands of their own."""
    out: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out += leaves(child) or [child]
    return out


def share(group: argparse.ArgumentParser, add: Shared) -> None:
    """Options of ``group`` that also work after any of its subcommands.

    argparse copies a subcommand's values over its parent's, so the subcommands default to
    SUPPRESS: given on either side, the option's value arrives once.
    """
    add(group, None)
    for leaf in leaves(group):
        add(leaf, argparse.SUPPRESS)


def add_endpoints(parser: argparse.ArgumentParser, default: object) -> None:
    """``--broker`` and ``--namesrv``: where a command's client connects (a :data:`Shared`)."""
    parser.add_argument(
        "--broker",
        default=default,
        metavar="HOST:PORT",
        help="one broker alone (default $TXMQ_BROKER_ADDRESS or 127.0.0.1:10911)",
    )
    parser.add_argument(
        "--namesrv",
        default=default,
        metavar="'H1:P1;H2:P2'",
        help="name servers: the whole cluster instead of one broker (default $TXMQ_NAMESRV_ADDR)",
    )


def endpoints(args: argparse.Namespace) -> dict[str, str | None]:
    """A client's ``address`` and ``namesrv`` from ``--broker`` / ``--namesrv`` (neither:
    the client reads $TXMQ_NAMESRV_ADDR, else $TXMQ_BROKER_ADDRESS)."""
    broker = getattr(args, "broker", None)
    namesrv = getattr(args, "namesrv", None)
    if broker and namesrv:
        raise CommandError(
            "give --broker or --namesrv, not both (--broker talks to that broker alone, "
            "--namesrv to the whole cluster through its name servers)"
        )
    return {"address": broker, "namesrv": namesrv}


def add_tls_server(
    parser: argparse.ArgumentParser,
    *,
    client_ca: bool = True,
    about: str = "encrypt the server's connections (clients then connect with tls=True, "
    "or TXMQ_TLS=1)",
) -> None:
    """``--tls-cert``, ``--tls-key`` (and ``--tls-ca``): TLS on a server's ports."""
    tls = parser.add_argument_group("TLS", about)
    tls.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="the server's certificate (PEM); turns TLS on"
    )
    tls.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="the certificate's private key (PEM)"
    )
    if client_ca:
        tls.add_argument(
            "--tls-ca",
            type=Path,
            metavar="FILE",
            help="require client certificates signed by this authority (PEM); clients give "
            "theirs with TXMQ_TLS_CERT/TXMQ_TLS_KEY",
        )


def tls_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of :func:`add_tls_server`'s options (None: as the file and environment
    say)."""
    return {
        "tls_cert": getattr(args, "tls_cert", None),
        "tls_key": getattr(args, "tls_key", None),
        "tls_ca": getattr(args, "tls_ca", None),
    }


def add_acl_server(parser: argparse.ArgumentParser) -> None:
    """``--acl FILE``: access control on a server's ports."""
    parser.add_argument(
        "--acl",
        type=Path,
        metavar="FILE",
        help="access control: the users and rules file (TOML; read again when it changes); "
        "every request must then be signed by a user allowed to make it",
    )
    parser.add_argument(
        "--acl-auth-strategy",
        choices=["stateful", "stateless"],
        help="with --acl: 'stateful' (default) authenticates a TLS connection once (its "
        "first signed request, or a client certificate naming a user) and takes its later "
        "requests unsigned; 'stateless' checks a signature on every request",
    )


def acl_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The setting of :func:`add_acl_server`'s option (None: as the file and environment
    say)."""
    return {
        "acl_file": getattr(args, "acl", None),
        "acl_auth_strategy": getattr(args, "acl_auth_strategy", None),
    }


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number of at least 0 (an age, a span)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text} is less than 0")
    return value
