"""``txmq broker start``: a broker in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from txmq.cli.options import (
    CommandError,
    SubParsers,
    acl_overrides,
    add_acl_server,
    add_command,
    add_tls_server,
    tls_overrides,
)

__all__ = ["add_parser"]


def add_parser(sub: SubParsers) -> None:
    b = add_command(sub, "broker", help="run a broker")
    bsub = b.add_subparsers(dest="broker_cmd", required=True, metavar="COMMAND")
    start = add_command(
        bsub,
        "start",
        help="start a broker in the foreground",
        examples="  txmq broker start --store /var/lib/txmq\n"
        "  txmq broker start --store ./store --port 0 --flush sync --config broker.toml\n"
        "  txmq broker start --store ./a --port 10911 --namesrv 'ns1:9876;ns2:9876' \\\n"
        "      --cluster C --broker-name broker-a --advertised-address 10.0.0.5:10911\n"
        "  # a broker set of a SYNC_MASTER and a slave (the slave finds the master through\n"
        "  # the name server; without one, give it --ha-master HOST:HAPORT):\n"
        "  txmq broker start --store ./a0 --port 10911 --namesrv ns1:9876 --broker-name a \\\n"
        "      --broker-id 0 --replication sync\n"
        "  txmq broker start --store ./a1 --port 10921 --namesrv ns1:9876 --broker-name a \\\n"
        "      --broker-id 1\n"
        "  # automatic failover: a controller (here in the name server, started with\n"
        "  # --controller-store) elects the master of each broker set; ids are the replicas':\n"
        "  txmq broker start --store ./b1 --port 10931 --namesrv ns1:9876 --broker-name b \\\n"
        "      --broker-id 1 --replication sync --controller ns1:9876\n"
        "  # official RocketMQ 5 clients (gRPC) on port 8090 instead of 8081:\n"
        "  txmq broker start --store ./store --grpc-port 8090\n"
        "  # Prometheus metrics on http://0.0.0.0:9557/metrics instead of 127.0.0.1:5557:\n"
        "  txmq broker start --store ./store --host 0.0.0.0 --metrics-port 9557\n"
        "  # TLS on the client, HA and gRPC ports (clients: tls=True, tls_ca='ca.pem', or\n"
        "  # TXMQ_TLS=1 TXMQ_TLS_CA=ca.pem); --tls-ca also requires client certificates:\n"
        "  txmq broker start --store ./store --host 0.0.0.0 --tls-cert server.pem \\\n"
        "      --tls-key server.key --tls-ca ca.pem\n"
        "  # access control: clients sign with TXMQ_ACCESS_KEY/TXMQ_SECRET_KEY; the broker's\n"
        "  # own user (to register, replicate) in TXMQ_BROKER_ACCESS_KEY/_SECRET_KEY:\n"
        "  txmq broker start --store ./store --acl /etc/txmq/acl.toml",
    )
    start.add_argument(
        "--store", type=Path, help="storage folder, created if missing (default ./txmq-store)"
    )
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port (default 10911; 0 picks a free one)")
    start.add_argument("--flush", choices=["sync", "async"], help="commit-log flush mode")
    start.add_argument("--config", type=Path, help="TOML file with a [broker] table")
    start.add_argument("--segment-size", type=int, help="commit-log segment bytes")
    start.add_argument("--no-auto-create-topic", action="store_true")
    start.add_argument("--ready-file", help="write the bound address here once listening")
    start.add_argument(
        "--grpc-port",
        type=int,
        help="serve RocketMQ 5's gRPC protocol (official RocketMQ clients) on this port "
        "(default 8081 when free and txmq[grpc] is installed; 0: off)",
    )
    start.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (GET /metrics) on this port, on --host "
        "(default 5557, or a free one when taken; 0: off)",
    )
    cluster = start.add_argument_group(
        "cluster", "register with name servers (without --namesrv the broker runs alone)"
    )
    cluster.add_argument(
        "--namesrv", metavar="'H:P;H:P'", help="name servers to register with, every 30 s"
    )
    cluster.add_argument("--cluster", help="the cluster's name (default DefaultCluster)")
    cluster.add_argument(
        "--broker-name", help="the broker set's name, unique in the cluster (default broker-a)"
    )
    cluster.add_argument(
        "--broker-id",
        type=int,
        help="0: the broker set's master (default); 1, 2, ...: its slaves",
    )
    cluster.add_argument(
        "--advertised-address",
        metavar="HOST:PORT",
        help="the address clients are told (default: --host and the bound port)",
    )
    ha = start.add_argument_group(
        "replication", "a broker set of a master (--broker-id 0) and slaves (ids above 0)"
    )
    ha.add_argument(
        "--replication",
        choices=["sync", "async"],
        help="as master, acknowledge a send once a slave has it (sync: SYNC_MASTER) or at "
        "once (async: ASYNC_MASTER, the default)",
    )
    ha.add_argument("--ha-port", type=int, help="the port slaves copy from (default: --port + 1)")
    ha.add_argument(
        "--ha-advertised-address",
        metavar="HOST:PORT",
        help="the HA address slaves are told (default: the advertised host and the bound "
        "--ha-port)",
    )
    ha.add_argument(
        "--ha-master",
        metavar="HOST:PORT",
        help="a slave's master's HA address (default: what the name servers say)",
    )
    ha.add_argument(
        "--controller",
        metavar="'H:P;H:P'",
        help="heartbeat to this controller, which elects the set's master (automatic "
        "failover); --broker-id is then only this replica's id in its set",
    )
    add_tls_server(start)
    add_acl_server(start)
    start.set_defaults(func=start_broker)


def start_broker(args: argparse.Namespace) -> int:
    from txmq.broker.resources import prepare_process
    from txmq.broker.server import Broker
    from txmq.broker.state.config import BrokerConfig
    from txmq.broker.store import StoreError
    from txmq.broker.store.disk import check_writable
    from txmq.cli.serve import run_server

    overrides: dict[str, Any] = {
        "store": args.store,
        "host": args.host,
        "port": args.port,
        "flush": args.flush,
        "segment_size": args.segment_size,
        "namesrv": args.namesrv,
        "cluster": args.cluster,
        "broker_name": args.broker_name,
        "broker_id": args.broker_id,
        "advertised_address": args.advertised_address,
        "replication": args.replication,
        "ha_port": args.ha_port,
        "ha_advertised_address": args.ha_advertised_address,
        "ha_master_address": args.ha_master,
        "controller": args.controller,
        "grpc_port": args.grpc_port,
        "metrics_port": args.metrics_port,
        **tls_overrides(args),
        **acl_overrides(args),
    }
    if args.no_auto_create_topic:
        overrides["auto_create_topic"] = False
    config = BrokerConfig.load(args.config, **overrides)
    if config.store.exists() and not config.store.is_dir():
        raise CommandError(
            f"--store {config.store} is a file; give a folder (it is created if missing)"
        )
    if config.store == BrokerConfig().store:  # nobody chose it: say where it is
        print(
            f"txmq broker: store {config.store.resolve()} (the default, ./txmq-store; "
            "choose another with --store DIR)",
            flush=True,
        )
    try:  # a read-only store says so in one line, before anything else is said
        check_writable(config.store)
    except StoreError as exc:
        raise CommandError(str(exc)) from None
    broker = Broker(config)
    prepare_process()

    return run_server(
        broker,
        name="broker",
        what="broker",
        host=config.host,
        port=config.port,
        ready_file=args.ready_file,
        explain=lambda exc: _store_error(exc, config.store),
    )


def _store_error(exc: BaseException, store: Path) -> BaseException | None:
    from txmq.broker.store import StoreError
    from txmq.broker.store.disk import unwritable

    if isinstance(exc, StoreError):
        return CommandError(str(exc))
    why = unwritable(store, exc)  # e.g. remounted read-only, or full, while starting
    return CommandError(why) if why is not None else None
