"""``python -m examples.orders``: the services, their fronts, the checker and the demo.

python -m examples.orders demo [--single-broker] [--secure]    # the README's demo
python -m examples.orders order-service --db URL --broker HOST:PORT [--port N]
python -m examples.orders inventory-service --db URL --namesrv 'H:P;H:P' [--port N]
python -m examples.orders payment-service --db URL --broker HOST:PORT [--port N]
    (each service: --broker, one broker's address, or --namesrv, a cluster's name servers)
python -m examples.orders seed --db URL apple=60 pear=40          # the inventory's stock
python -m examples.orders seed-accounts --db URL ann=100 bob=50   # the payment's accounts
python -m examples.orders place --url http://127.0.0.1:PORT --product apple --customer ann
python -m examples.orders orders --url http://127.0.0.1:PORT [--state CANCELLED]
python -m examples.orders stock --url http://127.0.0.1:PORT
python -m examples.orders accounts --url http://127.0.0.1:PORT
python -m examples.orders check --orders-db URL --inventory-db URL --payment-db URL
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

import anyio

from examples.orders import db as dbs

__all__ = ["main"]


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """What every service is given: where the brokers are, and how it talks to them."""
    return {
        "broker": args.broker,
        "namesrv": args.namesrv,
        "instance": args.instance,
        "heartbeat_interval": args.heartbeat_interval,
        "route_ttl": args.route_ttl,
    }


def _serve_orders(args: argparse.Namespace) -> int:
    from examples.orders.order_service import OrderService

    dbs.upgrade("orders", args.db)
    svc = OrderService(args.db, charge_deadline=args.charge_deadline, **_options(args))
    return _serve_blocking(svc, args.port)


def _serve_payment(args: argparse.Namespace) -> int:
    from examples.orders.payment_service import PaymentService

    dbs.upgrade("payment", args.db)
    return _serve_blocking(PaymentService(args.db, **_options(args)), args.port)


def _serve_blocking(svc: Any, port: int) -> int:
    """Run a blocking service until SIGTERM or SIGINT; ``READY <url>`` once it serves."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    svc.start(port)
    try:
        assert svc.server is not None
        print(f"READY {svc.server.url}", flush=True)
        stop.wait()
    finally:
        svc.stop()
    return 0


def _serve_inventory(args: argparse.Namespace) -> int:
    from examples.orders.inventory_service import InventoryService

    dbs.upgrade("inventory", args.db)

    async def run() -> None:
        svc = InventoryService(args.db, **_options(args))
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await svc.start(args.port)
            try:
                assert svc.server is not None
                print(f"READY {svc.server.url}", flush=True)
                async for _ in signals:
                    break
            finally:
                await svc.stop()

    anyio.run(run)
    return 0


def _front(args: argparse.Namespace) -> int:
    from examples.orders.web import request

    if args.cmd == "place":
        path = "/orders" + (f"?wait={args.wait:g}" if args.wait else "")
        order = {"product": args.product, "quantity": args.quantity, "customer": args.customer}
        status, data = request(args.url, "POST", path, order)
    elif args.cmd == "orders":
        status, data = request(
            args.url, "GET", "/orders" + (f"?state={args.state}" if args.state else "")
        )
    else:
        status, data = request(args.url, "GET", f"/{args.cmd}")
    print(json.dumps(data, indent=2))
    return 0 if status < 400 else 1


def _amounts(items: list[str], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, _, units = item.partition("=")
        if not name or not units.isdigit():
            raise SystemExit(f"expected {what}=NUMBER, got {item!r}")
        out[name] = int(units)
    return out


def _positive(text: str) -> float:
    """A number of seconds above 0 (argparse's type: its error is one line)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _seed(args: argparse.Namespace) -> int:
    stock = _amounts(args.stock, "PRODUCT")
    dbs.upgrade("inventory", args.db)
    dbs.seed_stock(args.db, stock)
    print(f"stock: {stock}")
    return 0


def _seed_accounts(args: argparse.Namespace) -> int:
    balances = _amounts(args.balances, "CUSTOMER")
    dbs.upgrade("payment", args.db)
    dbs.seed_accounts(args.db, balances)
    print(f"accounts: {balances}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from examples.orders.checker import check
    from examples.orders.demo import books_lines

    report = check(args.orders_db, args.inventory_db, args.payment_db)
    print("\n".join(books_lines(report)))
    return 0 if report.ok else 1


def _demo(args: argparse.Namespace) -> int:
    from examples.orders.demo import DemoConfig, print_summary, run_demo

    # None: every fault the layout supports (one broker alone: not master-failover)
    faults = () if args.no_faults else (tuple(args.fault) if args.fault else None)
    config = DemoConfig(
        orders=args.orders,
        orders_db=args.orders_db,
        inventory_db=args.inventory_db,
        payment_db=args.payment_db,
        faults=faults,
        seed=args.seed,
        single_broker=args.single_broker,
        secure=args.secure,
    )
    try:
        result = run_demo(config, progress=print)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(result)
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.orders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo", help="a local cluster + the three services, a load of orders, faults, the books"
    )
    d.add_argument("--orders", type=int, default=300, help="orders to place (default 300)")
    d.add_argument("--orders-db", help="the order service's database URL (default: SQLite)")
    d.add_argument("--inventory-db", help="the inventory's database URL (default: SQLite)")
    d.add_argument("--payment-db", help="the payment service's database URL (default: SQLite)")
    d.add_argument("--fault", action="append", help="only these faults (repeat)")
    d.add_argument("--no-faults", action="store_true")
    d.add_argument("--seed", type=int, default=7, help="random seed of the load")
    d.add_argument(
        "--single-broker",
        action="store_true",
        help="one broker alone, no name server (default: a name server and two broker sets)",
    )
    d.add_argument(
        "--secure",
        action="store_true",
        help="access control (a user per service) and mutual TLS on every port",
    )
    d.set_defaults(func=_demo)

    services = (
        ("order-service", _serve_orders),
        ("inventory-service", _serve_inventory),
        ("payment-service", _serve_payment),
    )
    for name, func in services:
        s = sub.add_parser(name, help=f"run the {name}")
        s.add_argument("--db", required=True, help="its database URL")
        to = s.add_mutually_exclusive_group(required=True)
        to.add_argument("--broker", help="one broker's HOST:PORT")
        to.add_argument("--namesrv", help="a cluster's name servers: 'HOST:PORT;HOST:PORT'")
        s.add_argument("--port", type=int, default=0, help="HTTP port (default: any free)")
        s.add_argument("--instance", default=f"{name.split('-')[0]}-1")
        s.add_argument(
            "--route-ttl",
            type=float,
            default=30.0,
            help="seconds a route is kept before the name servers are asked again (default 30)",
        )
        s.add_argument(
            "--heartbeat-interval",
            type=float,
            default=30.0,
            help="seconds between the producer's heartbeats to its brokers (default 30)",
        )
        s.set_defaults(func=func)
        if name == "order-service":
            s.add_argument(
                "--charge-deadline",
                type=_positive,
                default=30.0,
                help="seconds a saga waits for the payment's answer before it compensates "
                "(default 30)",
            )

    sd = sub.add_parser("seed", help="set the inventory's stock")
    sd.add_argument("--db", required=True)
    sd.add_argument("stock", nargs="+", help="PRODUCT=UNITS")
    sd.set_defaults(func=_seed)
    sa = sub.add_parser("seed-accounts", help="set the payment service's accounts")
    sa.add_argument("--db", required=True)
    sa.add_argument("balances", nargs="+", help="CUSTOMER=MONEY")
    sa.set_defaults(func=_seed_accounts)

    for name in ("place", "orders", "stock", "accounts"):
        f = sub.add_parser(name, help=f"{name} through a service's HTTP front")
        f.add_argument("--url", required=True, help="the service's http://HOST:PORT")
        if name == "place":
            f.add_argument("--product", required=True)
            f.add_argument("--quantity", type=int, default=1)
            f.add_argument("--customer", required=True, help="who pays")
            f.add_argument(
                "--wait",
                type=float,
                default=0.0,
                help="seconds to wait for the order's saga to end (default: answer at once, "
                "PENDING)",
            )
        if name == "orders":
            f.add_argument("--state")
        f.set_defaults(func=_front)

    c = sub.add_parser("check", help="the consistency checker")
    c.add_argument("--orders-db", required=True)
    c.add_argument("--inventory-db", required=True)
    c.add_argument("--payment-db", required=True)
    c.set_defaults(func=_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result: Any = args.func(args)
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
