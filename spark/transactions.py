"""The transaction side: the local-transaction logs, the half messages and their op records,
reduced to the few transactions that need a person (lost, phantom, parked).

One shuffle, by transaction id: the log rows, the halves and the op records (the broker's
export folds a half's first op record into the half's row) are grouped per half (the last
op record wins: ``max(store_ts * 8 + the rank it leads to)``), then per
transaction on the same partitioning (the best half wins: its rank and commit-log offset are
packed in one long).  Every aggregate buffer is numeric, so Spark keeps to hash aggregation.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from txmq.spark.common import Run, mapped

__all__ = ["LOCAL_COMMITTED", "RANK", "candidates"]

RANK = {"ROLLED_BACK": 1, "PENDING": 2, "PARKED": 3, "COMMITTED": 4}
#: an op record's resolution as the rank of the broker state it leads to
_OP_CODE = {"ROLLBACK": RANK["ROLLED_BACK"], "PARKED": RANK["PARKED"], "COMMIT": RANK["COMMITTED"]}
LOCAL_COMMITTED, _LOCAL_OTHER = 2, 1
#: a half's rank and commit-log offset packed in one long, so max() picks the best half
_OFFSET_BITS = 59
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


def candidates(run: Run, store: DataFrame, log: DataFrame, groups: list[str]) -> DataFrame:
    """One row per transaction with something wrong, inside the window: ``transaction_id``,
    ``local`` (LOCAL_COMMITTED, another value, or null: no log row), ``at`` (ms), ``rank``
    (a RANK value, null: no half), ``half_offset`` (the best half's) and ``class``.
    ``groups``: the producer groups whose halves are checked (those the logs know)."""
    null_long = F.lit(None).cast("long")
    local_rows = log.select(
        "transaction_id",
        null_long.alias("half_offset"),
        F.when(F.col("state") == "COMMITTED", LOCAL_COMMITTED)
        .otherwise(_LOCAL_OTHER)
        .alias("local"),
        F.col("created_ms").alias("local_at"),
        null_long.alias("v"),
        null_long.alias("half_at"),
    )
    is_op = F.col("kind") == "op"
    broker_rows = store.where(
        F.col("kind").isin("half", "op") & F.col("group").isin(groups)
    ).select(
        "transaction_id",
        "half_offset",
        F.lit(None).cast("int").alias("local"),
        null_long.alias("local_at"),
        # the last op record wins: an op's row, or the one the export folded into its half's
        (
            F.when(is_op, F.col("store_ts")).otherwise(F.col("op_ts")) * 8
            + mapped(F.col("resolution"), _OP_CODE)
        ).alias("v"),
        F.when(~is_op, F.col("store_ts")).alias("half_at"),
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
        .groupBy("transaction_id", "half_offset")
        .agg(*firsts, F.max("v").alias("v"))
        .select(
            "transaction_id",
            "local",
            "local_at",
            "half_at",
            (
                F.when(F.col("v").isNotNull(), F.col("v") % 8).when(
                    F.col("half_at").isNotNull(), RANK["PENDING"]
                )
                * (1 << _OFFSET_BITS)
                + F.col("half_offset")
            ).alias("best"),
        )
    )
    tx = (
        per_half.groupBy("transaction_id")
        .agg(*firsts, F.max("best").alias("best"))
        .select(
            "transaction_id",
            "local",
            F.coalesce("local_at", "half_at").alias("at"),
            F.shiftright("best", _OFFSET_BITS).cast("int").alias("rank"),
            F.col("best").bitwiseAND(F.lit(_OFFSET_MASK)).alias("half_offset"),
        )
    )
    tx = run.counted(tx, "transactions", run.window(F.col("at")))
    committed_locally = F.col("local") == LOCAL_COMMITTED
    rank = F.col("rank")
    kind = (
        F.when(
            committed_locally
            & (
                rank.isNull()
                | (rank == RANK["ROLLED_BACK"])
                | ((rank == RANK["PENDING"]) & (F.col("at") < run.cutoff))
            ),
            "lost",
        )
        .when((rank == RANK["COMMITTED"]) & ~F.coalesce(committed_locally, F.lit(False)), "phantom")
        .when(rank == RANK["PARKED"], "parked")
    )
    return run.keep(
        tx.withColumn("class", kind).where(F.col("class").isNotNull() & run.window(F.col("at")))
    )
