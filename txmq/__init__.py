"""txmq: change your database and tell other services, as one reliable step."""

# The names below are imported when first used (PEP 562), so that ``import txmq`` (and
# every ``txmq`` command, which imports this package first) costs only what it uses.

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from txmq.admin.client import AdminClient, ConsumeTimeout, wait_consumed
    from txmq.client.producer import Producer, SendResult
    from txmq.client.transaction import (
        LocalTransactionState,
        TransactionListener,
        TransactionProducer,
        TransactionSendResult,
    )
    from txmq.consumer.pull import PullConsumer, PullResult, PullStatus
    from txmq.consumer.push import (
        ConsumeFrom,
        ConsumeResult,
        DeadLetter,
        MessageModel,
        PushConsumer,
    )
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
    from txmq.sqla.inbox import idempotent  # needs SQLAlchemy

    #: the installed distribution's version (``txmq --version`` prints it)
    __version__: str

#: each exported name and the module it comes from
_EXPORTS = {
    "AdminClient": "txmq.admin.client",
    "ConsumeTimeout": "txmq.admin.client",
    "wait_consumed": "txmq.admin.client",
    "Producer": "txmq.client.producer",
    "SendResult": "txmq.client.producer",
    "LocalTransactionState": "txmq.client.transaction",
    "TransactionListener": "txmq.client.transaction",
    "TransactionProducer": "txmq.client.transaction",
    "TransactionSendResult": "txmq.client.transaction",
    "PullConsumer": "txmq.consumer.pull",
    "PullResult": "txmq.consumer.pull",
    "PullStatus": "txmq.consumer.pull",
    "ConsumeFrom": "txmq.consumer.push",
    "ConsumeResult": "txmq.consumer.push",
    "DeadLetter": "txmq.consumer.push",
    "MessageModel": "txmq.consumer.push",
    "PushConsumer": "txmq.consumer.push",
    "Message": "txmq.protocol.message",
    "MessageExt": "txmq.protocol.message",
    "stable_hash": "txmq.protocol.message",
    "AuthenticationFailed": "txmq.protocol.wire.errors",
    "BrokerUnavailable": "txmq.protocol.wire.errors",
    "InvalidTopic": "txmq.protocol.wire.errors",
    "MessageTooLarge": "txmq.protocol.wire.errors",
    "NoPermission": "txmq.protocol.wire.errors",
    "RequestTimeout": "txmq.protocol.wire.errors",
    "TopicNotFound": "txmq.protocol.wire.errors",
    "TransactionNotFound": "txmq.protocol.wire.errors",
    "TxmqError": "txmq.protocol.wire.errors",
    "idempotent": "txmq.sqla.inbox",
}

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
    if name == "__version__":
        from txmq.protocol.version import installed_version

        globals()[name] = found = installed_version()
        return found
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'txmq' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
