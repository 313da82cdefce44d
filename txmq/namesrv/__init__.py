"""The txmq name server: the cluster's route table (which broker sets hold which topics,
at which addresses), kept current by the brokers' registrations and expired when a broker
falls silent.  Name servers are stateless and never talk to each other.  The controller
(master elections of replicated broker sets) lives here too: in a name server or alone."""

from txmq.namesrv.config import ControllerConfig, NamesrvConfig
from txmq.namesrv.controller import Controller, ControllerTimings
from txmq.namesrv.routes import LiveBroker, RouteTable
from txmq.namesrv.server import (
    ControllerServer,
    EmbeddedController,
    EmbeddedNamesrv,
    NamesrvServer,
)

__all__ = [
    "Controller",
    "ControllerConfig",
    "ControllerServer",
    "ControllerTimings",
    "EmbeddedController",
    "EmbeddedNamesrv",
    "LiveBroker",
    "NamesrvConfig",
    "NamesrvServer",
    "RouteTable",
]
