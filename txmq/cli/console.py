"""``txmq console``: the web console (:mod:`txmq.console`) served with uvicorn, on
loopback unless told otherwise."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import sys

from txmq.cli.options import (
    CommandError,
    SubParsers,
    add_command,
    add_endpoints,
    add_tls_server,
    endpoints,
    non_negative_float,
)

__all__ = ["add_parser"]

#: what the console imports besides txmq (the ``console`` extra)
NEEDS = ("starlette", "jinja2", "uvicorn", "multipart")


def add_parser(sub: SubParsers) -> None:
    c = add_command(
        sub,
        "console",
        help="a web console: cluster, topics, groups, messages, transactions, dead letters, "
        "outboxes, reconciliation",
        description=(
            "Serve txmq's web console: brokers and their rates, topics and queues, consumer "
            "groups and their lag (charts kept while the console runs), messages by id or "
            "key and their journeys, undecided and parked transactions with COMMIT / ROLLBACK, "
            "dead letters and re-sending them, the outboxes of the --db databases (parked "
            "rows can be requeued), the last txmq reconcile report (--reports). Pages "
            "refresh themselves every few seconds. It listens on 127.0.0.1 unless --host "
            "says otherwise. Without --login every browser acts with the console's own "
            "credentials ($TXMQ_ACCESS_KEY / $TXMQ_SECRET_KEY, if any): put it behind "
            "something that has a login before you open it to a network. With --login "
            "every browser logs in as a user of the brokers' access control, and the "
            "brokers check each of its requests under that user's rules. Needs the "
            "console extra: pip install 'txmq[console]'."
        ),
        examples="  txmq console --broker 127.0.0.1:10911               # http://127.0.0.1:8080\n"
        "  txmq console --namesrv '127.0.0.1:9876;127.0.0.1:9877' --port 9000\n"
        "  txmq console --broker 127.0.0.1:10911 --db postgresql+psycopg://app@db/orders\n"
        "  txmq console --broker 127.0.0.1:10911 --db sqlite:///app.db --reports reconcile-out\n"
        "  # each browser logs in as a user of the brokers' ACL (brokers with --acl FILE):\n"
        "  txmq console --namesrv 10.0.0.2:9876 --host 0.0.0.0 --login\n"
        "  # https, and a broker with TLS (TXMQ_TLS=1, TXMQ_TLS_CA: the broker's authority):\n"
        "  TXMQ_TLS=1 TXMQ_TLS_CA=ca.pem txmq console --broker 10.0.0.5:10911 \\\n"
        "      --host 0.0.0.0 --tls-cert console.pem --tls-key console.key",
    )
    add_endpoints(c, None)
    c.add_argument(
        "--db",
        action="append",
        default=[],
        metavar="URL",
        help="a producer database (SQLAlchemy URL) whose transaction log and outbox the "
        "console may read, and whose parked outbox rows it may requeue (repeat for several)",
    )
    c.add_argument(
        "--reports",
        metavar="DIR",
        help="the --out folder of txmq reconcile: the reconciliation page shows its "
        "summary.json (the newest of DIR and its sub-folders)",
    )
    c.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1); the console answers only requests that name "
        "it by this address or a loopback name (0.0.0.0: any name)",
    )
    c.add_argument("--port", type=int, default=8080, help="port to listen on (8080; 0: any)")
    c.add_argument(
        "--refresh",
        type=non_negative_float,
        default=3.0,
        metavar="SECONDS",
        help="how often a page refreshes its live part (3)",
    )
    c.add_argument(
        "--sample-every",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="how often the console samples rates and lag for its charts (5)",
    )
    c.add_argument(
        "--login",
        action="store_true",
        help="every browser logs in with an access key and secret key of the brokers' access "
        "control, and asks the brokers as that user (sessions: 30 min idle, 12 h at most); "
        "the charts' sampler keeps the console's own credentials ($TXMQ_ACCESS_KEY)",
    )
    add_tls_server(c, client_ca=False, about="serve the console over https")
    c.set_defaults(func=run_console)


def _check_installed() -> None:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(
            f"the web console needs the console extra ({', '.join(missing)} not installed): "
            "pip install 'txmq[console]'"
        )


def _tls_files(args: argparse.Namespace) -> tuple[str, str] | None:
    """``--tls-cert`` and ``--tls-key`` (checked: a clear error for a file that cannot be
    used), or None for plain http."""
    from txmq.security.tls import server_context

    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise CommandError("--tls-cert and --tls-key go together: give both (or neither)")
    server_context(cert, key)  # SettingsError naming the file
    return str(cert), str(key)


def _loopback(host: str) -> bool:
    """Whether ``host`` (--host) is reachable from this machine alone."""
    if host.strip("[]").lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to


def run_console(args: argparse.Namespace) -> int:
    _check_installed()
    import uvicorn

    from txmq.console import ConsoleConfig, create_app
    from txmq.console.state import LOOPBACK

    where = endpoints(args)
    if args.host in ("0.0.0.0", "::", ""):
        allowed = ["*"]  # any name of this machine (said in the help: put a proxy in front)
    else:
        allowed = list(dict.fromkeys([args.host, *LOOPBACK]))
    config = ConsoleConfig(
        broker=where["address"],
        namesrv=where["namesrv"],
        dbs=list(args.db),
        reports=args.reports,
        refresh_s=max(args.refresh, 0.5),
        sample_every_s=max(args.sample_every, 0.2),
        allowed_hosts=allowed,
        login=args.login,
    )
    if not args.login and not _loopback(args.host):
        print(
            f"txmq console: warning: listening on {args.host} without --login: anyone who "
            "reaches it acts with the console's credentials ($TXMQ_ACCESS_KEY / "
            "$TXMQ_SECRET_KEY, or none): use --login, or put it behind a proxy that has one",
            file=sys.stderr,
        )
    tls = _tls_files(args)
    app = create_app(config)
    level = logging.getLogger().getEffectiveLevel()
    asks = config.namesrv or config.broker or "the default broker"
    logging.getLogger("txmq.console").info(
        "txmq console for %s on %s://%s:%d/", asks, "https" if tls else "http", args.host, args.port
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=level,
        access_log=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    return 0
