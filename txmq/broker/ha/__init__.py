"""Replication within a broker set: the master's HA service, the slave's client, roles,
leases and epochs (DESIGN.md, "Replication"); ``broker/replication.py`` puts them together
with the broker's tables."""

from txmq.broker.ha.epochs import EpochLog, cut_point
from txmq.broker.ha.master import HaService
from txmq.broker.ha.role import BrokerRole, Role
from txmq.broker.ha.slave import HaClient

__all__ = ["BrokerRole", "EpochLog", "HaClient", "HaService", "Role", "cut_point"]
