"""txmq: change your database and tell other services, as one reliable step."""

from typing import TYPE_CHECKING, Any

from txmq.admin.client import AdminClient, ConsumeTimeout, wait_consumed
from txmq.client.producer import Producer, SendResult
from txmq.client.transaction import (
    LocalTransactionState,
    TransactionListener,
    TransactionProducer,
    TransactionSendResult,
)
from txmq.consumer.pull import PullConsumer, PullResult, PullStatus
from txmq.consumer.push import ConsumeFrom, ConsumeResult, DeadLetter, MessageModel, PushConsumer
from txmq.protocol.message import Message, MessageExt, stable_hash
from txmq.protocol.wire.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    InvalidTopic,
    MessageTooLarge,
    NoPermission,
    RequestTimeout,
    TopicNotFound,
    TransactionNotFound,
    TxmqError,
)

if TYPE_CHECKING:
    from txmq.sqla.inbox import idempotent

__all__ = [
    "AdminClient",
    "AuthenticationFailed",
    "BrokerUnavailable",
    "ConsumeFrom",
    "ConsumeResult",
    "ConsumeTimeout",
    "DeadLetter",
    "InvalidTopic",
    "LocalTransactionState",
    "Message",
    "MessageExt",
    "MessageModel",
    "MessageTooLarge",
    "NoPermission",
    "Producer",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "PushConsumer",
    "RequestTimeout",
    "SendResult",
    "TopicNotFound",
    "TransactionListener",
    "TransactionNotFound",
    "TransactionProducer",
    "TransactionSendResult",
    "TxmqError",
    "idempotent",
    "stable_hash",
    "wait_consumed",
]


def __getattr__(name: str) -> Any:
    # txmq.idempotent needs SQLAlchemy, imported only when it is first used
    if name == "idempotent":
        from txmq.sqla.inbox import idempotent

        globals()["idempotent"] = idempotent
        return idempotent
    raise AttributeError(f"module 'txmq' has no attribute {name!r}")


__version__ = "0.1.0"
