"""The transaction side: the local-transaction logs, the half messages and their op records,
reduced to the few transactions that need a person (lost, phantom, parked).

One shuffle, by transaction id: the log rows, the halves and the op records (the broker's
export folds a half's first op record into the half's row) are grouped per half, named by
its broker set and commit-log offset (offsets repeat across the stores of a cluster; a
half's op records are in its own broker set's store) (the last
op record wins: ``max(store_ts * 8 + the rank it leads to)``), then per transaction on the
same partitioning (the local state, and a bit for each broker state its halves are in).
Every aggregate buffer is numeric, so Spark keeps to hash aggregation.  The halves of the
few transactions with something wrong are then looked up again and classified one by one:
a half rolled back beside a committed one of the same transaction is not hidden by it.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from txmq.spark.common import Run, mapped

__all__ = ["CANDIDATES", "CLASSES", "LOCAL_COMMITTED", "RANK", "candidates"]

#: a half's broker state (RECHECKED: a parked half an operator re-checked, superseded by its
#: copy, which is a half of the same transaction and classified on its own)
RANK = {"RECHECKED": 0, "ROLLED_BACK": 1, "PENDING": 2, "PARKED": 3, "COMMITTED": 4}
#: an op record's resolution as the rank of the broker state it leads to
_OP_CODE = {
    "ROLLBACK": RANK["ROLLED_BACK"],
    "PARKED": RANK["PARKED"],
    "COMMIT": RANK["COMMITTED"],
    "RECHECKED": RANK["RECHECKED"],
}
LOCAL_COMMITTED, _LOCAL_OTHER = 2, 1
#: the classes of the candidates, and the name of their counts (:meth:`Run.observe`)
CLASSES = ("lost", "phantom", "parked")
CANDIDATES = "candidates"
#: a broker state's bit in a transaction's ``ranks``
_BIT = {r: 1 << r for r in RANK.values()}
#: the strings a candidate half carries (its row's columns: the store's, by name)
_STRINGS = {"pgroup": "group", "msg_id": "msg_id", "topic": "topic", "key": "key"}


def candidates(run: Run, store: DataFrame, log: DataFrame, groups: list[str]) -> DataFrame:
    """One row per half message with something wrong (or per transaction, when the broker
    has none of its halves), inside the window: ``transaction_id``, ``local``
    (LOCAL_COMMITTED, another value, or null: no log row), ``at`` (ms: the local commit, else
    the first half), ``broker`` and ``half_offset`` (the half's broker set and commit-log
    offset), ``rank`` (the half's RANK value; null: no half),
    ``ranks`` (a bit ``1 << rank`` for each state the transaction's halves are in),
    ``class``, and the half's strings ``pgroup`` (its producer group), ``msg_id``, ``topic``
    and ``key`` (the half's row's, else an op record's; null without a half).  ``groups``:
    the producer groups whose halves are checked (those the logs know)."""
    null_long = F.lit(None).cast("long")
    local_rows = log.select(
        "transaction_id",
        F.lit(None).cast("string").alias("broker"),
        null_long.alias("half_offset"),
        F.when(F.col("state") == "COMMITTED", LOCAL_COMMITTED)
        .otherwise(_LOCAL_OTHER)
        .alias("local"),
        F.col("created_ms").alias("local_at"),
        null_long.alias("v"),
        null_long.alias("half_at"),
    )
    is_op = F.col("kind") == "op"
    # the last op record wins: an op's row, or the one the export folded into its half's
    v = (
        F.when(is_op, F.col("store_ts")).otherwise(F.col("op_ts")) * 8
        + mapped(F.col("resolution"), _OP_CODE)
    ).alias("v")
    half_at = F.when(~is_op, F.col("store_ts")).alias("half_at")
    brokers = store.where(F.col("kind").isin("half", "op") & F.col("group").isin(groups))
    broker_rows = brokers.select(
        "transaction_id",
        "broker",
        "half_offset",
        F.lit(None).cast("int").alias("local"),
        null_long.alias("local_at"),
        v,
        half_at,
    )
    # what both groupings keep of the local transaction and the first half
    firsts = [
        F.max("local").alias("local"),
        F.min("local_at").alias("local_at"),
        F.min("half_at").alias("half_at"),
    ]
    per_half = (
        local_rows.unionByName(broker_rows)
        .repartition("transaction_id")  # the two groupings below share this one shuffle
        .groupBy("transaction_id", "broker", "half_offset")
        .agg(*firsts, F.max("v").alias("v"))
        .select(
            "transaction_id",
            "broker",
            "half_offset",
            "local",
            "local_at",
            "half_at",
            _rank().alias("rank"),
        )
    )
    # per transaction: the local state, and the broker states its halves are in (a bit each)
    tx = (
        per_half.groupBy("transaction_id")
        .agg(*firsts, F.bit_or(mapped(F.col("rank"), _BIT)).alias("ranks"))
        .select(
            "transaction_id",
            "local",
            F.coalesce("local_at", "half_at").alias("at"),
            F.coalesce("ranks", F.lit(0)).alias("ranks"),
        )
    )
    tx = run.counted(tx, "transactions", run.window(F.col("at")))
    committed_locally = F.col("local") == LOCAL_COMMITTED
    not_committed = ~F.coalesce(committed_locally, F.lit(False))
    settled = F.col("at") < run.cutoff  # had the whole SLA to reach the broker

    def has(state: str) -> Column:
        return F.col("ranks").bitwiseAND(1 << RANK[state]) != 0

    no_half = F.col("ranks") == 0
    late = no_half | has("PENDING")  # no half yet, or one undecided: lost after the SLA
    suspect = run.window(F.col("at")) & (
        (committed_locally & (has("ROLLED_BACK") | (late & settled)))
        | (has("COMMITTED") & not_committed)
        | has("PARKED")
    )
    suspects = run.keep(tx.where(suspect))
    # each half of the few suspect transactions, classified on its own: a committed
    # transaction's rolled-back half is lost even when another half of it committed.  Their
    # halves are looked up again (a join with the few, which Spark broadcasts), rather than
    # kept from the grouping above: that holds every half of the run
    rank = F.col("rank")
    kind = (
        F.when(
            committed_locally
            & ((rank == RANK["ROLLED_BACK"]) | ((rank == RANK["PENDING"]) & settled)),
            "lost",
        )
        .when((rank == RANK["COMMITTED"]) & not_committed, "phantom")
        .when(rank == RANK["PARKED"], "parked")
    )
    # with the strings the rows need: the half's own (else an op record's, from its body)
    strings = F.struct(is_op.alias("is_op"), *(F.col(c).alias(c) for c in _STRINGS.values())).alias(
        "s"
    )
    halves = (
        brokers.select("transaction_id", "broker", "half_offset", v, half_at, strings)
        .join(suspects.where(~no_half), "transaction_id")
        .groupBy("transaction_id", "broker", "half_offset", "local", "at", "ranks")
        .agg(F.min("half_at").alias("half_at"), F.max("v").alias("v"), F.min("s").alias("s"))
        .select(
            "transaction_id",
            "broker",
            "half_offset",
            "local",
            "at",
            "ranks",
            _rank().alias("rank"),
            *(F.col("s")[c].alias(name) for name, c in _STRINGS.items()),
        )
        .withColumn("class", kind)
        .where(F.col("class").isNotNull())
    )
    missing = suspects.where(no_half).select(
        "*",
        F.lit(None).cast("string").alias("broker"),
        F.lit(None).cast("long").alias("half_offset"),
        F.lit(None).cast("int").alias("rank"),
        *(F.lit(None).cast("string").alias(name) for name in _STRINGS),
        F.lit("lost").alias("class"),
    )
    txc = halves.unionByName(missing)
    # how many of each class
    return run.keep(
        run.observe(
            txc,
            CANDIDATES,
            **{c: F.sum(F.when(F.col("class") == c, 1).otherwise(0)) for c in CLASSES},
        )
    )


def _rank() -> Column:
    """A half's broker state (a RANK value) from its group's ``v`` (the last op record's) and
    ``half_at`` (the half itself): null for the local transaction's row."""
    return (
        F.when(F.col("v").isNotNull(), F.col("v") % 8)
        .when(F.col("half_at").isNotNull(), RANK["PENDING"])
        .cast("int")
    )
