"""``txmq namesrv start`` and ``txmq controller start``: a name server, or a controller of
its own, in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from txmq.cli.options import (
    SubParsers,
    acl_overrides,
    add_acl_server,
    add_command,
    add_tls_server,
    tls_overrides,
)

if TYPE_CHECKING:
    from txmq.namesrv import NamesrvServer

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
        "--broker-name broker-a\n"
        "  # with the controller inside (brokers give --controller 127.0.0.1:9876):\n"
        "  txmq namesrv start --controller-store ./controller\n"
        "  # three such name servers, their controllers on etcd (one leads):\n"
        "  txmq namesrv start --controller-store ./controller --etcd e1:2379,e2:2379,e3:2379\n"
        "  # TLS (brokers with --tls-cert reach it over TLS, checking it with their --tls-ca):\n"
        "  txmq namesrv start --host 0.0.0.0 --tls-cert server.pem --tls-key server.key\n"
        "  # access control (brokers sign with TXMQ_BROKER_ACCESS_KEY/_SECRET_KEY):\n"
        "  txmq namesrv start --acl /etc/txmq/acl.toml",
    )
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port (default 9876; 0 picks a free one)")
    start.add_argument(
        "--config",
        type=Path,
        help="TOML file with a [namesrv] table (broker_expiry_s, scan_interval_s, ...)",
    )
    start.add_argument(
        "--controller-store",
        metavar="DIR",
        help="also run the controller (master elections of replicated broker sets) here, "
        "keeping its state in DIR",
    )
    _add_etcd(start)
    start.add_argument("--ready-file", help="write the bound address here once listening")
    add_tls_server(start)
    add_acl_server(start)
    start.set_defaults(func=start_namesrv)

    c = add_command(sub, "controller", help="run a controller (automatic failover)")
    csub = c.add_subparsers(dest="controller_cmd", required=True, metavar="COMMAND")
    cstart = add_command(
        csub,
        "start",
        help="start a controller in the foreground",
        description="Start a controller in the foreground.  Brokers started with\n"
        "--controller heartbeat to it; it elects each broker set's master, and a new one\n"
        "when the master dies.  Its state (epochs, masters, in-sync replicas) is saved in\n"
        "--store, or with --etcd in etcd: then run any number of controllers (three, on\n"
        "three machines), one leads and the others take over when it goes.  A single\n"
        "controller is a single point: while it is down nothing fails over (everything\n"
        "else goes on).",
        examples="  txmq controller start --store ./controller           # 127.0.0.1:9878\n"
        "  txmq broker start --store ./a1 --namesrv ns1:9876 --broker-name a --broker-id 1 \\\n"
        "      --replication sync --controller 127.0.0.1:9878\n"
        "  # three controllers on etcd (brokers give --controller c1:9878;c2:9878;c3:9878):\n"
        "  txmq controller start --host 0.0.0.0 --advertised-address c1:9878 \\\n"
        "      --etcd e1:2379,e2:2379,e3:2379",
    )
    cstart.add_argument(
        "--store", type=Path, help="state folder (default ./txmq-controller; unused with --etcd)"
    )
    _add_etcd(cstart)
    cstart.add_argument("--host", help="address to bind (default 127.0.0.1)")
    cstart.add_argument("--port", type=int, help="port (default 9878; 0 picks a free one)")
    cstart.add_argument(
        "--config",
        type=Path,
        help="TOML file with a [controller] table (heartbeat_timeout_s, lease_s, ...)",
    )
    cstart.add_argument("--ready-file", help="write the bound address here once listening")
    add_tls_server(cstart)
    add_acl_server(cstart)
    cstart.set_defaults(func=start_controller)


def _add_etcd(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="keep the controller's state in etcd and elect a leader among the controllers "
        "given the same endpoints (needs txmq[etcd])",
    )
    parser.add_argument(
        "--advertised-address",
        metavar="HOST:PORT",
        help="with --etcd: where brokers reach this controller (default HOST:PORT)",
    )


def start_namesrv(args: argparse.Namespace) -> int:
    from txmq.namesrv import NamesrvConfig, NamesrvServer

    config = NamesrvConfig.load(
        args.config,
        host=args.host,
        port=args.port,
        controller_store=args.controller_store,
        etcd=args.etcd,
        advertised_address=args.advertised_address,
        **tls_overrides(args),
        **acl_overrides(args),
    )
    return _serve(NamesrvServer(config), "namesrv", args.ready_file)


def start_controller(args: argparse.Namespace) -> int:
    from txmq.namesrv import ControllerConfig, ControllerServer

    config = ControllerConfig.load(
        args.config,
        host=args.host,
        port=args.port,
        store=args.store,
        etcd=args.etcd,
        advertised_address=args.advertised_address,
        **tls_overrides(args),
        **acl_overrides(args),
    )
    return _serve(ControllerServer(config), "controller", args.ready_file)


def _serve(server: NamesrvServer, name: str, ready_file: str | None) -> int:
    from txmq.cli.serve import run_server

    config = server.config
    return run_server(
        server,
        name=name,
        what=server.what,
        host=config.host,
        port=config.port,
        ready_file=ready_file,
    )
