"""``txmq namesrv start``: a name server in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
from pathlib import Path

from txmq.cli.options import SubParsers, add_command
from txmq.cli.serve import run_server

__all__ = ["add_parser"]


def add_parser(sub: SubParsers) -> None:
    n = add_command(sub, "namesrv", help="run a name server (a cluster's route table)")
    nsub = n.add_subparsers(dest="namesrv_cmd", required=True, metavar="COMMAND")
    start = add_command(
        nsub,
        "start",
        help="start a name server in the foreground",
        description="Start a name server in the foreground.  Brokers started with --namesrv\n"
        "register with it every 30 s; clients given --namesrv ask it for routes.  Run two\n"
        "or more for a cluster: they never talk to each other.",
        examples="  txmq namesrv start                       # 127.0.0.1:9876\n"
        "  txmq namesrv start --host 0.0.0.0 --port 9876 --config namesrv.toml\n"
        "  txmq broker start --store ./a --namesrv 127.0.0.1:9876 --cluster C "
        "--broker-name broker-a",
    )
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port (default 9876; 0 picks a free one)")
    start.add_argument(
        "--config",
        type=Path,
        help="TOML file with a [namesrv] table (broker_expiry_s, scan_interval_s, ...)",
    )
    start.add_argument("--ready-file", help="write the bound address here once listening")
    start.set_defaults(func=start_namesrv)


def start_namesrv(args: argparse.Namespace) -> int:
    from txmq.namesrv import NamesrvConfig, NamesrvServer

    config = NamesrvConfig.load(args.config, host=args.host, port=args.port)
    server = NamesrvServer(config)

    return run_server(
        server,
        name="namesrv",
        what="name server",
        host=config.host,
        port=config.port,
        ready_file=args.ready_file,
    )
