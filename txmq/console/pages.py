"""The console's pages (GET): what each asks the brokers and hands its template."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from txmq.console.dblog import log_states
from txmq.console.holders import queue_holders
from txmq.console.journey import journeys
from txmq.console.render import chart, show_body
from txmq.console.state import Point
from txmq.console.web import client_of, page, state_of
from txmq.protocol.message import Prop, is_system_topic
from txmq.protocol.wire import GroupOffset

__all__ = [
    "cluster",
    "dlq",
    "group",
    "groups",
    "message",
    "message_body",
    "topic",
    "topics",
    "transactions",
]

#: what a console shows at most of a listing
LIST_MAX = 200
#: operators' decisions shown (newest first)
DECIDED_MAX = 50
DLQ_PREFIX, RETRY_PREFIX = "%DLQ%", "%RETRY%"
#: the group page's chart line of the group's total lag
TOTAL_LINE = "total"


def _param(request: Request, name: str, *, required: bool = True) -> str:
    value = request.query_params.get(name, "").strip()
    if required and not value:
        raise HTTPException(400, f"say which: ?{name}=...")
    return value


def _group(request: Request) -> str:
    """The consumer group a page is about: ``?group=``, every page's name for a group (the
    group page's ``?name=`` of before still works, for old links)."""
    name = _param(request, "group", required=False) or _param(request, "name", required=False)
    if not name:
        raise HTTPException(400, "say which: ?group=...")
    return name


def _until_now(points: Iterable[Point], now: float, value: float) -> list[Point]:
    """A chart line's samples and, last, the value the page shows beside it (read now):
    the legend and the page's number are one reading, never a sample seconds older."""
    return [*(p for p in points if p[0] < now), (now, value)]


def _queue_line(o: GroupOffset) -> str:
    return f"{o.topic}{'@' + o.broker_name if o.broker_name else ''}#{o.queue_id}"


async def cluster(request: Request) -> Response:
    state = state_of(request)
    client = await client_of(request)
    rows = await client.cluster()
    infos = {(i.broker_name, i.address): i for i in await client.runtime_infos()}
    history = state.history
    series: dict[str, list[tuple[float, float]]] = {}
    for key, points in history.put.items():
        series[f"put {key}"] = list(points)
    for key, points in history.get.items():
        series[f"get {key}"] = list(points)
    return page(
        request,
        "cluster",
        {
            "rows": rows,
            "infos": infos,
            "rates": chart(series),
            "sampled": history.last_sample,
            "sample_error": history.last_error,
        },
    )


async def topics(request: Request) -> Response:
    client = await client_of(request)
    rows = sorted(await client.topics(), key=lambda r: (r.system, r.topic))
    return page(
        request,
        "topics",
        {
            "user": [r for r in rows if not r.system],
            "system": [r for r in rows if r.system],
        },
    )


async def topic(request: Request) -> Response:
    name = _param(request, "name")
    client = await client_of(request)
    queues = await client.topic_stats(name)
    offsets = [o for o in await client.offsets() if o.topic == name]
    context = {"name": name, "queues": queues, "offsets": offsets, "system": is_system_topic(name)}
    return page(request, "topic", context)


async def groups(request: Request) -> Response:
    client = await client_of(request)
    offsets = await client.offsets()
    now = time.time()
    configs = {g.group: g for g in await client.groups()}
    lag: dict[str, int] = defaultdict(int)
    topics_of: dict[str, set[str]] = defaultdict(set)
    for o in offsets:
        lag[o.group] += o.lag
        topics_of[o.group].add(o.topic)
    names = sorted(set(lag) | set(configs))
    rows = [
        {
            "group": g,
            "lag": lag.get(g, 0),
            "topics": sorted(topics_of.get(g, ())),
            "config": configs.get(g),
        }
        for g in names
    ]
    history = state_of(request).history
    lines = {g: _until_now(history.group_lag.get(g, ()), now, total) for g, total in lag.items()}
    return page(request, "groups", {"rows": rows, "lag_chart": chart(lines)})


async def group(request: Request) -> Response:
    """A consumer group: its lag (the total: the sum over the queues it has committed
    offsets on of max offset - committed offset, the groups page's number; and each
    queue's), members and the queues each holds.  The chart's lines end with this read,
    so that its legend and the page's numbers agree."""
    name = _group(request)
    history = state_of(request).history
    client = await client_of(request)
    offsets = [o for o in await client.offsets() if o.group == name]
    now = time.time()
    total = sum(o.lag for o in offsets)
    lines = {TOTAL_LINE: _until_now(history.group_lag.get(name, ()), now, total)}
    for o in offsets:
        key = (name, o.topic, o.broker_name, o.queue_id)
        lines[_queue_line(o)] = _until_now(history.queue_lag.get(key, ()), now, o.lag)
    members = await client.members(name)
    holders = await queue_holders(client, name, offsets, members)
    return page(
        request,
        "group",
        {
            "name": name,
            "offsets": offsets,
            "lag": total,
            "total_line": TOTAL_LINE,
            "members": members,
            "holders": holders,
            "lag_chart": chart(lines, first=[TOTAL_LINE]),
        },
    )


async def message(request: Request) -> Response:
    msg_id = request.query_params.get("id", "").strip()
    key = request.query_params.get("key", "").strip()
    broker = request.query_params.get("broker", "").strip() or None
    state = state_of(request)
    if not msg_id and not key:
        return page(request, "message", {"msg_id": "", "key": "", "found": []})
    client = await client_of(request)
    found = await journeys(client, msg_id=msg_id, key=key, broker=broker)
    shown = [
        {
            "msg": j.main,
            "body": show_body(j.main.body, state.config.body_limit),
            "system": {k: v for k, v in sorted(j.main.all_properties.items()) if k in Prop.ALL},
            "user": dict(sorted(j.main.properties.items())),
            "journey": j,
            "retry_of": j.main.all_properties.get(Prop.RETRY_TOPIC, ""),
        }
        for j in found
    ]
    return page(request, "message", {"msg_id": msg_id, "key": key, "found": shown})


async def message_body(request: Request) -> Response:
    """The whole body of a message, as a download (never shown as a page)."""
    msg_id = _param(request, "id")
    broker = request.query_params.get("broker", "").strip() or None
    msg = await (await client_of(request)).message_by_id(msg_id, broker=broker)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", msg_id)[:64]
    return Response(
        msg.body,
        media_type="application/octet-stream",
        headers={"content-disposition": f'attachment; filename="{safe}.bin"'},
    )


async def transactions(request: Request) -> Response:
    client = await client_of(request)
    pending = await client.transactions("pending", LIST_MAX)
    parked = await client.transactions("parked", LIST_MAX)
    decided = await client.decisions(DECIDED_MAX)
    dbs = state_of(request).config.dbs
    ids = [t.transaction_id for t in [*pending, *parked]]
    logs, db_errors = await log_states(dbs, ids) if dbs else ({}, [])
    return page(
        request,
        "transactions",
        {
            "pending": pending,
            "parked": parked,
            "decided": decided,
            "dbs": dbs,
            "logs": logs,
            "db_errors": db_errors,
        },
    )


async def dlq(request: Request) -> Response:
    name = request.query_params.get("group", "").strip()
    client = await client_of(request)
    dead_groups = sorted(
        (r.topic.removeprefix(DLQ_PREFIX), r.messages)
        for r in await client.topics()
        if r.topic.startswith(DLQ_PREFIX)
    )
    try:
        offset = max(int(request.query_params.get("offset", "0")), 0)
    except ValueError:
        raise HTTPException(400, "offset must be a number") from None
    messages = await client.dlq_list(name, offset, 50) if name else []
    return page(
        request,
        "dlq",
        {"group": name, "dead_groups": dead_groups, "messages": messages, "offset": offset},
    )
