"""Joining the three views and classifying every transaction and message.

Inputs (see :mod:`spark.sources`): ``store`` rows from the broker, and ``log`` /
``outbox`` / ``consumed`` rows from the databases (each with a ``db`` column).  A
transaction is named by its transaction id (a transactional send, checked against the
local-transaction log) or by its message id (an outbox row).  A message is matched to a
consumer group's consumed keys by its message id or any of its keys, as
``txmq.idempotent``'s key functions may pick either.

The anomaly classes (:data:`CLASSES`), each a DataFrame of :data:`COLUMNS`:

``lost``
    committed locally, the message never committed: the broker rolled the half back, never
    got it, or still holds it undecided after the SLA; or an outbox row older than the SLA
    whose message the broker does not have.
``phantom``
    the broker committed a transactional message whose local transaction did not commit
    (rolled back by a check, or no row at all) — for the producer groups the databases know.
``unconsumed``
    a committed message of a topic that consumer group G is expected to consume, older than
    the SLA, with no ``done`` consumed key of G (and not dead-lettered: that is below).
``duplicate``
    one event (a message's first key, else its id) applied by G under more than one
    consumed key — e.g. once by message id and once by key after the key function changed,
    or two messages of one event both consumed by id.
``parked``
    a half message parked after the maximum checks; ``local_state`` says what to decide.
``dead_lettered``
    a message in ``%DLQ%<group>`` that no expected consumer group has consumed since.

Group G is expected to consume topic T when told so (``expect``), or else when G has
consumed at least one message of T.  A row belongs to the run when its anchor time (local
commit, outbox insert, broker store time, dead-letter time) is inside the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

__all__ = ["CLASSES", "COLUMNS", "classify"]

CLASSES = ("lost", "phantom", "unconsumed", "duplicate", "parked", "dead_lettered")
COLUMNS = (
    "anomaly",
    "group",
    "transaction_id",
    "msg_id",
    "topic",
    "key",
    "local_state",
    "broker_state",
    "detail",
    "at",
    "db",
)
_RANK = {"ROLLED_BACK": 1, "PENDING": 2, "PARKED": 3, "COMMITTED": 4}
#: an op record's resolution as the rank of the broker state it leads to
_OP_CODE = {
    "ROLLBACK": _RANK["ROLLED_BACK"],
    "PARKED": _RANK["PARKED"],
    "COMMIT": _RANK["COMMITTED"],
}


def _ts(ms: Column) -> Column:
    return F.timestamp_millis(ms)


def _in_window(at: Column, since: datetime | None, until: datetime | None) -> Column:
    cond = F.lit(True)
    if since is not None:
        cond = cond & (at >= F.lit(since))
    if until is not None:
        cond = cond & (at < F.lit(until))
    return cond


def _shape(df: DataFrame, anomaly: str, **cols: Column) -> DataFrame:
    exprs = []
    for name in COLUMNS:
        if name == "anomaly":
            exprs.append(F.lit(anomaly).alias(name))
        elif name in cols:
            exprs.append(cols[name].cast("timestamp" if name == "at" else "string").alias(name))
        else:
            exprs.append(F.lit(None).cast("timestamp" if name == "at" else "string").alias(name))
    return df.select(*exprs)


def _message_cols(**more: Column) -> dict[str, Column]:
    """The columns of a row about one message (group, id, topic, key, time), and ``more``."""
    cols = {n: F.col(n) for n in ("group", "msg_id", "topic", "key", "at")}
    return cols | more


def _with_half(df: DataFrame, halves: DataFrame) -> DataFrame:
    """``df`` (a few transactions) with the producer group, message id, topic and key of
    each one's highest-ranked half message (NULLs when the broker has none)."""
    ids = df.select("transaction_id").distinct()
    attrs = halves.join(F.broadcast(ids), "transaction_id", "left_semi").select(
        "transaction_id",
        F.col("group").alias("pgroup"),
        "msg_id",
        "topic",
        "key",
        F.row_number()
        .over(Window.partitionBy("transaction_id").orderBy(F.desc("rank"), "msg_id"))
        .alias("n"),
    )
    return df.join(attrs.where("n = 1").drop("n"), "transaction_id", "left")


def _map(col: Column, mapping: dict[Any, Any]) -> Column:
    """``mapping[col]`` (NULL when absent), as a CASE expression."""
    items = iter(mapping.items())
    k, v = next(items)
    out = F.when(col == F.lit(k), F.lit(v))
    for k, v in items:
        out = out.when(col == F.lit(k), F.lit(v))
    return out


def classify(
    spark: SparkSession,
    store: DataFrame,
    log: DataFrame,
    outbox: DataFrame,
    consumed: DataFrame,
    *,
    now: datetime,
    sla: timedelta,
    since: datetime | None = None,
    until: datetime | None = None,
    expect: Iterable[tuple[str, str]] | None = None,
    producer_groups: Iterable[str] = (),
) -> tuple[dict[str, DataFrame], dict[str, DataFrame], list[DataFrame]]:
    """(anomalies by class, facts for the summary, the frames it cached: the caller
    unpersists them once done with the first two)."""
    cached: list[DataFrame] = []

    def keep(df: DataFrame) -> DataFrame:
        cached.append(df.cache())
        return df

    cutoff = F.lit(now - sla)
    store = keep(store)

    # -- the broker's view of each transactional send ----------------------------------------
    # Aggregations stay numeric (hash aggregates); the strings of the few anomalies are
    # joined back at the end.  The last op record of a half wins: max(store_ts * 8 + code).
    ops = (
        store.where("kind = 'op'")
        .select(
            "half_offset", (F.col("store_ts") * 8 + _map(F.col("resolution"), _OP_CODE)).alias("v")
        )
        .groupBy("half_offset")
        .agg(F.max("v").alias("v"))
        .select(
            "half_offset", (F.col("v") % 8).alias("rank"), F.floor(F.col("v") / 8).alias("op_ts")
        )
    )
    halves = (
        store.where("kind = 'half'")
        .select(
            "half_offset", "transaction_id", "group", "msg_id", "topic", "key", "keys", "store_ts"
        )
        .join(ops, "half_offset", "left")
        .withColumn("rank", F.coalesce("rank", F.lit(_RANK["PENDING"])))
    )
    groups = (
        log.select(F.col("producer_group").alias("group"))
        .union(spark.createDataFrame([(g,) for g in producer_groups], "group string"))
        .distinct()
    )
    per_tx = (
        halves.join(F.broadcast(groups), "group", "left_semi")
        .groupBy("transaction_id")
        .agg(F.max("rank").alias("rank"), _ts(F.min("store_ts")).alias("half_at"))
    )
    local = log.select(
        "transaction_id",
        F.col("producer_group").alias("lgroup"),
        F.col("state").alias("local_state"),
        F.col("created_at").alias("local_at"),
        "db",
    )
    tx = (
        local.join(per_tx, "transaction_id", "full_outer")
        .withColumn("at", F.coalesce("local_at", "half_at"))
        .withColumn("broker_state", _map(F.col("rank"), {v: k for k, v in _RANK.items()}))
        .where(_in_window(F.col("at"), since, until))
    )
    committed_locally = F.col("local_state") == "COMMITTED"
    state = F.col("broker_state")
    kind = (
        F.when(
            committed_locally
            & (
                state.isNull()
                | (state == "ROLLED_BACK")
                | ((state == "PENDING") & (F.col("at") < cutoff))
            ),
            "lost",
        )
        .when((state == "COMMITTED") & ~F.coalesce(committed_locally, F.lit(False)), "phantom")
        .when(state == "PARKED", "parked")
    )
    candidates = keep(tx.withColumn("class", kind).where(F.col("class").isNotNull()))
    txa = keep(_with_half(candidates, halves))
    tx_cols = {
        "group": F.coalesce("lgroup", "pgroup"),
        "transaction_id": F.col("transaction_id"),
        "msg_id": F.col("msg_id"),
        "topic": F.col("topic"),
        "key": F.col("key"),
        "local_state": F.coalesce("local_state", F.lit("NONE")),
        "broker_state": F.coalesce("broker_state", F.lit("MISSING")),
        "at": F.col("at"),
        "db": F.col("db"),
    }
    lost = _shape(
        txa.where("class = 'lost'"),
        "lost",
        detail=F.when(F.col("broker_state").isNull(), "the broker never got the half message")
        .when(F.col("broker_state") == "ROLLED_BACK", "the broker rolled the message back")
        .otherwise("the half message is still undecided after the SLA"),
        **tx_cols,
    )
    phantom = _shape(
        txa.where("class = 'phantom'"),
        "phantom",
        detail=F.when(F.col("local_state").isNull(), "no local transaction with this id").otherwise(
            F.concat(F.lit("the local transaction is "), F.col("local_state"))
        ),
        **tx_cols,
    )
    parked = _shape(
        txa.where("class = 'parked'"),
        "parked",
        detail=F.when(committed_locally, "decide COMMIT: it committed locally").otherwise(
            "decide ROLLBACK: it did not commit locally"
        ),
        **tx_cols,
    )

    # -- outbox rows ------------------------------------------------------------------------
    stored = store.where("kind = 'message'")
    lost_outbox = outbox.where(
        _in_window(F.col("created_at"), since, until) & (F.col("created_at") < cutoff)
    ).join(stored.select("msg_id"), "msg_id", "left_anti")
    lost = lost.unionByName(
        _shape(
            lost_outbox,
            "lost",
            msg_id=F.col("msg_id"),
            topic=F.col("topic"),
            key=F.coalesce(F.split("keys", " ")[0], F.col("msg_id")),
            local_state=F.concat(F.lit("outbox "), F.col("state")),
            broker_state=F.lit("MISSING"),
            detail=F.concat(
                F.lit("outbox row not at the broker after "),
                F.col("attempts").cast("string"),
                F.lit(" attempts"),
                F.coalesce(F.concat(F.lit(": "), F.col("last_error")), F.lit("")),
            ),
            at=F.col("created_at"),
            db=F.col("db"),
        )
    )

    # -- committed messages and their consumption -------------------------------------------
    # A message stored twice (a retried send) is here twice; the outputs drop the repeats.
    committed = keep(
        halves.where(F.col("rank") == _RANK["COMMITTED"])
        .select("msg_id", "topic", "key", "keys", _ts(F.col("op_ts")).alias("at"))
        .unionByName(
            stored.select("msg_id", "topic", "key", "keys", _ts(F.col("store_ts")).alias("at"))
        )
    )
    tokens = committed.select(
        "msg_id",
        F.explode(
            F.array_distinct(
                F.concat(
                    F.array("msg_id"),
                    F.coalesce(F.split("keys", " "), F.array().cast("array<string>")),
                )
            )
        ).alias("token"),
    )
    done = consumed.where("state = 'done'").select(
        F.col("consumer_group").alias("group"), F.col("key").alias("token"), "db"
    )
    matched = keep(tokens.join(done, "token").select("msg_id", "group", "token", "db"))
    if expect is None:
        expected = (
            matched.join(committed.select("msg_id", "topic"), "msg_id")
            .select("group", "topic")
            .distinct()
        )
    else:
        expected = spark.createDataFrame(sorted(set(expect)), "group string, topic string")
    expected = keep(expected)
    dlq = store.where("kind = 'dlq'")
    in_window = committed.where(_in_window(F.col("at"), since, until))
    unconsumed = (
        in_window.where(F.col("at") < cutoff)
        .join(F.broadcast(expected), "topic")
        .join(matched.select("msg_id", "group"), ["msg_id", "group"], "left_anti")
        .join(dlq.select("msg_id"), "msg_id", "left_anti")
        .dropDuplicates(["msg_id", "group"])
    )
    unconsumed_df = _shape(
        unconsumed,
        "unconsumed",
        **_message_cols(
            broker_state=F.lit("COMMITTED"), detail=F.lit("no consumed key after the SLA")
        ),
    )
    # duplicates: count the distinct consumed keys of each (group, event key) with a hash
    # aggregate first; only the events applied more than once get their details collected
    applied_by = keep(matched.join(in_window.select("msg_id", "key", "topic", "at"), "msg_id"))
    twice = (
        applied_by.select("group", "key", "token")
        .distinct()
        .groupBy("group", "key")
        .count()
        .where("count > 1")
        .select("group", "key")
    )
    applied = (
        applied_by.join(twice, ["group", "key"], "left_semi")
        .groupBy("group", "key")
        .agg(
            F.countDistinct("token").alias("n"),
            F.sort_array(F.collect_set("token")).alias("tokens"),
            F.min("msg_id").alias("msg_id"),
            F.first("topic").alias("topic"),
            F.min("at").alias("at"),
            F.first("db").alias("db"),
        )
    )
    duplicate = _shape(
        applied,
        "duplicate",
        **_message_cols(
            broker_state=F.lit("COMMITTED"),
            detail=F.concat(
                F.lit("applied "),
                F.col("n").cast("string"),
                F.lit(" times, as "),
                F.concat_ws(", ", "tokens"),
            ),
            db=F.col("db"),
        ),
    )
    letters = keep(
        dlq.where(_in_window(_ts(F.col("store_ts")), since, until))
        .groupBy("group", "msg_id")
        .agg(
            F.first("topic").alias("topic"),
            F.first("key").alias("key"),
            F.max("reconsume_times").alias("times"),
            _ts(F.max("store_ts")).alias("at"),
        )
    )
    # consumed since by a group that expects its topic (the original topic is on the copy)
    consumed_since = (
        matched.join(letters.select("msg_id", "topic").distinct(), "msg_id")
        .join(F.broadcast(expected), ["group", "topic"])
        .select("msg_id")
    )
    dead = letters.join(consumed_since, "msg_id", "left_anti")
    dead_lettered = _shape(
        dead,
        "dead_lettered",
        **_message_cols(
            broker_state=F.lit("DLQ"),
            detail=F.concat(
                F.lit("dead-lettered after "), F.col("times").cast("string"), F.lit(" deliveries")
            ),
        ),
    )
    retrying = (
        store.where("kind = 'retry'")
        .select("group", "msg_id")
        .distinct()
        .join(matched.select("msg_id"), "msg_id", "left_anti")
    )
    anomalies = {
        "lost": lost,
        "phantom": phantom,
        "unconsumed": unconsumed_df,
        "duplicate": duplicate,
        "parked": parked,
        "dead_lettered": dead_lettered,
    }
    facts = {
        "transactions": tx,
        "outbox": outbox.where(_in_window(F.col("created_at"), since, until)),
        "messages": in_window.select("msg_id").distinct(),
        "retrying": retrying,
        "expected": expected,
    }
    return anomalies, facts, cached
