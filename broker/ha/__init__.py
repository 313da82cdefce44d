"""Replication within a broker set: the master's HA service, the slave's client, the waits
of SYNC_MASTER, epochs, and the metadata slaves copy (DESIGN.md, "Replication")."""

from txmq.broker.ha.epochs import EpochLog, cut_point
from txmq.broker.ha.replication import Replication
from txmq.broker.ha.role import BrokerRole, Role

__all__ = ["BrokerRole", "EpochLog", "Replication", "Role", "cut_point"]
