"""The ``txmq`` command's parser and entry point; each command group has its module.

Building the parser imports every command module, so those import at module level only
what their parsers need: what a command uses (the client, the broker, SQLAlchemy, ...) is
imported in the function that runs it, and ``txmq broker start`` loads no admin client.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from txmq.cli import admin, broker, console, db, namesrv, outbox, proxy, quickstart, reconcile
from txmq.cli.endings import reader_gone, to_the_end
from txmq.cli.options import CommandError, share

__all__ = ["build_parser", "main"]

EXAMPLES = """\
  txmq quickstart                                   # a broker in a temporary folder, round trip
  txmq broker start --store /var/lib/txmq --flush sync
  txmq namesrv start --port 9876                    # a cluster's route table
  txmq proxy start --namesrv 127.0.0.1:9876         # RocketMQ 5 clients, on port 8081
  txmq admin topics --broker 127.0.0.1:10911
  txmq db upgrade --url postgresql+psycopg://app@db/orders
  txmq outbox relay --db sqlite:///app.db --broker 127.0.0.1:10911
  txmq reconcile --store /var/lib/txmq --db sqlite:///app.db --sla 10m
  txmq console --broker 127.0.0.1:10911            # a web console on http://127.0.0.1:8080

Every option works before or after its subcommand; 'txmq COMMAND --help' shows more."""


class _Version(argparse.Action):
    """``--version``: prints ``txmq VERSION`` and exits; the version is looked up only then
    (importlib.metadata would add to every command's start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        import txmq

        print(f"txmq {txmq.__version__}")
        parser.exit()


def _log_level(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--log-level", default=default, help="DEBUG, INFO, WARNING (default INFO)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="txmq",
        description="Transactional messaging for Python: change your database and tell "
        "other services, as one reliable step.",
        epilog=f"examples:\n{EXAMPLES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version, help="print txmq's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    broker.add_parser(sub)
    namesrv.add_parser(sub)
    proxy.add_parser(sub)
    admin.add_parser(sub)
    db.add_parser(sub)
    outbox.add_parser(sub)
    reconcile.add_parser(sub)
    console.add_parser(sub)
    quickstart.add_parser(sub)
    share(p, _log_level)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a closed stdout (``| head``) or Ctrl-C ends it quietly
    (:mod:`txmq.cli.endings`)."""
    return to_the_end(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from txmq.protocol.settings import SettingsError  # after parsing: --help needs neither
    from txmq.protocol.wire.errors import TxmqError

    level = getattr(logging, str(args.log_level or "INFO").upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)  # we say what happened ourselves
    try:
        return int(args.func(args))
    except (TxmqError, SettingsError, CommandError, OSError, ValueError) as exc:
        if reader_gone(exc):
            raise  # stdout's reader left (| head): main ends quietly
        print(f"txmq: error: {exc}", file=sys.stderr)
        return 1
