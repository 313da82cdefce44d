"""Replication within a broker set: the master's HA service, the slave's client, roles,
leases and epochs, and what replication puts together with the broker's tables
(:mod:`.replication`): the replica's view (:mod:`.info`) and the metadata copied from the
master (:mod:`.metadata`)."""

from txmq.broker.ha.epochs import EpochLog, cut_point
from txmq.broker.ha.master import HaService
from txmq.broker.ha.role import BrokerRole, Role
from txmq.broker.ha.slave import HaClient

__all__ = ["BrokerRole", "EpochLog", "HaClient", "HaService", "Role", "cut_point"]
