"""Every command of ``txmq`` that runs (a leaf of the parser tree, or a group that also runs
without a subcommand, as ``txmq admin transactions --parked``) shows in its own ``--help``
an example of itself."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from txmq.cli import build_parser


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser under it that runs: those without subcommands, and those
    whose subcommand may be left out."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups or not all(g.required for g in groups):
        yield parser
    for group in groups:
        for child in dict.fromkeys(group.choices.values()):  # aliases once
            yield from commands(child)


def examples_of(parser: argparse.ArgumentParser) -> list[str]:
    """The lines of ``parser``'s ``--help`` under its ``examples:`` heading that run it."""
    shown = parser.format_help()
    _, found, examples = shown.partition("\nexamples:\n")
    if not found:
        return []
    runs_it = re.compile(rf"(^|\s){re.escape(parser.prog)}(\s|$)")
    return [line for line in examples.splitlines() if runs_it.search(line)]


def test_every_command_has_an_example_of_itself_in_its_help() -> None:
    found = list(commands(build_parser()))
    assert len(found) >= 44, [p.prog for p in found]  # the tree was walked, not cut short
    missing = [p.prog for p in found if not examples_of(p)]
    assert missing == [], f"commands whose --help shows no example of themselves: {missing}"


def test_the_walk_finds_a_command_without_an_example() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(required=True)
    sub.add_parser("good", epilog="examples:\n  tool good --now", formatter_class=raw)
    sub.add_parser("elsewhere", epilog="examples:\n  tool good --now", formatter_class=raw)
    sub.add_parser("bare")
    missing = [p.prog for p in commands(parser) if not examples_of(p)]
    assert missing == ["tool elsewhere", "tool bare"]
