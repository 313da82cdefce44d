"""How the ``txmq`` command builds its parsers: examples in every ``--help``, and the
options a command group shares accepted before or after the subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

__all__ = [
    "CommandError",
    "Shared",
    "SubParsers",
    "add_command",
    "leaves",
    "positive_int",
    "share",
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


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value
