"""The txmq broker: storage engine, request handling, topics, offsets, long polling."""

from broker.config import BrokerConfig
from broker.server import Broker, EmbeddedBroker

__all__ = ["Broker", "BrokerConfig", "EmbeddedBroker"]
