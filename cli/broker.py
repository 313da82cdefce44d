"""``txmq broker start``: a broker in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from txmq.cli.options import CommandError, SubParsers, add_command

__all__ = ["add_parser"]


def add_parser(sub: SubParsers) -> None:
    b = add_command(sub, "broker", help="run a broker")
    bsub = b.add_subparsers(dest="broker_cmd", required=True, metavar="COMMAND")
    start = add_command(
        bsub,
        "start",
        help="start a broker in the foreground",
        examples="  txmq broker start --store /var/lib/txmq\n"
        "  txmq broker start --store ./store --port 0 --flush sync --config broker.toml",
    )
    start.add_argument("--store", type=Path, help="storage folder (created if missing)")
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port (default 10911; 0 picks a free one)")
    start.add_argument("--flush", choices=["sync", "async"], help="commit-log flush mode")
    start.add_argument("--config", type=Path, help="TOML file with a [broker] table")
    start.add_argument("--segment-size", type=int, help="commit-log segment bytes")
    start.add_argument("--no-auto-create-topic", action="store_true")
    start.add_argument("--ready-file", help="write the bound address here once listening")
    start.set_defaults(func=start_broker)


def start_broker(args: argparse.Namespace) -> int:
    from txmq.broker.config import BrokerConfig
    from txmq.broker.server import Broker

    overrides: dict[str, Any] = {
        "store": args.store,
        "host": args.host,
        "port": args.port,
        "flush": args.flush,
        "segment_size": args.segment_size,
    }
    if args.no_auto_create_topic:
        overrides["auto_create_topic"] = False
    config = BrokerConfig.load(args.config, **overrides)
    if config.store.exists() and not config.store.is_dir():
        raise CommandError(
            f"--store {config.store} is a file; give a folder (it is created if missing)"
        )
    broker = Broker(config)

    async def run() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        logging.getLogger("txmq.broker").info(
                            "received %s; shutting down", signal.Signals(signum).name
                        )
                        broker.request_stop()
                        return

            async def serve(*, task_status: anyio.abc.TaskStatus[Any]) -> None:
                await broker.serve(task_status=task_status)
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            await tg.start(serve)
            if args.ready_file:
                Path(args.ready_file).write_text(broker.address)  # noqa: ASYNC240
            print(f"txmq broker listening on {broker.address}", flush=True)

    try:
        anyio.run(run)
    except BaseExceptionGroup as group:  # the task group's: say the first cause in one line
        raise _one_line(group, config.host, config.port) from None
    return 0


def _one_line(group: BaseExceptionGroup[BaseException], host: str, port: int) -> BaseException:
    from txmq.broker.store import StoreError

    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return CommandError(
            f"{host}:{port} is already in use (another broker?): stop it, or choose "
            "another --port (0 picks a free one)"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
        return CommandError(f"cannot listen on {host}: no such address on this machine (--host)")
    if isinstance(exc, StoreError):
        return CommandError(str(exc))
    return exc
