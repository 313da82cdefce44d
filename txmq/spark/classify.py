"""Joining the three views and classifying every transaction and message.

Inputs (see :mod:`spark.sources`): ``store`` rows from the broker stores (a ``broker``
column names the broker set of each: a cluster has a store per broker set, and a half is
named by its broker set and commit-log offset, a message by its id), and ``log`` /
``outbox`` / ``consumed`` rows from the databases (each with a ``db`` column), and the
consumer groups' committed offsets from the stores (:mod:`spark.offsets`).  A
transaction is named by its transaction id (a transactional send, checked against the
local-transaction log) or by its message id (an outbox row).  A message is matched to a
consumer group's consumed keys by its message id or any of its keys, as
``txmq.idempotent``'s key functions may pick either; a group that records no consumed
keys (a plain push consumer) consumed a message when its committed offset for the
message's queue passed it (and the offset of ``%RETRY%<group>`` passed any retry copy of
it).  Either evidence is enough: a message is unconsumed by G when neither says G
consumed it; the summary says which evidence each expected group had (``evidence``:
consumed keys, committed offsets, both, or none).

The anomaly classes (:data:`CLASSES`), each a DataFrame of :data:`COLUMNS`:

``lost``
    committed locally, the message never committed: the broker rolled the half back, or
    after the SLA still holds it undecided or never got it (each half of a transaction on
    its own); or an outbox row older than the SLA whose message the broker does not have.
``phantom``
    the broker committed a transactional message whose local transaction did not commit
    (rolled back by a check, or no row at all) — for the producer groups the databases know.
``unconsumed``
    a committed message of a topic that consumer group G is expected to consume, older than
    the SLA, with no ``done`` consumed key of G and not passed by G's committed offsets (and
    not dead-lettered by G: that is below).
``duplicate``
    one event (a message's first key, else its id) applied by G under more than one
    consumed key — e.g. once by message id and once by key after the key function changed,
    or two messages of one event both consumed by id.
``parked``
    a half message parked after the maximum checks; ``local_state`` says what to decide.
``dead_lettered``
    a message in ``%DLQ%<G>`` that G has not consumed since (whatever other groups did):
    one row per group that gave up on the message.

The saga classes (``saga_stuck``, ``saga_partly_compensated``, ``saga_effect_without_barrier``,
``saga_barrier_without_saga``) are :mod:`spark.sagas`'s, with columns of their own.

Group G is expected to consume topic T when told so (``expect``), or else when G has
consumed at least one message of T (which costs a pass of its own): by a consumed key, or
by a committed offset above 0 for one of T's queues (then G is the broker's group name,
unless a group with consumed keys of T names that broker group already, as
``inventory-service/order-created`` names ``inventory-service``).  A row belongs to the
run when its anchor time (local commit, outbox insert, broker store time, dead-letter time)
is inside the window.  Every view is as of one time (``run.now``: the caller reads them so),
and a transaction younger than the SLA is in flight, not lost.

How it stays fast: each side is one shuffle with numeric aggregate buffers
(:mod:`spark.transactions`, :mod:`spark.messages`); the consumed keys are broadcast, not
shuffled; the strings of the few anomalies are looked up at the end (:mod:`spark.details`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from txmq.spark import messages, offsets, transactions
from txmq.spark.common import Run, mapped
from txmq.spark.details import COLUMNS, Anomalies, anomalies
from txmq.spark.options import MAX_ROWS, BadOption
from txmq.spark.sagas import SAGA_CLASSES, SAGA_COLUMNS
from txmq.spark.sources import Database

__all__ = ["CLASSES", "COLUMNS", "MESSAGE_CLASSES", "SAGA_CLASSES", "Facts", "classify", "columns"]

#: the classes of transactions and messages (columns :data:`COLUMNS`)
MESSAGE_CLASSES = ("lost", "phantom", "unconsumed", "duplicate", "parked", "dead_lettered")
#: every class, in the order the summary shows them
CLASSES = MESSAGE_CLASSES + SAGA_CLASSES


def columns(anomaly: str) -> tuple[str, ...]:
    """The columns of class ``anomaly``'s rows."""
    return SAGA_COLUMNS if anomaly in SAGA_CLASSES else COLUMNS


@dataclass
class Facts:
    """What the run looked at (counted while classifying, without another pass)."""

    counts: dict[str, int]
    expected: list[tuple[str, str]]
    #: each expected group's evidence of consumption (one of spark.offsets.EVIDENCE)
    evidence: dict[str, str]


def classify(
    run: Run,
    store: DataFrame,
    log: DataFrame,
    outbox: DataFrame,
    consumed: DataFrame,
    *,
    dbs: Sequence[Database],
    expect: Iterable[tuple[str, str]] | None = None,
    producer_groups: Iterable[str] = (),
    consumer_groups: Iterable[str] = (),
    committed: Sequence[offsets.Committed] = (),
    broadcast: bool = True,
    max_rows: int = MAX_ROWS,
) -> tuple[Anomalies, Facts]:
    """(the anomalies of each class, facts for the summary);
    ``run.cached`` holds what it cached, for the caller to unpersist once done with them.
    ``dbs``: the databases the tables come from (the anomalies' rows are fetched from them);
    ``producer_groups``: the groups whose transactions the logs hold (the broker's halves of
    other groups are not checked); ``consumer_groups``: the groups with consumed keys;
    ``committed``: the broker groups' committed offsets (:func:`spark.offsets.read_offsets`);
    ``broadcast``: the consumed keys fit in the driver's memory; ``max_rows``: the most rows
    of a class put together (its count stays exact).  The big passes run here,
    each once; what is left is small and put together on the driver."""
    spark = run.spark
    with run.step("transactions", "classifying the transactions"):
        txc = transactions.candidates(run, store, log, sorted(set(producer_groups)))

    key_groups = set(consumer_groups)
    names = sorted(key_groups)
    if expect is None:
        keys = messages.consumed_hashes(consumed, _groups(names, {}), broadcast)
        with run.step("expected consumers", "finding what each group consumes"):
            seen = messages.pairs(store, keys).collect()
        pairs = {(names[r["gi"]], r["topic"]) for r in seen}
        # the groups that consumed a topic by their committed offsets, unless a group with
        # consumed keys of the topic stands for that broker group already
        keyed = {(messages.broker_group(g), t) for g, t in pairs}
        pairs |= offsets.consumed_topics(committed) - keyed
    else:
        pairs = set(expect)
    expected = sorted(pairs)
    bit = {g: 1 << i for i, g in enumerate(sorted({g for g, _ in pairs}))}
    if len(bit) > messages.MAX_GROUPS:
        raise BadOption(
            f"at most {messages.MAX_GROUPS} expected consumer groups, not {len(bit)}: name "
            "them with --expect, or reconcile fewer databases at a time"
        )
    need: dict[str, int] = {}
    for g, t in pairs:
        need[t] = need.get(t, 0) | bit[g]
    names += sorted(set(bit) - set(names))  # expected, without consumed keys yet
    keys = messages.consumed_hashes(consumed, _groups(names, bit), broadcast)
    db_index = mapped(F.col("db"), {d.name: i for i, d in enumerate(dbs)}, 0)
    marks = offsets.marks(spark, committed, bit)
    evidence = offsets.evidence(pairs, key_groups, committed)
    with run.step("messages", "classifying the messages"):
        flagged = messages.flags(run, store, outbox, keys, need, db_index, bit, names, marks)
    with run.step("details", "putting the anomalies' rows together"):
        found = anomalies(
            run,
            store,
            txc,
            flagged,
            dbs=dbs,
            bits=bit,
            groups=names,
            evidence=evidence,
            max_rows=max_rows,
        )
        counts = run.counts()
    return found, Facts(counts, expected, evidence)


def _groups(names: list[str], bit: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The consumer groups: name -> (``gi``: its index, ``gbit``: its bit, or 0)."""
    return {g: (i, bit.get(g, 0)) for i, g in enumerate(names)}
