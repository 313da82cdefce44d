"""The consumer groups' committed offsets at the broker: the evidence of consumption of the
groups that record no consumed keys (a plain ``PushConsumer``, not ``txmq.idempotent``).

Each store keeps its groups' committed offsets in ``<store>/config/offsets.json`` (group
-> topic -> queue id -> the next offset the group consumes, :data:`OFFSETS_FILE`; the
broker's ``ConsumerOffsetManager`` writes it, atomically, every few seconds and at stop).  A
message whose queue offset lies below its group's committed offset for its queue was
consumed by the group, or sent back for a retry: then its copy in ``%RETRY%<group>`` is
judged the same way (below the group's offset in that queue, the group is done with it;
a copy it gave up on is a dead letter).  So a group G consumed message M when a ``done``
consumed key of G names M, or when G's broker group (:func:`~txmq.spark.messages.broker_group`)
passed M and every retry copy of M for it.

In a cluster each store is one broker set's, with its own queues and offsets: the
evidence is keyed by (broker set, topic, queue id).  The offsets are few (groups x topics
x queues): they are read here, on the driver, and broadcast to the messages as one array
per queue, which each message probes with its queue offset (no shuffle).

The file holds no history: it is read as the broker last saved it, whatever ``--now``
says (a message consumed after the cut counts as consumed), and it lags the consumers by
their commit interval and the broker's save interval (5 s each by default: the SLA covers
that).  Two gaps only consumed keys close: a copy sent back for a retry waits out its delay
in the schedule topic, which the job does not read, so until it reaches ``%RETRY%<group>``
the message counts as consumed by the group's offsets; and a BROADCASTING group keeps its
offsets in each member's local file, not at the broker, so it has none here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

from txmq.broker.store.export import StoreUnreadable
from txmq.protocol.message import is_system_topic, retry_topic
from txmq.spark.common import local_frame
from txmq.spark.messages import broker_group

__all__ = [
    "EVIDENCE",
    "OFFSETS_FILE",
    "Committed",
    "consumed_topics",
    "evidence",
    "marks",
    "read_offsets",
]

#: where a store keeps its consumer groups' committed offsets (the broker's
#: ``txmq.broker.state.offsets``: ``{"offsets": {group: {topic: {queue id: offset}}}}``)
OFFSETS_FILE = Path("config") / "offsets.json"
#: what a consumer group's consumption is judged on, as the summary says it
EVIDENCE = ("consumed keys", "committed offsets", "both", "none")
#: the Spark schema of :func:`marks`' rows
MARKS = (
    "broker string, qtopic string, queue_id int, "
    "marks array<struct<bgroup: string, offset: long, bits: long>>"
)


@dataclass(frozen=True)
class Committed:
    """One committed offset: broker group ``group`` consumes ``topic``'s queue
    ``queue_id`` of broker set ``broker`` from ``offset`` on."""

    broker: str
    group: str
    topic: str
    queue_id: int
    offset: int


def read_offsets(stores: Sequence[tuple[str, str]]) -> list[Committed]:
    """The committed offsets of every store ((broker set, folder) each); a store without the
    file has none.  A file that is not the broker's is :class:`StoreUnreadable` (the
    broker salvages a damaged one when it starts)."""
    out: list[Committed] = []
    for broker, folder in stores:
        path = Path(folder) / OFFSETS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreUnreadable(f"cannot read {path}: {exc}") from exc
        try:
            saved = json.loads(data)["offsets"]
            out += [
                Committed(broker, str(group), str(topic), int(queue_id), int(offset))
                for group, topics in saved.items()
                for topic, queues in topics.items()
                for queue_id, offset in queues.items()
            ]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise StoreUnreadable(
                f"{path} is not a broker's offsets file ({exc!r}): start the broker once, "
                "it salvages a damaged one"
            ) from exc
    return out


def consumed_topics(committed: Iterable[Committed]) -> set[tuple[str, str]]:
    """(broker group, topic): the groups that consumed at least one message of a topic by
    their offsets (an offset above 0; retry, dead-letter and system topics left out)."""
    return {(c.group, c.topic) for c in committed if c.offset > 0 and not is_system_topic(c.topic)}


def evidence(
    expected: Iterable[tuple[str, str]],
    key_groups: Iterable[str],
    committed: Iterable[Committed],
) -> dict[str, str]:
    """Each expected group's evidence (one of :data:`EVIDENCE`): its consumed keys (it has
    some in a database), its broker group's committed offsets (for a topic it is expected
    to consume, in any store), both, or none."""
    pairs = set(expected)
    keyed = set(key_groups)
    offsets = {(c.group, c.topic) for c in committed}
    out = {}
    for g in sorted({g for g, _ in pairs}):
        by_offsets = any((broker_group(g), t) in offsets for gg, t in pairs if gg == g)
        if by_offsets:
            out[g] = "both" if g in keyed else "committed offsets"
        else:
            out[g] = "consumed keys" if g in keyed else "none"
    return out


def marks(
    spark: SparkSession, committed: Sequence[Committed], bits: Mapping[str, int]
) -> DataFrame | None:
    """The committed offsets as one row per queue (``broker``, ``qtopic``, ``queue_id``),
    with ``marks``: each broker group's (``bgroup``) committed offset there and the bits of
    the expected groups it stands for (``bits``: expected group -> its bit).  A retry topic's
    queues are there too (``%RETRY%<group>``); None when there are no offsets at all."""
    if not committed:
        return None
    group_bits: dict[str, int] = {}
    for g, b in bits.items():
        group_bits[broker_group(g)] = group_bits.get(broker_group(g), 0) | b
    queues: dict[tuple[str, str, int], list[tuple[str, int, int]]] = {}
    for c in committed:
        if is_system_topic(c.topic) and c.topic != retry_topic(c.group):
            continue  # only the group's own retry topic tells something
        queues.setdefault((c.broker, c.topic, c.queue_id), []).append(
            (c.group, c.offset, group_bits.get(c.group, 0))
        )
    if not queues:
        return None
    return local_frame(spark, [(*k, v) for k, v in sorted(queues.items())], MARKS)
