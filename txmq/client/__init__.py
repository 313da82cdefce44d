"""The client core: connections to a broker or a cluster and its routes (:mod:`.core`,
:mod:`.route`), the producer (:mod:`.producer`), the transactional producer
(:mod:`.transaction`) and what the synchronous facade runs on (:mod:`.caller`).
Consumers build on it (:mod:`txmq.consumer`); transports plug in beneath it."""

from txmq.client.core import BrokerClient
from txmq.client.producer import Producer, SendResult
from txmq.client.transaction import (
    LocalTransactionState,
    TransactionListener,
    TransactionProducer,
    TransactionSendResult,
)

__all__ = [
    "BrokerClient",
    "LocalTransactionState",
    "Producer",
    "SendResult",
    "TransactionListener",
    "TransactionProducer",
    "TransactionSendResult",
]
