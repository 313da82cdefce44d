"""The txmq name server: the cluster's route table (which broker sets hold which topics,
at which addresses), kept current by the brokers' registrations and expired when a broker
falls silent.  Name servers are stateless and never talk to each other."""

from txmq.namesrv.config import NamesrvConfig
from txmq.namesrv.routes import LiveBroker, RouteTable
from txmq.namesrv.server import EmbeddedNamesrv, NamesrvServer

__all__ = ["EmbeddedNamesrv", "LiveBroker", "NamesrvConfig", "NamesrvServer", "RouteTable"]
