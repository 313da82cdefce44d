"""``txmq admin cluster`` (brokers, and their broker sets: roles, epochs, slave lag, the
in-sync set, the controller's view) and ``txmq admin switchover`` (a planned change of a
set's master, through the controller)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from txmq.cli.options import CommandError, SubParsers, add_command, endpoints
from txmq.cli.tables import table
from txmq.observability.fmt import span, with_times

if TYPE_CHECKING:
    from txmq.admin.client import AdminClient, BrokerRow
    from txmq.admin.controller import SwitchoverResult

__all__ = ["add_controller_option", "add_switchover", "cluster_output", "run_switchover"]

CONTROLLER_HELP = (
    "the controller ('H1:P1;H2:P2'; default: a name server of --namesrv that hosts one, "
    "else the controllers the brokers heartbeat to)"
)


def add_controller_option(parser: argparse.ArgumentParser, default: object) -> None:
    """``--controller``, before or after ``cluster`` and ``switchover``."""
    parser.add_argument("--controller", default=default, metavar="HOST:PORT", help=CONTROLLER_HELP)


def add_switchover(asub: SubParsers) -> argparse.ArgumentParser:
    sw = add_command(
        asub,
        "switchover",
        help="make another broker of a broker set its master (a planned change)",
        description=(
            "Ask the controller to hand broker set --broker-name's master role to the broker\n"
            "--to ID (its own --broker-id; default: the in-sync slave furthest ahead).  The\n"
            "master stops acknowledging, the target copies what it lacks, and then takes\n"
            "over with a new epoch; sends move to it (the old master becomes its slave).\n"
            "The controller is --controller, else the --namesrv name servers (when one hosts\n"
            "it: txmq namesrv start --controller-store DIR), else the brokers' controller.\n"
            "--force ends a failover that waits for in-sync slaves that do not report (the\n"
            "controller's ERROR line says so): the best slave that reported becomes master,\n"
            "and acknowledged messages only the silent ones hold are lost."
        ),
        examples="  txmq admin switchover --broker-name broker-a --to 1 --namesrv 127.0.0.1:9876\n"
        "  txmq admin --namesrv 127.0.0.1:9876 switchover --broker-name broker-a\n"
        "  txmq admin switchover --broker-name broker-a --to 2 --controller 127.0.0.1:9878 "
        "--timeout 30\n"
        "  txmq admin switchover --broker-name broker-a --force   # end a stuck failover",
    )
    sw.add_argument("--broker-name", required=True, help="the broker set")
    sw.add_argument(
        "--to", type=_broker_id, default=-1, metavar="ID", help="the new master's own broker id"
    )
    sw.add_argument(
        "--timeout",
        type=_timeout,
        default=10.0,
        metavar="S",
        help="how long the target may take to catch up (seconds, default 10)",
    )
    sw.add_argument(
        "--force",
        action="store_true",
        help="end a failover that waits for silent in-sync slaves, losing what only they hold",
    )
    return sw


def _broker_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a broker id") from None
    if not 0 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"{value}: a broker id is 0 to 1024")
    return value


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.1 <= value <= 600:  # also NaN
        raise argparse.ArgumentTypeError(f"{text}: the time-out is 0.1 to 600 seconds")
    return value


# -- switchover ----------------------------------------------------------------------------


def run_switchover(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin import controller as controller_client
    from txmq.admin.client import AdminClient
    from txmq.protocol.peer import NoController

    controller = _controllers(args)
    where = endpoints(args)
    name, to, timeout, force = args.broker_name, args.to, args.timeout, args.force

    async def run() -> SwitchoverResult:
        if controller:
            return await controller_client.switchover(
                controller, name, to, timeout_s=timeout, force=force
            )
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            return await admin.switchover(name, to, timeout_s=timeout, force=force)

    try:
        result = anyio.run(run)
    except NoController as exc:
        raise CommandError(f"{exc}: name one with --controller HOST:PORT") from None
    if args.json:
        print(json.dumps({"changed": result.changed, **_as_dict(result)}, indent=2))
    elif not result.changed:
        print(
            f"broker set {result.broker_name}: broker {result.master_id} is the master "
            f"already (epoch {result.epoch}); nothing changed"
        )
    else:
        print(
            f"broker set {result.broker_name}: broker {result.master_id} "
            f"({result.master_address or '?'}) is the master in epoch {result.epoch} "
            f"(was broker {result.old_master} in epoch {result.old_epoch})"
        )
    return 0


def _as_dict(result: SwitchoverResult) -> dict[str, Any]:
    return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}


def _controllers(args: argparse.Namespace) -> list[str]:
    from txmq.protocol.peer import parse_namesrv

    given = getattr(args, "controller", None)
    return list(parse_namesrv(given, setting="--controller")) if given else []


# -- cluster -------------------------------------------------------------------------------


async def cluster_output(admin: AdminClient, args: argparse.Namespace) -> str:
    """What ``txmq admin cluster`` prints: JSON (one object per broker), or a table of the
    brokers and, for replicated broker sets, a table of the sets."""
    brokers = await admin.cluster(controller=_controllers(args) or None)
    if args.json:
        return json.dumps([with_times(msgspec.to_builtins(b)) for b in brokers], indent=2)
    wide = bool(getattr(args, "wide", False))
    lines = [_broker_line(b, any(x.error for x in brokers)) for b in brokers]
    text = table(lines, drop=BROKER_LOW_VALUE, wide=wide)
    sets = _set_lines(brokers)
    if sets:
        text += "\n\n" + table(sets, drop=SET_LOW_VALUE, wide=wide)
    return text


#: what a narrow terminal leaves out first (the first first)
BROKER_LOW_VALUE = [
    "max_offset",
    "get/s",
    "put/s",
    "topics",
    "connections",
    "version",
    "slave_lag_s",
    "slave_lag",
    "epoch",
    "uptime",
    "messages",
    "cluster",
]
SET_LOW_VALUE = ["ctl_in_sync", "ctl_master", "ctl_epoch", "electing", "cluster"]


def _broker_line(b: BrokerRow, errors: bool) -> dict[str, Any]:
    answered = bool(b.broker_role)
    return {
        "cluster": b.cluster or "-",
        "broker": b.broker_name or "-",
        # its own id (the one the controller and --to use); registered as 0 when master
        "id": b.replica_id if b.replica_id >= 0 else b.broker_id,
        "role": b.broker_role or b.role,
        "address": b.address,
        "epoch": b.epoch if answered else None,
        "slave_lag": b.slave_lag_bytes,
        "slave_lag_s": "never" if b.slave_lag_s == -1 else b.slave_lag_s,
        "version": b.version or "-",
        "uptime": span(timedelta(seconds=b.uptime_s)) if not b.error else "-",
        "topics": b.topics,
        "connections": b.connections,
        "max_offset": b.commit_log_max_offset,
        "messages": b.messages,
        "put/s": b.put_tps,
        "get/s": b.get_tps,
        "lag": b.lag,
        **({"error": b.error} if errors else {}),
    }


def _set_lines(brokers: list[BrokerRow]) -> list[dict[str, Any]]:
    """One line per broker set that is replicated (has a slave, an in-sync slave or a
    controller): its master, epoch and in-sync slaves as the master says, and the
    controller's view."""
    sets: dict[tuple[str, str], list[BrokerRow]] = {}
    for b in brokers:
        sets.setdefault((b.cluster, b.broker_name), []).append(b)
    replicated = [
        rows
        for rows in sets.values()
        if len(rows) > 1 or any(r.in_sync or r.controller is not None for r in rows)
    ]
    with_controller = any(r.controller is not None for rows in replicated for r in rows)
    lines = []
    for rows in replicated:
        masters = [r for r in rows if r.broker_role.endswith("MASTER") and not r.error]
        master = max(masters, key=lambda r: r.epoch) if masters else None
        in_sync = master.in_sync if master is not None else None
        line: dict[str, Any] = {
            "cluster": rows[0].cluster or "-",
            "broker": rows[0].broker_name or "-",
            "master": master.replica_id if master is not None else None,
            "epoch": master.epoch if master is not None else None,
            "in_sync": _ids(in_sync),
        }
        if with_controller:
            view = next((r.controller for r in rows if r.controller is not None), None)
            line["controller"] = view.address if view is not None else None
            line["ctl_epoch"] = view.epoch if view is not None else None
            line["ctl_master"] = (
                view.master_id if view is not None and view.master_id >= 0 else None
            )
            line["ctl_in_sync"] = _ids(view.in_sync) if view is not None else None
            line["electing"] = (view.electing or "no") if view is not None else None
        lines.append(line)
    return lines


def _ids(ids: list[int] | None) -> str | None:
    """A set of broker ids: "1,2", "none" (empty), None (not known: shown as -)."""
    if ids is None:
        return None
    return ",".join(map(str, ids)) if ids else "none"
