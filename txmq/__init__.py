"""txmq: change your database and tell other services, as one reliable step."""

from txmq.admin import AdminClient
from txmq.errors import (
    BrokerUnavailable,
    InvalidTopic,
    MessageTooLarge,
    NoPermission,
    RequestTimeout,
    TopicNotFound,
    TxmqError,
)
from txmq.message import Message, MessageExt, stable_hash
from txmq.producer import Producer, SendResult
from txmq.pull import PullConsumer, PullResult, PullStatus

__all__ = [
    "AdminClient",
    "BrokerUnavailable",
    "InvalidTopic",
    "Message",
    "MessageExt",
    "MessageTooLarge",
    "NoPermission",
    "Producer",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "RequestTimeout",
    "SendResult",
    "TopicNotFound",
    "TxmqError",
    "stable_hash",
]

__version__ = "0.1.0"
