"""The ``txmq`` command: run a broker, inspect it, manage txmq's tables, relay an outbox,
reconcile, try it out (``txmq --help``).

This package sits on top of every other one (the client, the broker, the outbox, the
reconciliation job); nothing imports it.
"""

from txmq.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
