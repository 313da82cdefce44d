"""Errors shared by clients and the broker.

Every error the broker can answer has a numeric code (see :class:`ResponseCode`); the
client turns an error answer into the exception class registered for its code.  Each class
says whether retrying the same request may succeed (``retriable``).
"""

from __future__ import annotations

import enum

__all__ = [
    "AuthenticationFailed",
    "BadRequest",
    "BrokerBusy",
    "BrokerUnavailable",
    "ControllerNotLeader",
    "DiskFull",
    "FlushDiskTimeout",
    "FlushSlaveTimeout",
    "FrameTooLarge",
    "GroupNotFound",
    "InvalidReceiptHandle",
    "InvalidTopic",
    "MalformedFrame",
    "MessageNotFound",
    "MessageTooLarge",
    "NoPermission",
    "NotMaster",
    "RequestTimeout",
    "ResponseCode",
    "ServerError",
    "SlaveNotAvailable",
    "TopicNotFound",
    "TransactionNotFound",
    "TxmqError",
    "UnsupportedRequest",
    "UnsupportedVersion",
    "clip",
    "error_for_code",
]


class ResponseCode(enum.IntEnum):
    SUCCESS = 0
    SYSTEM_ERROR = 1
    SYSTEM_BUSY = 2
    REQUEST_CODE_NOT_SUPPORTED = 3
    MALFORMED_FRAME = 4
    FRAME_TOO_LARGE = 5
    VERSION_NOT_SUPPORTED = 6
    BAD_REQUEST = 7
    FLUSH_DISK_TIMEOUT = 10
    SLAVE_NOT_AVAILABLE = 11
    FLUSH_SLAVE_TIMEOUT = 12
    MESSAGE_ILLEGAL = 13
    MESSAGE_TOO_LARGE = 14
    NO_PERMISSION = 16
    TOPIC_NOT_EXIST = 17
    INVALID_TOPIC = 18
    DISK_FULL = 19
    QUERY_NOT_FOUND = 22
    TRANSACTION_NOT_FOUND = 23
    NOT_MASTER = 24
    INVALID_RECEIPT_HANDLE = 25
    SUBSCRIPTION_GROUP_NOT_EXIST = 26
    #: the request is not signed, or not by a known user with a valid signature and time
    AUTHENTICATION_FAILED = 27
    #: a controller on etcd that does not lead (RocketMQ's CONTROLLER_NOT_LEADER)
    CONTROLLER_NOT_LEADER = 2003


class TxmqError(Exception):
    """Base of every txmq error."""

    code: ResponseCode = ResponseCode.SYSTEM_ERROR
    retriable: bool = False
    #: the id of the request that caused it, when known (protocol errors)
    request_id: int = 0

    def __init__(self, message: str = "", *, code: int | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        if code is not None:
            try:
                self.code = ResponseCode(code)
            except ValueError:
                pass


class ServerError(TxmqError):
    """The broker failed to handle the request."""

    code = ResponseCode.SYSTEM_ERROR
    retriable = True


class BrokerBusy(TxmqError):
    """The broker is overloaded; try again."""

    code = ResponseCode.SYSTEM_BUSY
    retriable = True


class UnsupportedRequest(TxmqError):
    """The peer does not know this request code."""

    code = ResponseCode.REQUEST_CODE_NOT_SUPPORTED


class MalformedFrame(TxmqError):
    """A frame could not be parsed."""

    code = ResponseCode.MALFORMED_FRAME


class FrameTooLarge(TxmqError):
    """A frame is over the size limit."""

    code = ResponseCode.FRAME_TOO_LARGE


class UnsupportedVersion(TxmqError):
    """The frame's protocol version is not supported."""

    code = ResponseCode.VERSION_NOT_SUPPORTED


class BadRequest(TxmqError):
    """A request misses a field or has one of the wrong type."""

    code = ResponseCode.BAD_REQUEST


class FlushDiskTimeout(TxmqError):
    """The broker stored the message but could not fsync it in time (SYNC flush)."""

    code = ResponseCode.FLUSH_DISK_TIMEOUT
    retriable = True


class SlaveNotAvailable(TxmqError):
    """The broker (SYNC_MASTER) stored the message but no slave is connected to copy it:
    one machine lost now would lose it."""

    code = ResponseCode.SLAVE_NOT_AVAILABLE
    retriable = True


class FlushSlaveTimeout(TxmqError):
    """The broker (SYNC_MASTER) stored the message but no slave confirmed a copy within
    ``sync_replication_timeout_s``."""

    code = ResponseCode.FLUSH_SLAVE_TIMEOUT
    retriable = True


class ControllerNotLeader(TxmqError):
    """This controller does not lead (controllers on etcd): ask the leader, which the
    message names when it is known."""

    code = ResponseCode.CONTROLLER_NOT_LEADER
    retriable = True


class NotMaster(TxmqError):
    """This broker is not (or no longer) its broker set's master: it takes no writes.
    Refresh the route and send to the master."""

    code = ResponseCode.NOT_MASTER
    retriable = True


class DiskFull(TxmqError):
    """The broker's disk is full (or used over its ``disk_max_used_ratio``): it stores
    nothing until space is freed; another broker, or the same one later, may take the
    message (RocketMQ answers SERVICE_NOT_AVAILABLE)."""

    code = ResponseCode.DISK_FULL
    retriable = True


class MessageTooLarge(TxmqError):
    """The message body is over the broker's size limit."""

    code = ResponseCode.MESSAGE_TOO_LARGE


class NoPermission(TxmqError):
    """The request is not allowed (for example, sending to a reserved system topic, or to
    a topic the user has no ``pub`` right on)."""

    code = ResponseCode.NO_PERMISSION


class AuthenticationFailed(TxmqError):
    """The server does not know who is asking: the request is not signed, its access key
    is unknown, its signature does not match, its time is outside the allowed window, or
    it was seen before (a replay)."""

    code = ResponseCode.AUTHENTICATION_FAILED


class TopicNotFound(TxmqError):
    """The topic does not exist and auto-creation is off."""

    code = ResponseCode.TOPIC_NOT_EXIST


class GroupNotFound(TxmqError):
    """The broker knows no such consumer group (no offsets, config or member of it)."""

    code = ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST


class InvalidTopic(TxmqError):
    """The topic name is not valid."""

    code = ResponseCode.INVALID_TOPIC


class MessageNotFound(TxmqError):
    """No message matches the query."""

    code = ResponseCode.QUERY_NOT_FOUND


class TransactionNotFound(TxmqError):
    """No half message of this producer group at that commit-log offset."""

    code = ResponseCode.TRANSACTION_NOT_FOUND


class InvalidReceiptHandle(TxmqError):
    """The receipt handle of a popped message is malformed, from another broker run, or
    no longer valid (the message was acknowledged, redelivered, or its invisible time was
    changed under a newer handle)."""

    code = ResponseCode.INVALID_RECEIPT_HANDLE


class BrokerUnavailable(TxmqError):
    """The broker cannot be reached or the connection was lost."""

    retriable = True
    #: False when the request never left (no connection could be made): sending it again
    #: cannot make a second copy
    sent = True


class RequestTimeout(TxmqError):
    """No answer arrived within the request timeout."""

    retriable = True


_REGISTRY: dict[int, type[TxmqError]] = {
    cls.code: cls
    for cls in (
        ServerError,
        BrokerBusy,
        UnsupportedRequest,
        MalformedFrame,
        FrameTooLarge,
        UnsupportedVersion,
        BadRequest,
        FlushDiskTimeout,
        SlaveNotAvailable,
        FlushSlaveTimeout,
        NotMaster,
        ControllerNotLeader,
        DiskFull,
        MessageTooLarge,
        NoPermission,
        AuthenticationFailed,
        TopicNotFound,
        GroupNotFound,
        InvalidTopic,
        MessageNotFound,
        TransactionNotFound,
        InvalidReceiptHandle,
    )
}
_REGISTRY[ResponseCode.MESSAGE_ILLEGAL] = BadRequest


def error_for_code(code: int, message: str) -> TxmqError:
    """The exception for an error answer with ``code``."""
    cls = _REGISTRY.get(code, ServerError)
    return cls(message, code=code)


#: the longest error message sent or logged: a message may quote the input, which may be
#: megabytes (a 2 MiB header once made a 6 MB log line)
MAX_MESSAGE = 512


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text``, cut to ``limit`` characters (saying how much was left out)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"
