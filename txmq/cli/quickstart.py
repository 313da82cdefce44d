"""``txmq quickstart``: a broker in a temporary folder, messages sent and received back.

It shows the moving parts on the embedded default (no other server): topics with queues,
round-robin and sharding-key sends, a batch, pulling every queue back with long polling,
committing offsets, and looking messages up by id and by key.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from pathlib import Path

from txmq.cli.options import SubParsers, add_command, positive_int

__all__ = ["add_parser", "run_quickstart"]


def add_parser(sub: SubParsers) -> None:
    q = add_command(
        sub,
        "quickstart",
        help="broker in a temporary folder; send and receive",
        examples="  txmq quickstart\n  txmq quickstart --messages 100",
    )
    q.add_argument(
        "--messages", type=positive_int, default=1000, help="how many to send (default 1000)"
    )
    q.set_defaults(func=lambda args: run_quickstart(args.messages))


def run_quickstart(count: int = 1000) -> int:
    from txmq.broker.server import EmbeddedBroker
    from txmq.broker.state.config import BrokerConfig

    if count < 1:
        raise ValueError(f"quickstart sends at least 1 message, not {count}")
    with tempfile.TemporaryDirectory(prefix="txmq-quickstart-") as tmp:
        config = BrokerConfig(store=Path(tmp) / "store", port=0)
        with EmbeddedBroker(config) as broker:
            print(f"broker: embedded, store {config.store}, listening on {broker.address}")
            return _exercise(broker.address, count)


def _exercise(address: str, count: int) -> int:
    from txmq.consumer.pull import PullStatus
    from txmq.protocol.message import Message
    from txmq.sync import AdminClient, Producer, PullConsumer

    topic = "quickstart-orders"
    sent: dict[str, bytes] = {}
    per_key: dict[str, list[str]] = defaultdict(list)
    with AdminClient(address) as admin, Producer(address, "quickstart-producer") as producer:
        admin.create_topic(topic, 4)
        began = time.perf_counter()
        for i in range(count):
            order = f"order-{i % 50}"
            body = f"event {i} for {order}".encode()
            msg = Message(topic, body, tags="created" if i % 2 else "paid", keys=[order])
            if i % 3 == 0:
                r = producer.send(msg, sharding_key=order)
            else:
                r = producer.send(msg)
            sent[r.msg_id] = body
            per_key[order].append(r.msg_id)
        batch = [Message(topic, f"batch {j}".encode(), keys=["batch"]) for j in range(10)]
        rb = producer.send_batch(batch)
        for mid, m in zip(rb.msg_ids, batch, strict=True):
            sent[mid] = m.body
        took = time.perf_counter() - began
        print(f"sent:     {len(sent)} messages (sync sends + one batch of 10) in {took:.2f}s")

        received: dict[str, bytes] = {}
        with PullConsumer(address, "quickstart-consumer") as consumer:
            for queue_id in consumer.queues(topic):
                offset = max(consumer.fetch_offset(topic, queue_id), 0)
                while True:
                    res = consumer.pull(topic, queue_id, offset, max_msgs=64, long_poll=0)
                    if res.status != PullStatus.FOUND:
                        break
                    for got in res.messages:
                        received[got.msg_id] = got.body
                    offset = res.next_offset
                consumer.commit_offset(topic, queue_id, offset)
            paid = consumer.pull(topic, 0, 0, max_msgs=8, subscription="paid", long_poll=0)
        print(f"received: {len(received)} messages from 4 queues; offsets committed")
        paid_tags = sorted({m.tags or "" for m in paid.messages})
        print(f"filter:   tag 'paid' pull returned tags {paid_tags}")

        some_id = next(iter(sent))
        found = admin.message_by_id(some_id)
        key = f"order-{min(count - 1, 7)}"  # a key that was sent, however few messages
        by_key = admin.messages_by_key(key, max_num=100)
        print(
            f"lookup:   id {some_id} -> topic {found.topic} queue {found.queue_id} offset "
            f"{found.queue_offset}; key {key} -> {len(by_key)} messages "
            f"(sent {len(per_key[key])})"
        )
        for row in admin.offsets():
            print(
                f"offsets:  group {row.group} queue {row.queue_id}: "
                f"{row.offset}/{row.max_offset} (lag {row.lag})"
            )
    ok = received == sent and found.body == sent[some_id]
    ok = ok and len(by_key) == len(per_key[key])
    print("result:   " + ("OK - every message came back intact" if ok else "MISMATCH"))
    return 0 if ok else 1
