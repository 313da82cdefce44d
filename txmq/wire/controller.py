"""The controller (RocketMQ 5's controller mode): brokers heartbeat to it, it elects each
broker set's master and bumps the set's epoch, and it tells every broker its role.

A master's heartbeat answer renews its lease (``lease_ms`` from when the heartbeat was
sent): a master acknowledges writes only while its lease runs, and the controller elects a
new one only after a longer silence, so a deposed master never acknowledges a write.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.wire.base import Name, Request, Response
from txmq.wire.codes import RequestCode

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
    """A broker set's state as the controller decided it.  ``master_id`` -1: no master
    (none alive that may be elected); ``lease_ms``: how long the addressed broker, if it is
    the master, may acknowledge writes from the moment it sent its heartbeat."""

    epoch: int
    master_id: int = -1
    master_address: str = ""
    master_ha_address: str = ""
    lease_ms: int = 0
    in_sync: list[int] = []


class ControllerHeartbeat(Request[ControllerAnswer], frozen=True, kw_only=True, omit_defaults=True):
    """A broker's heartbeat: who and where it is, its commit log's end, the newest epoch
    its log has, and (a master) its in-sync slaves."""

    CODE = RequestCode.CONTROLLER_HEARTBEAT
    cluster: Name
    broker_name: Name
    broker_id: BrokerId
    address: str
    ha_address: str
    offset: Offset
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    master: bool = False
    in_sync: list[int] = []


class ElectMaster(Request[ControllerAnswer], frozen=True, kw_only=True, omit_defaults=True):
    """A planned switchover: make ``broker_id`` (-1: the best in-sync slave) the master of
    ``broker_name`` once it has everything the current master wrote."""

    CODE = RequestCode.CONTROLLER_ELECT_MASTER
    broker_name: Name
    broker_id: Annotated[int, msgspec.Meta(ge=-1, le=1024)] = -1
    timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 10_000


class ReplicaState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    broker_id: int
    address: str
    alive: bool
    offset: int = 0
    epoch: int = 0
    #: seconds since its last heartbeat
    silent_s: float = 0.0


class BrokerSetState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    cluster: str
    broker_name: str
    epoch: int
    master_id: int
    in_sync: list[int] = []
    replicas: list[ReplicaState] = []
    #: epoch -> the broker id that was master in it (the newest last)
    history: list[tuple[int, int]] = []


class ReplicaInfo(Response, frozen=True, kw_only=True, omit_defaults=True):
    sets: list[BrokerSetState] = []


class GetReplicaInfo(Request[ReplicaInfo], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.CONTROLLER_GET_REPLICA_INFO
    broker_name: str = ""
