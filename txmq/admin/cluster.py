"""``txmq admin cluster``: every broker of a cluster, one row each — where it is, its load,
and its part in its broker set: role, epoch, a slave's lag (bytes and seconds), the set's
in-sync slaves and, where a controller is reachable, the controller's view of the set.

Each broker says its own part (:class:`~txmq.protocol.wire.RuntimeInfo`); a slave's lag is its
master's view of it when the master answers (the master knows when the slave last had
everything), the slave's own otherwise.  The controller is the one given, else one hosted
by a name server, else one the brokers say they heartbeat to; replicas the controller
knows and the name servers do not (a broker that died) get a row of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import msgspec

from txmq.admin.controller import replica_info
from txmq.admin.fanout import BrokerAddress, ClusterClient
from txmq.protocol.wire import (
    MASTER_ID,
    BrokerSetState,
    GetAllConsumerOffsets,
    GetAllTopicConfig,
    GetBrokerRuntimeInfo,
    GetTopicRoute,
    RuntimeInfo,
)
from txmq.protocol.wire.errors import TxmqError

__all__ = ["BrokerRow", "ControllerView", "cluster_rows"]

log = logging.getLogger("txmq.admin")

SLAVE = "SLAVE"
#: where a broker the name servers do not know sorts among its set's rows
_UNREGISTERED = 1 << 20


class ControllerView(msgspec.Struct, frozen=True, kw_only=True):
    """A broker set as its controller sees it, and the broker of the row in it."""

    #: the controller that answered
    address: str
    epoch: int
    #: the master's own broker id (-1: none)
    master_id: int
    #: the sync state set: the slaves whose confirmations count (own ids)
    in_sync: list[int]
    #: why an election runs now ("" : none)
    electing: str = ""
    #: this broker: whether it heartbeats, seconds since it last did, its log's end (None:
    #: the controller has not heard of it)
    alive: bool | None = None
    silent_s: float | None = None
    offset: int | None = None


class BrokerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One broker of a cluster (:meth:`AdminClient.cluster`)."""

    cluster: str
    broker_name: str
    #: the id it registers under with the name servers (0: its set's master; -1: it is
    #: not registered — a replica only the controller knows)
    broker_id: int
    #: MASTER (registered as broker id 0) or SLAVE
    role: str
    address: str
    version: str = ""
    uptime_s: float = 0.0
    topics: int = 0
    connections: int = 0
    commit_log_max_offset: int = 0
    #: messages stored in its queues of user topics (not system ones)
    messages: int = 0
    #: messages its consumer groups have not consumed yet, over every group and queue
    lag: int = 0
    #: messages stored by sends / pulled by consumers per second (the last minute)
    put_tps: float = 0.0
    get_tps: float = 0.0
    pending_transactions: int = 0
    #: why the broker did not answer ("" when it did)
    error: str = ""
    #: its own id in its set (``--broker-id``): the id the controller, ``in_sync`` and
    #: ``txmq admin switchover --to`` use (-1: not known)
    replica_id: int = -1
    #: SYNC_MASTER, ASYNC_MASTER or SLAVE (as the broker says; "" : it did not answer)
    broker_role: str = ""
    #: the newest epoch of its set it knows
    epoch: int = 0
    #: a slave: the bytes of the master's log it lacks, and seconds since it last had all
    #: of it (0: it has it all; -1: never yet; None: not known — the master did not answer)
    slave_lag_bytes: int | None = None
    slave_lag_s: float | None = None
    #: a slave: its master's address, and seconds since the master last answered it
    master_address: str = ""
    last_contact_s: float | None = None
    #: its set's in-sync slaves (own ids), as the set's master says (None: no master
    #: answered)
    in_sync: list[int] | None = None
    #: the controller's view of its set (None: no controller reached)
    controller: ControllerView | None = None


async def cluster_rows(
    client: ClusterClient, controller: Sequence[str] | None = None
) -> list[BrokerRow]:
    """Every broker of ``client``'s cluster (or the one broker it was given), with its
    part in its broker set.  ``controller``: the controllers' addresses to ask (None:
    the name servers, then those the brokers heartbeat to)."""
    if client.direct is not None:
        targets = [await _identify(client, client.direct)]
    else:
        info = await client.cluster_info()
        targets = [
            BrokerAddress(b.cluster, b.broker_name, broker_id, address)
            for b in info.brokers
            for broker_id, address in b.addresses.items()
        ]
        targets.sort(key=lambda t: (t.cluster, t.broker_name, t.broker_id))
    answers = await _broker_rows(client, targets)
    infos = [info for _, info in answers if info is not None]
    addresses = list(controller or ())
    if not addresses:
        addresses = [*client.namesrv, *(c for info in infos for c in info.controllers)]
    sets: tuple[str, list[BrokerSetState]] | None = None
    if addresses:
        try:
            address, replicas = await replica_info(
                addresses, timeout=client.request_timeout, security=client.security
            )
            sets = address, replicas.sets
        except TxmqError as exc:
            # asked for by name: say why it is missing (else: this cluster has none)
            log.log(logging.WARNING if controller else logging.DEBUG, "%s", exc)
    if sets is not None and client.direct is None:
        # a replica the controller hears from that the name servers do not list (it has
        # just taken a new role, or it cannot reach them): asked where the controller says
        listed = {(info.broker_name, info.broker_id) for info in infos}
        addresses_listed = {t.address for t in targets}
        unlisted = [
            BrokerAddress(s.cluster, s.broker_name, -1, r.address)
            for s in sets[1]
            for r in s.replicas
            if r.alive
            and (s.broker_name, r.broker_id) not in listed
            and r.address not in addresses_listed
        ]
        answers += [a for a in await _broker_rows(client, unlisted) if a[1] is not None]
    rows = _with_replication(answers, sets, add_missing=client.direct is None)
    rows.sort(
        key=lambda r: (
            r.cluster,
            r.broker_name,
            r.broker_id if r.broker_id >= 0 else _UNREGISTERED,
            r.replica_id,
        )
    )
    return rows


async def _broker_rows(
    client: ClusterClient, targets: list[BrokerAddress]
) -> list[tuple[BrokerRow, RuntimeInfo | None]]:
    """Each target's row and what it says of itself (None: it did not answer; the row
    says why)."""
    answers: list[tuple[BrokerRow, RuntimeInfo | None]] = [
        (_row(t, error="?"), None) for t in targets
    ]

    async def one(i: int, target: BrokerAddress) -> None:
        try:
            answers[i] = await _broker_row(client, target)
        except TxmqError as exc:
            answers[i] = (_row(target, error=str(exc)), None)

    async with anyio.create_task_group() as tg:
        for i, target in enumerate(targets):
            tg.start_soon(one, i, target)
    return answers


def _with_replication(
    answers: list[tuple[BrokerRow, RuntimeInfo | None]],
    sets: tuple[str, list[BrokerSetState]] | None,
    *,
    add_missing: bool,
) -> list[BrokerRow]:
    rows = [_own_part(row, info) for row, info in answers]
    by_set: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_set.setdefault(row.broker_name, []).append(i)
    controller, states = sets if sets is not None else ("", [])
    by_name = {s.broker_name: s for s in states}
    for name, members in by_set.items():
        infos = {i: answers[i][1] for i in members}
        masters = [
            info
            for info in infos.values()
            if info is not None and info.broker_role and info.broker_role != SLAVE
        ]
        master = max(masters, key=lambda info: info.epoch) if masters else None
        state = by_name.get(name) if name else None
        for i in members:
            rows[i] = _set_part(rows[i], master, state, controller)
    if add_missing:
        for state in states:
            shown = {rows[i].replica_id for i in by_set.get(state.broker_name, [])}
            for r in state.replicas:
                if r.broker_id not in shown:
                    rows.append(_unregistered(state, r.broker_id, controller))
    return rows


def _own_part(row: BrokerRow, info: RuntimeInfo | None) -> BrokerRow:
    """What a broker says of its own part in its set."""
    if info is None:
        return row
    slave = info.broker_role == SLAVE
    if row.broker_id < 0:  # not registered: its role as it says
        row = msgspec.structs.replace(row, role=SLAVE if slave else "MASTER")
    return msgspec.structs.replace(
        row,
        # a broker given directly that holds no topic is named by what it says
        cluster=row.cluster or info.cluster,
        broker_name=row.broker_name or info.broker_name,
        replica_id=info.broker_id,
        broker_role=info.broker_role,
        epoch=info.epoch,
        slave_lag_bytes=info.lag_bytes if slave else None,
        master_address=info.master_address if slave else "",
        last_contact_s=info.last_contact_s if slave else None,
        in_sync=info.in_sync if info.broker_role and not slave else None,
    )


def _set_part(
    row: BrokerRow, master: RuntimeInfo | None, state: BrokerSetState | None, controller: str
) -> BrokerRow:
    """What the set's master and the controller say of the set and of this broker."""
    changes: dict[str, object] = {}
    if master is not None:
        changes["in_sync"] = master.in_sync
        if row.broker_role == SLAVE and row.replica_id in master.slave_lag_bytes:
            changes["slave_lag_bytes"] = master.slave_lag_bytes[row.replica_id]
            changes["slave_lag_s"] = master.slave_lag_s.get(row.replica_id, -1.0)
    if state is not None:
        replica_id = row.replica_id
        if replica_id < 0:  # it did not answer: the controller knows it by its address
            replica_id = next((r.broker_id for r in state.replicas if r.address == row.address), -1)
            changes["replica_id"] = replica_id
        changes["controller"] = _view(state, replica_id, controller)
    return msgspec.structs.replace(row, **changes) if changes else row


def _view(state: BrokerSetState, replica_id: int, controller: str) -> ControllerView:
    replica = next((r for r in state.replicas if r.broker_id == replica_id), None)
    return ControllerView(
        address=controller,
        epoch=state.epoch,
        master_id=state.master_id,
        in_sync=list(state.in_sync),
        electing=state.electing,
        alive=replica.alive if replica is not None else None,
        silent_s=replica.silent_s if replica is not None else None,
        offset=replica.offset if replica is not None else None,
    )


def _unregistered(state: BrokerSetState, replica_id: int, controller: str) -> BrokerRow:
    """A replica the controller knows and the name servers do not."""
    view = _view(state, replica_id, controller)
    if view.alive:
        error = "not registered with the name servers (the controller hears from it)"
    else:
        error = (
            f"not registered with the name servers; not alive (the controller last heard "
            f"from it {view.silent_s:g} s ago)"
        )
    address = next(r.address for r in state.replicas if r.broker_id == replica_id)
    return BrokerRow(
        cluster=state.cluster,
        broker_name=state.broker_name,
        broker_id=-1,
        role="MASTER" if replica_id == state.master_id else SLAVE,
        address=address,
        error=error,
        replica_id=replica_id,
        controller=view,
    )


async def _broker_row(
    client: ClusterClient, target: BrokerAddress
) -> tuple[BrokerRow, RuntimeInfo]:
    info = await client.ask(target, GetBrokerRuntimeInfo())
    topics = (await client.ask(target, GetAllTopicConfig())).topics
    offsets = (await client.ask(target, GetAllConsumerOffsets())).offsets
    row = msgspec.structs.replace(
        _row(target),
        version=info.version,
        uptime_s=info.uptime_s,
        topics=info.topics,
        connections=info.connections,
        commit_log_max_offset=info.commit_log_max_offset,
        messages=sum(t.messages for t in topics if not t.system),
        lag=sum(o.lag for o in offsets),
        put_tps=info.put_tps,
        get_tps=info.get_tps,
        pending_transactions=info.pending_transactions,
    )
    return row, info


async def _identify(client: ClusterClient, address: str) -> BrokerAddress:
    """A broker given directly, named as it names itself in its routes (it has no
    name to give there when it holds no topic)."""
    target = BrokerAddress("", "", MASTER_ID, address)
    try:
        topics = (await client.ask(target, GetAllTopicConfig())).topics
        if not topics:
            return target
        route = await client.ask(target, GetTopicRoute(topic=topics[0].topic))
    except TxmqError:
        return target  # the row says why it did not answer
    for b in route.brokers:
        for broker_id in b.addresses:
            return BrokerAddress(b.cluster, b.broker_name, broker_id, address)
    return target


def _row(target: BrokerAddress, *, error: str = "") -> BrokerRow:
    return BrokerRow(
        cluster=target.cluster,
        broker_name=target.broker_name,
        broker_id=target.broker_id,
        role="MASTER" if target.broker_id == MASTER_ID else SLAVE,
        address=target.address,
        error=error,
    )
