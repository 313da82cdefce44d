"""Consumers, on the client core: pulling with long polling and group offsets
(:mod:`.pull`), the push consumer (:mod:`.push`), where offsets are kept (:mod:`.offsets`),
operators' offset resets (:mod:`.reset`), queue assignment (:mod:`.allocate`) and the
per-queue flow control (:mod:`.process_queue`)."""

from txmq.consumer.pull import PullConsumer, PullResult, PullStatus
from txmq.consumer.push import ConsumeFrom, ConsumeResult, DeadLetter, MessageModel, PushConsumer

__all__ = [
    "ConsumeFrom",
    "ConsumeResult",
    "DeadLetter",
    "MessageModel",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "PushConsumer",
]
