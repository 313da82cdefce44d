"""What each ``txmq admin`` command asks, as rows (and the columns of its table).

Rows from a cluster name their broker set in a first ``broker_name`` column; rows from a
broker asked directly have none (as before name servers)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import msgspec

from txmq.admin.client import AdminClient
from txmq.cli.admin_transactions import decision_table
from txmq.observability.fmt import ms_time, short_body
from txmq.protocol.message import MessageExt, Prop
from txmq.protocol.wire import PERM_READ, PERM_WRITE
from txmq.protocol.wire.errors import TxmqError

__all__ = ["DECIDED_LOW_VALUE", "Rows", "cluster_note", "low_value", "query"]

Rows = tuple[list[dict[str, Any]], list[str] | None]

MESSAGE_COLUMNS = [
    "msg_id",
    "topic",
    "queue_id",
    "queue_offset",
    "tags",
    "keys",
    "store_time",
    "body",
]


#: the columns a narrow terminal leaves out first, by command (the first first)
LOW_VALUE: dict[str, list[str]] = {
    "topics": ["brokers", "system"],
    "topic-stats": ["min_offset"],
    "offsets": ["max_offset"],
    "route": ["cluster", "perm"],
    "dlq": ["store_time", "keys", "reconsume_times"],
    "transactions": ["offset", "born", "checks", "transaction_id"],
}
DECIDED_LOW_VALUE = ["transaction_id", "was", "new_offset", "operator", "topic", "decided"]


def low_value(args: argparse.Namespace) -> list[str]:
    """The columns of this command's table that a narrow terminal leaves out first."""
    if args.admin_cmd == "transactions" and getattr(args, "decided", False):
        return DECIDED_LOW_VALUE
    return LOW_VALUE.get(args.admin_cmd, [])


def _named(row: dict[str, Any]) -> dict[str, Any]:
    """``broker_name`` first when a cluster filled it; gone (with the other fields only a
    cluster fills) when it did not."""
    name = row.pop("broker_name", "")
    if row.get("brokers") == {}:
        del row["brokers"]
    if not name:
        if row.get("cluster") == "":
            del row["cluster"]
            row.pop("broker_id", None)
        return row
    return {"broker_name": name, **row}


def _dicts(items: list[Any]) -> list[dict[str, Any]]:
    return [_named(msgspec.structs.asdict(item)) for item in items]


def _columns(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """``columns``, after ``broker_name`` when the rows have one."""
    return ["broker_name", *columns] if rows and "broker_name" in rows[0] else columns


async def query(admin: AdminClient, args: argparse.Namespace) -> Rows:
    cmd = args.admin_cmd
    name = getattr(args, "broker_name", None)
    if cmd == "route":
        return await _route(admin, args.topic)
    if cmd == "topics":
        rows = _dicts(await admin.topics())
        columns = ["topic", "queue_nums", "messages", "system"]
        return rows, [*columns, "brokers"] if rows and "brokers" in rows[0] else columns
    if cmd == "topic-stats":
        return _dicts(await admin.topic_stats(args.topic)), None
    if cmd == "topic-create":
        info = await admin.create_topic(
            args.topic, args.queues, cluster=args.cluster, broker=args.broker_name
        )
        return _dicts([info]), None
    if cmd == "offsets":
        return _dicts(await admin.offsets()), None
    if cmd == "broker-info":
        return await _broker_info(admin, args.json, name)
    if cmd == "dlq":
        return await _dlq(admin, args)
    if cmd == "transactions":
        return await _transactions(admin, args)
    if cmd == "message":
        if args.id:
            msgs = [await admin.message_by_id(args.id, broker=name)]
        else:
            msgs = await admin.messages_by_key(args.key, args.max, broker=name)
        rows = [_named({"broker_name": m.broker_name, **m.to_dict()}) for m in msgs]
        return rows, _columns(rows, MESSAGE_COLUMNS)
    raise SystemExit(f"unknown admin command {cmd}")  # pragma: no cover - argparse rejects it


async def _route(admin: AdminClient, topic: str) -> Rows:
    route = await admin.topic_route(topic)
    brokers = {b.broker_name: b for b in route.brokers}
    rows = []
    for q in sorted(route.queues, key=lambda q: q.broker_name):
        b = brokers.get(q.broker_name)
        addresses = {} if b is None else dict(sorted(b.addresses.items()))
        perm = ("r" if q.perm & PERM_READ else "-") + ("w" if q.perm & PERM_WRITE else "-")
        rows.append(
            {
                "broker_name": q.broker_name,
                "cluster": "" if b is None else b.cluster,
                "read_queues": q.read_queue_nums,
                "write_queues": q.write_queue_nums,
                "perm": perm,
                # broker id (0: the master) -> address
                "addresses": addresses,
            }
        )
    return rows, None


async def _broker_info(admin: AdminClient, as_json: bool, name: str | None) -> Rows:
    if admin.direct is not None or name is not None:
        infos = [await admin.runtime_info(broker=name)]
    else:
        infos = await admin.runtime_infos()
    dicts = [_for_role(d) for d in _dicts(infos)]
    if as_json:
        return dicts, None
    if len(dicts) == 1:
        rows = []
        for k, v in dicts[0].items():
            # a list (the store's damage findings) is one row per entry
            for one in v if isinstance(v, list) and v else [v]:
                rows.append({"key": k, "value": one})
        return rows, None
    # several brokers: one column each
    names = [d["broker_name"] for d in dicts]
    keys = [k for k in dicts[0] if k != "broker_name"]
    rows = [{"key": k, **{n: d.get(k) for n, d in zip(names, dicts, strict=True)}} for k in keys]
    return rows, ["key", *names]


#: runtime information only a master's / only a slave's has
MASTER_FIELDS = ("slave_lag_bytes", "slave_lag_s", "in_sync")
SLAVE_FIELDS = (
    "master_id",
    "master_address",
    "master_ha_address",
    "connected",
    "lag_bytes",
    "last_contact_s",
)


def _for_role(info: dict[str, Any]) -> dict[str, Any]:
    """A broker's runtime information without the fields of the other role."""
    role = info.get("broker_role", "")
    drop: tuple[str, ...] = MASTER_FIELDS if role == "SLAVE" else SLAVE_FIELDS
    if not role:  # a broker that says nothing of replication
        drop = MASTER_FIELDS + SLAVE_FIELDS
    return {k: v for k, v in info.items() if k not in drop}


async def _dlq(admin: AdminClient, args: argparse.Namespace) -> Rows:
    name = args.broker_name
    if args.dlq_cmd == "resend":
        resent = await admin.dlq_resend(args.group, None if args.all else args.id, broker=name)
        return [{"group": args.group, "resent": resent}], None
    msgs = await admin.dlq_list(args.group, args.offset, args.max, broker=name)
    if args.json:
        rows = []
        for m in msgs:
            row = {"broker_name": m.broker_name, **m.to_dict(body_limit=None)}
            row["origin_topic"] = origin_topic(m)
            row["origin_msg_id"] = m.get_property(Prop.ORIGIN_MESSAGE_ID)
            row["reason"] = m.dlq_reason
            rows.append(_named(row))
        return rows, None
    table = [_named(_dead_letter(m)) for m in msgs]
    columns = ["msg_id", "origin_topic", "reconsume_times", "keys", "store_time", "body", "reason"]
    return table, _columns(table, columns)


def _dead_letter(m: MessageExt) -> dict[str, Any]:
    return {
        "broker_name": m.broker_name,
        "msg_id": m.msg_id,
        "origin_topic": origin_topic(m),
        "reconsume_times": m.reconsume_times,
        "keys": m.keys,
        "store_time": ms_time(m.store_timestamp),
        "body": short_body(m.body),
        "reason": short_reason(m.dlq_reason),
    }


def origin_topic(m: MessageExt) -> str:
    """The topic a dead letter was first sent to (its own ``topic`` is ``%DLQ%<group>``):
    ``origin_topic`` in the table and in JSON alike, "first sent to" on the console."""
    return m.get_property(Prop.RETRY_TOPIC) or m.topic


def short_reason(reason: str | None, limit: int = 60) -> str:
    """A dead letter's reason on one table line: control characters (line breaks) as
    spaces, cut to ``limit`` characters; "-" when it has none."""
    if not reason:
        return "-"
    line = "".join(" " if not c.isprintable() else c for c in reason)
    return line if len(line) <= limit else line[: limit - 3] + "..."


async def _transactions(admin: AdminClient, args: argparse.Namespace) -> Rows:
    if args.decided:
        decided = await admin.decisions(args.max, group=args.group, broker=args.broker_name)
        if args.json:
            return _dicts(decided), None
        table = decision_table(decided)
        return table, list(table[0]) if table else None
    state = "parked" if args.parked else "pending"
    rows = await admin.transactions(state, args.max, group=args.group, broker=args.broker_name)
    if args.json:
        return _dicts(rows), None
    table = [
        _named(
            {
                "broker_name": r.broker_name,
                "msg_id": r.msg_id,
                "transaction_id": r.transaction_id,
                "group": r.group,
                "topic": f"{r.topic}/{r.queue_id}",
                "offset": r.transaction_offset,
                "born": ms_time(r.born_timestamp),
                "age_s": r.age_s,
                "checks": r.check_times,
                **({"parked": ms_time(r.parked_timestamp)} if args.parked else {}),
            }
        )
        for r in rows
    ]
    return table, list(table[0]) if table else None


#: the listings that, asked of one broker of a cluster, show that broker's part alone
PARTIAL = ("topics", "topic-stats", "offsets", "message", "dlq", "transactions")


async def cluster_note(admin: AdminClient, args: argparse.Namespace) -> str | None:
    """One line for stderr when ``admin`` asks one broker (``--broker``, or the default)
    that registers with name servers: the rows are that broker's alone, and ``--namesrv``
    asks the whole cluster.  None otherwise (a broker that cannot say stays silent)."""
    cmd = args.admin_cmd
    if admin.direct is None or cmd not in PARTIAL or getattr(args, "dlq_cmd", "list") != "list":
        return None
    try:
        info = await admin.runtime_info()
    except TxmqError:
        return None
    if not info.namesrv:
        return None
    namesrv = shlex.quote(";".join(info.namesrv))
    return (
        f"txmq: note: {admin.direct} is one broker (broker set {info.broker_name}) of cluster "
        f"{info.cluster}: these are its rows alone; --namesrv {namesrv} shows the whole cluster"
    )
