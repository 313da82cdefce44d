"""Synchronous facades over the async clients (one copy of the logic: the async one).

Each facade runs its async client on an event loop in a background thread (an anyio
blocking portal) and keeps the client's whole lifetime inside one task there::

    with txmq.sync.Producer("127.0.0.1:10911") as producer:
        result = producer.send(Message("orders", b"..."))

Every method is derived from its async twin (:mod:`txmq.client.facade`): the same
parameters and the same result, typed as the twin is; the facade adds no logic.
"""

from __future__ import annotations

from typing import Any

from txmq.admin import client as _admin
from txmq.client import producer as _producer
from txmq.client import transaction as _tx
from txmq.client.facade import SyncClient, blocking
from txmq.consumer import pull as _pull
from txmq.consumer import push as _push
from txmq.protocol.message import MessageExt, MessageQueue

__all__ = [
    "AdminClient",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "SyncClient",
    "TransactionProducer",
    "blocking",
    "wait_consumed",
]


class Producer(SyncClient[_producer.Producer]):
    """Blocking producer; same arguments as :class:`txmq.client.producer.Producer`."""

    def __init__(self, address: str | None = None, group: str = "DEFAULT_PRODUCER", **kw: Any):
        super().__init__(_producer.Producer(address, group, **kw))

    send = blocking(_producer.Producer.send)
    send_async = blocking(_producer.Producer.send_async)
    send_oneway = blocking(_producer.Producer.send_oneway)
    send_batch = blocking(_producer.Producer.send_batch)
    recall = blocking(_producer.Producer.recall)
    route = blocking(_producer.Producer.route)


class TransactionProducer(SyncClient[_tx.TransactionProducer]):
    """Blocking transactional producer; same arguments as
    :class:`txmq.client.transaction.TransactionProducer`.

    ``send_message_in_transaction`` runs a plain ``execute_local_transaction`` in the
    calling thread (so thread-bound sessions work); check-backs run in worker threads
    (plain functions) or on the client's event loop (coroutine functions).
    """

    def __init__(self, address: str | None = None, group: str = "DEFAULT_PRODUCER", **kw: Any):
        super().__init__(_tx.TransactionProducer(address, group, **kw))

    @property
    def group(self) -> str:
        return self.aio.group

    @property
    def listener(self) -> _tx.TransactionListener | None:
        return self.aio.listener

    @listener.setter
    def listener(self, listener: _tx.TransactionListener | None) -> None:
        self.aio.listener = listener

    send = blocking(_tx.TransactionProducer.send)
    send_half = blocking(_tx.TransactionProducer.send_half)
    end_transaction = blocking(_tx.TransactionProducer.end_transaction)
    recall = blocking(_tx.TransactionProducer.recall)
    send_message_in_transaction = blocking(_tx.TransactionProducer.send_message_in_transaction)


class PullConsumer(SyncClient[_pull.PullConsumer]):
    def __init__(self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kw: Any):
        super().__init__(_pull.PullConsumer(address, group, **kw))

    queues = blocking(_pull.PullConsumer.queues)
    message_queues = blocking(_pull.PullConsumer.message_queues)
    pull = blocking(_pull.PullConsumer.pull)
    commit_offset = blocking(_pull.PullConsumer.commit_offset)
    fetch_offset = blocking(_pull.PullConsumer.fetch_offset)
    max_offset = blocking(_pull.PullConsumer.max_offset)
    min_offset = blocking(_pull.PullConsumer.min_offset)


class AdminClient(SyncClient[_admin.AdminClient]):
    def __init__(self, address: str | None = None, **kw: Any):
        super().__init__(_admin.AdminClient(address, **kw))

    topics = blocking(_admin.AdminClient.topics)
    topic_stats = blocking(_admin.AdminClient.topic_stats)
    create_topic = blocking(_admin.AdminClient.create_topic)
    delete_topic = blocking(_admin.AdminClient.delete_topic)
    message_by_id = blocking(_admin.AdminClient.message_by_id)
    messages_by_key = blocking(_admin.AdminClient.messages_by_key)
    offsets = blocking(_admin.AdminClient.offsets)
    runtime_info = blocking(_admin.AdminClient.runtime_info)
    dlq_list = blocking(_admin.AdminClient.dlq_list)
    dlq_resend = blocking(_admin.AdminClient.dlq_resend)
    transactions = blocking(_admin.AdminClient.transactions)
    decisions = blocking(_admin.AdminClient.decisions)
    decide_transaction = blocking(_admin.AdminClient.decide_transaction)
    create_user = blocking(_admin.AdminClient.create_user)
    update_user = blocking(_admin.AdminClient.update_user)
    delete_user = blocking(_admin.AdminClient.delete_user)
    users = blocking(_admin.AdminClient.users)
    add_rule = blocking(_admin.AdminClient.add_rule)
    delete_rule = blocking(_admin.AdminClient.delete_rule)
    acl_targets = blocking(_admin.AdminClient.acl_targets)
    cluster = blocking(_admin.AdminClient.cluster)
    topic_route = blocking(_admin.AdminClient.topic_route)
    runtime_infos = blocking(_admin.AdminClient.runtime_infos)
    wait_consumed = blocking(_admin.AdminClient.wait_consumed)


def wait_consumed(
    msg_id_or_key: str,
    group: str,
    address: str | None = None,
    *,
    timeout: float = 10.0,
    poll_interval: float = 0.05,
    **client: Any,
) -> MessageExt:
    """The blocking twin of :func:`txmq.wait_consumed` (see
    :meth:`txmq.admin.client.AdminClient.wait_consumed`)."""
    with AdminClient(address, **client) as admin:
        return admin.wait_consumed(
            msg_id_or_key, group, timeout=timeout, poll_interval=poll_interval
        )


class PushConsumer(SyncClient[_push.PushConsumer]):
    """Blocking push consumer; the listener may be a plain function (it runs in worker
    threads) or a coroutine function, with the same results (``raise txmq.DeadLetter``
    included). Same arguments as :class:`txmq.consumer.push.PushConsumer`::

        consumer = txmq.sync.PushConsumer(address, "billing", listener=handle)
        consumer.subscribe("orders", "created || paid")
        with consumer:
            ...  # messages are consumed in the background until the block ends
    """

    def __init__(self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kw: Any):
        super().__init__(_push.PushConsumer(address, group, **kw))

    def subscribe(self, topic: str, expression: str = "*") -> None:
        self.aio.subscribe(topic, expression)

    def register_listener(self, listener: _push.Listener) -> None:
        self.aio.register_listener(listener)

    def queues_held(self) -> list[MessageQueue]:
        return sorted(self.aio.queues_held)
