"""What a push consumer is configured with and what its listener may answer."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

from txmq.protocol.message import MessageExt
from txmq.transports.port import ConsumeResult

__all__ = [
    "DEAD_LETTER_RESULT",
    "ConsumeFrom",
    "ConsumeResult",
    "DeadLetter",
    "Listener",
    "MessageModel",
]


class MessageModel(enum.StrEnum):
    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"


class ConsumeFrom(enum.StrEnum):
    LAST_OFFSET = "LAST_OFFSET"
    FIRST_OFFSET = "FIRST_OFFSET"


class DeadLetter(Exception):
    """Raised by a listener: send this message to ``%DLQ%<group>`` at once (no retries),
    keeping ``reason`` with it (shown by ``txmq admin dlq list``).  Like returning
    ``ConsumeResult.DEAD_LETTER``, with a reason; inside ``@txmq.idempotent`` the handler's
    writes roll back and its dedupe key is not recorded."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = str(reason)


#: the reason of a DEAD_LETTER result (or a DeadLetter without one)
DEAD_LETTER_RESULT = "the listener returned DEAD_LETTER"


Listener = Callable[
    [MessageExt], "ConsumeResult | bool | Awaitable[ConsumeResult | bool | None] | None"
]
"""``listener(message)``: return SUCCESS (or None / True), or RECONSUME_LATER (or False);
raising counts as RECONSUME_LATER.  DEAD_LETTER, or raising :class:`DeadLetter`: to the
dead-letter queue at once. Sync listeners run in worker threads."""
