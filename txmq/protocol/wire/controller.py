"""The controller (RocketMQ 5's controller mode): brokers heartbeat to it, it elects each
broker set's master and bumps the set's epoch, and it tells every broker its role.

How a deposed master is kept from acknowledging (the details are in
``namesrv/controller.py``): an election first *fences* the set — every replica's answer says
``electing``, and a fenced slave stops copying from the old master, so that master cannot
get a SYNC_MASTER write confirmed any more — and it decides only once the old master's
lease (renewed by the controller's answers and by its in-sync slaves' confirmations) has
run out.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.protocol.wire.base import Name, Request, Response
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "BrokerSetState",
    "ControllerAnswer",
    "ControllerHeartbeat",
    "ElectMaster",
    "GetReplicaInfo",
    "ReplicaInfo",
    "ReplicaState",
]

BrokerId = Annotated[int, msgspec.Meta(ge=0, le=1024)]
Offset = Annotated[int, msgspec.Meta(ge=0)]


class ControllerAnswer(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A broker set's state as the controller decided it.  ``master_id`` -1: no master yet;
    ``electing``: an election runs — stop acknowledging (a master) or copying (a slave) and
    report; ``lease_ms``: how long the addressed broker, if it is the master, may
    acknowledge writes no slave confirmed, from the moment it sent its heartbeat;
    ``in_sync``: the slaves (ids) whose confirmations count (the sync state set)."""

    epoch: int
    master_id: int = -1
    master_address: str = ""
    master_ha_address: str = ""
    lease_ms: int = 0
    in_sync: list[int] = []
    electing: bool = False
    #: controllers on etcd: this controller does not lead (nothing else in the answer
    #: counts); ``leader``: the address of the one that does ("" : none known now)
    follower: bool = False
    leader: str = ""


class ControllerHeartbeat(Request[ControllerAnswer], frozen=True, kw_only=True, omit_defaults=True):
    """A broker's heartbeat: who and where it is, its commit log's end, the newest epoch
    its log has; whether it acts as the master (may acknowledge) or follows one (copies
    from it); a slave's ``master_silent_ms``, how long since its master last answered it
    (-1: never); and a master's proposal of its in-sync slaves."""

    CODE = RequestCode.CONTROLLER_HEARTBEAT
    cluster: Name
    broker_name: Name
    broker_id: BrokerId
    address: str
    ha_address: str
    offset: Offset
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    master: bool = False
    following: bool = False
    master_silent_ms: Annotated[int, msgspec.Meta(ge=-1)] = -1
    in_sync: list[int] = []
    #: the broker stops (cleanly): count it as gone at once
    leaving: bool = False
    #: the master stopped acknowledging to hand its role to a slave (it is stopping)
    handing_over: bool = False
    #: the master acknowledges a write only once every in-sync slave has it
    #: (allAckInSyncStateSet)
    all_ack: bool = False


class ElectMaster(Request[ControllerAnswer], frozen=True, kw_only=True, omit_defaults=True):
    """A planned switchover: make ``broker_id`` (-1: the best in-sync slave) the master of
    ``broker_name`` once it has everything the current master wrote.  ``force``, while a
    failover waits for in-sync slaves that do not report: end it now with those that did."""

    CODE = RequestCode.CONTROLLER_ELECT_MASTER
    broker_name: Name
    broker_id: Annotated[int, msgspec.Meta(ge=-1, le=1024)] = -1
    timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 10_000
    #: a failover waiting for in-sync slaves that do not report: elect among those that
    #: did, accepting the loss of acknowledged writes only the others may hold
    force: bool = False


class ReplicaState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    broker_id: int
    address: str
    alive: bool
    offset: int = 0
    epoch: int = 0
    #: seconds since its last heartbeat
    silent_s: float = 0.0
    master: bool = False
    following: bool = False


class BrokerSetState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    cluster: str
    broker_name: str
    epoch: int
    master_id: int
    in_sync: list[int] = []
    replicas: list[ReplicaState] = []
    #: why an election runs now ("" : none)
    electing: str = ""
    #: epoch -> the broker id that was master in it (the newest last)
    history: list[tuple[int, int]] = []


class ReplicaInfo(Response, frozen=True, kw_only=True, omit_defaults=True):
    sets: list[BrokerSetState] = []


class GetReplicaInfo(Request[ReplicaInfo], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.CONTROLLER_GET_REPLICA_INFO
    broker_name: str = ""
