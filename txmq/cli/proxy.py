"""``txmq proxy start``: a gRPC proxy (RocketMQ 5's proxy in cluster mode) in the foreground
until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
from pathlib import Path

from txmq.cli.options import SubParsers, add_command, add_tls_server, tls_overrides

__all__ = ["add_parser"]


def add_parser(sub: SubParsers) -> None:
    p = add_command(sub, "proxy", help="run a gRPC proxy for RocketMQ 5 clients")
    psub = p.add_subparsers(dest="proxy_cmd", required=True, metavar="COMMAND")
    start = add_command(
        psub,
        "start",
        help="start a gRPC proxy in the foreground",
        description="Start a gRPC proxy in the foreground: RocketMQ 5's proxy in cluster\n"
        "mode.  It serves the official RocketMQ 5 clients (apache.rocketmq.v2) and\n"
        "forwards to the cluster's brokers over txmq's own protocol, with routes from the\n"
        "name servers.  Proxies keep no state: run as many as the clients need, and give\n"
        "the clients all of them ('p1:8081;p2:8081'): when one dies they go on through\n"
        "another.",
        examples="  txmq proxy start --namesrv 127.0.0.1:9876             # 127.0.0.1:8081\n"
        "  txmq proxy start --namesrv 'ns1:9876;ns2:9876' --host 0.0.0.0 --grpc-port 8081 \\\n"
        "      --advertised-address 10.0.0.9:8081\n"
        "  # two proxies on one machine (clients: ClientConfiguration('h:8081;h:8082', ...)):\n"
        "  txmq proxy start --namesrv ns1:9876 --grpc-port 8082\n"
        "  # TLS for the clients (and towards brokers started with --tls-cert):\n"
        "  txmq proxy start --namesrv ns1:9876 --tls-cert proxy.pem --tls-key proxy.key\n"
        "  # brokers under access control: the proxy signs as its own user (the secret key\n"
        "  # from TXMQ_PROXY_SECRET_KEY or [proxy] of --config, never the command line):\n"
        "  TXMQ_PROXY_SECRET_KEY=... txmq proxy start --namesrv ns1:9876 --access-key proxy",
    )
    start.add_argument(
        "--namesrv", metavar="'H:P;H:P'", help="the name servers of the brokers to serve"
    )
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument(
        "--grpc-port", type=int, help="the gRPC port clients connect to (default 8081; 0: any free)"
    )
    start.add_argument(
        "--advertised-address",
        metavar="HOST:PORT",
        help="the address clients are told when they name none (default: --host and the port)",
    )
    start.add_argument("--config", type=Path, help="TOML file with a [proxy] table")
    start.add_argument(
        "--access-key",
        help="the proxy's user at brokers under access control (its secret key from "
        "TXMQ_PROXY_SECRET_KEY)",
    )
    start.add_argument("--ready-file", help="write the gRPC address here once listening")
    add_tls_server(
        start,
        about="TLS on the gRPC port (clients connect with TLS); the proxy then reaches the "
        "brokers over TLS too",
    )
    start.set_defaults(func=start_proxy)


def start_proxy(args: argparse.Namespace) -> int:
    from txmq.cli.options import CommandError
    from txmq.cli.serve import run_server

    try:
        from txmq.proxy import Proxy, ProxyConfig
    except ImportError as exc:
        raise CommandError(
            f"the proxy needs the txmq[grpc] extra ({exc}): pip install 'txmq[grpc]'"
        ) from None
    config = ProxyConfig.load(
        args.config,
        namesrv=args.namesrv,
        host=args.host,
        grpc_port=args.grpc_port,
        advertised_address=args.advertised_address,
        access_key=args.access_key,
        **tls_overrides(args),
    )
    return run_server(
        Proxy(config),
        name="proxy",
        what="proxy",
        host=config.host,
        port=config.grpc_port,
        ready_file=args.ready_file,
    )
