"""The txmq broker: storage, request handling, topics, offsets, long polling, consumer
groups, queue locks, delayed delivery, retries and the dead-letter queue."""

from txmq.broker.server import Broker, EmbeddedBroker
from txmq.broker.state.config import BrokerConfig

__all__ = ["Broker", "BrokerConfig", "EmbeddedBroker"]
