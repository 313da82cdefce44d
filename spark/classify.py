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

How it stays fast: every view is reduced by one grouping per side, with numeric aggregate
buffers (hash aggregation, no sorting).  The transaction side shuffles the log, the half
messages and the op records once, by transaction id.  The message side joins message tokens
to consumed keys once, on 96-bit hashes of the strings (xxhash64 and murmur3: a false match
needs both to collide), then groups by message and by (group, event).  The strings of the
few anomalies are looked up at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from py4j.protocol import Py4JError  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F

__all__ = ["CLASSES", "COLUMNS", "Facts", "classify"]

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
_LOCAL_COMMITTED, _LOCAL_OTHER = 2, 1
#: a half's rank and commit-log offset packed in one long, so max() picks the best half
_OFFSET_BITS = 59
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def _in_window(at_ms: Column, since: datetime | None, until: datetime | None) -> Column:
    cond = F.lit(True)
    if since is not None:
        cond = cond & (at_ms >= F.lit(_ms(since)))
    if until is not None:
        cond = cond & (at_ms < F.lit(_ms(until)))
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


def _map(col: Column, mapping: dict[Any, Any], default: Any = None) -> Column:
    """``mapping[col]`` (``default`` when absent), as a CASE expression."""
    out: Any = F
    for k, v in mapping.items():
        out = out.when(col == F.lit(k), F.lit(v))
    return F.lit(default) if out is F else out.otherwise(F.lit(default))


def _message_cols(**more: Column) -> dict[str, Column]:
    """The columns of a row about one message (group, id, topic, key, time), and ``more``."""
    cols = {n: F.col(n) for n in ("group", "msg_id", "topic", "key")}
    return cols | {"at": F.timestamp_millis("at")} | more


def _h(col: str | Column) -> list[Column]:
    """A string as two hashes (96 bits together): what the big joins and groupings use."""
    return [F.xxhash64(col), F.hash(col)]


def _first(df: DataFrame, by: str, order: list[Column]) -> DataFrame:
    """One row of ``df`` per ``by`` (the first by ``order``)."""
    n = F.row_number().over(Window.partitionBy(by).orderBy(*order))
    return df.withColumn("_n", n).where("_n = 1").drop("_n")


def _restrict(df: DataFrame, col: str, values: DataFrame, limit: int = 100_000) -> DataFrame:
    """The rows of ``df`` whose ``col`` is among ``values`` (one column of a few rows): an
    ``IN`` list the database evaluates when there are at most ``limit``, else a join."""
    rows = values.distinct().limit(limit + 1).collect()
    if len(rows) <= limit:
        return df.where(F.col(col).isin([r[0] for r in rows]))
    return df.join(F.broadcast(values.withColumnRenamed(values.columns[0], col)), col, "left_semi")


def _tokens(messages: DataFrame) -> Column:
    """A message's tokens: its id and each of its keys (a consumed key may be any)."""
    return F.explode(
        F.array_distinct(
            F.concat(
                F.array("msg_id"),
                F.coalesce(F.split("keys", " "), F.array().cast("array<string>")),
            )
        )
    )


@dataclass
class Facts:
    """What the run looked at (counted while classifying, without another pass)."""

    observations: dict[str, tuple[Observation, DataFrame]]
    expected: list[tuple[str, str]]

    def counts(self) -> dict[str, int]:
        out = {}
        for name, (obs, df) in self.observations.items():
            try:
                out[name] = int(obs.get["n"] or 0)
            except Py4JError:  # a pass over empty input may have been skipped, metric and all
                out[name] = int(df.count())
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
) -> tuple[dict[str, DataFrame], Facts, list[DataFrame]]:
    """(anomalies by class, facts for the summary, the frames it cached: the caller
    unpersists them once done with the first two).  ``producer_groups``: the groups whose
    transactions the logs hold (the broker's halves of other groups are not checked).  The
    big passes run here, each once; what is left for the caller are small frames."""
    cached: list[DataFrame] = []

    def keep(df: DataFrame) -> DataFrame:
        cached.append(df.cache())
        df.count()  # materialized now, once: later frames read the cache
        return df

    observations: dict[str, tuple[Observation, DataFrame]] = {}

    def counted(df: DataFrame, name: str, cond: Column) -> DataFrame:
        """``df``, counting its rows that meet ``cond`` as it is computed (see Facts)."""
        obs = Observation(name)
        observations[name] = (obs, df.where(cond))
        return df.observe(obs, F.sum(F.when(cond, 1).otherwise(0)).alias("n"))

    cutoff = F.lit(_ms(now - sla))
    window: Callable[[Column], Column] = lambda at: _in_window(at, since, until)  # noqa: E731
    null_long = F.lit(None).cast("long")

    # -- transactions: the log, the half messages and the op records, by transaction id -----
    groups = sorted(set(producer_groups))
    local_rows = log.select(
        "transaction_id",
        null_long.alias("half_offset"),
        F.when(F.col("state") == "COMMITTED", _LOCAL_COMMITTED)
        .otherwise(_LOCAL_OTHER)
        .alias("local"),
        F.unix_millis("created_at").alias("local_at"),
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
        # the last op record of a half wins: max(store_ts * 8 + the rank it leads to)
        F.when(is_op, F.col("store_ts") * 8 + _map(F.col("resolution"), _OP_CODE)).alias("v"),
        F.when(~is_op, F.col("store_ts")).alias("half_at"),
    )
    per_half = (
        local_rows.unionByName(broker_rows)
        .repartition("transaction_id")  # the two groupings below share this one shuffle
        .groupBy("transaction_id", "half_offset")
        .agg(
            F.max("local").alias("local"),
            F.min("local_at").alias("local_at"),
            F.max("v").alias("v"),
            F.min("half_at").alias("half_at"),
        )
        .select(
            "transaction_id",
            "local",
            "local_at",
            "half_at",
            (
                F.when(F.col("v").isNotNull(), F.col("v") % 8).when(
                    F.col("half_at").isNotNull(), _RANK["PENDING"]
                )
                * (1 << _OFFSET_BITS)
                + F.col("half_offset")
            ).alias("best"),
        )
    )
    tx = (
        per_half.groupBy("transaction_id")
        .agg(
            F.max("local").alias("local"),
            F.min("local_at").alias("local_at"),
            F.min("half_at").alias("half_at"),
            F.max("best").alias("best"),
        )
        .select(
            "transaction_id",
            "local",
            F.coalesce("local_at", "half_at").alias("at"),
            F.shiftright("best", _OFFSET_BITS).cast("int").alias("rank"),
            (F.col("best").bitwiseAND(F.lit(_OFFSET_MASK))).alias("half_offset"),
        )
    )
    tx = counted(tx, "transactions", window(F.col("at")))
    committed_locally = F.col("local") == _LOCAL_COMMITTED
    rank = F.col("rank")
    kind = (
        F.when(
            committed_locally
            & (
                rank.isNull()
                | (rank == _RANK["ROLLED_BACK"])
                | ((rank == _RANK["PENDING"]) & (F.col("at") < cutoff))
            ),
            "lost",
        )
        .when(
            (rank == _RANK["COMMITTED"]) & ~F.coalesce(committed_locally, F.lit(False)), "phantom"
        )
        .when(rank == _RANK["PARKED"], "parked")
    )
    candidates = keep(
        tx.withColumn("class", kind).where(F.col("class").isNotNull() & window(F.col("at")))
    )
    # their strings: the best half's (else its op record's) and the log row's
    half_attrs = _first(
        store.where(F.col("kind").isin("half", "op"))
        .join(F.broadcast(candidates.select("half_offset")), "half_offset", "left_semi")
        .select(
            "half_offset",
            F.col("group").alias("pgroup"),
            "msg_id",
            "topic",
            "key",
            (F.col("kind") == "op").alias("is_op"),
        ),
        "half_offset",
        [F.col("is_op")],
    ).drop("is_op")
    local_attrs = _first(
        _restrict(log, "transaction_id", candidates.select("transaction_id")).select(
            "transaction_id",
            F.col("producer_group").alias("lgroup"),
            F.col("state").alias("local_state"),
            "db",
        ),
        "transaction_id",
        [F.col("db")],
    )
    txa = keep(
        candidates.join(half_attrs, "half_offset", "left").join(
            local_attrs, "transaction_id", "left"
        )
    )
    tx_cols = {
        "group": F.coalesce("lgroup", "pgroup"),
        "transaction_id": F.col("transaction_id"),
        "msg_id": F.col("msg_id"),
        "topic": F.col("topic"),
        "key": F.col("key"),
        "local_state": F.coalesce("local_state", F.lit("NONE")),
        "broker_state": _map(rank, {v: k for k, v in _RANK.items()}, "MISSING"),
        "at": F.timestamp_millis("at"),
        "db": F.col("db"),
    }
    lost = _shape(
        txa.where("class = 'lost'"),
        "lost",
        detail=F.when(rank.isNull(), "the broker never got the half message")
        .when(rank == _RANK["ROLLED_BACK"], "the broker rolled the message back")
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

    # -- messages: their tokens (id and keys) joined to the consumed keys once --------------
    messages = store.where(F.col("kind") == "message")
    done = consumed.where("state = 'done'")
    matched = keep(
        messages.select(
            F.xxhash64("msg_id").alias("mh"),
            F.xxhash64("key").alias("kh"),
            "topic",
            F.col("store_ts").alias("at"),
            _tokens(messages).alias("token"),
        )
        .select("mh", "kh", "topic", "at", *[h.alias(f"t{i}") for i, h in enumerate(_h("token"))])
        .join(
            done.select(
                F.col("consumer_group").alias("group"),
                *[h.alias(f"t{i}") for i, h in enumerate(_h("key"))],
            ),
            ["t0", "t1"],
        )
        .select("mh", "kh", "t0", "group", "topic", "at")
    )
    if expect is None:
        pairs = {(r[0], r[1]) for r in matched.select("group", "topic").distinct().collect()}
    else:
        pairs = set(expect)
    expected = sorted(pairs)
    bit = {g: 1 << i for i, g in enumerate(sorted({g for g, _ in pairs}))}
    if len(bit) > 62:
        raise ValueError(f"at most 62 expected consumer groups, not {len(bit)}")
    need: dict[str, int] = {}
    for g, t in pairs:
        need[t] = need.get(t, 0) | bit[g]

    # one row per message: stored? dead-lettered? an outbox row? which expected groups
    # consumed it?  Only the ones with something wrong are kept.
    zero = F.lit(0)

    def msg_rows(df: DataFrame, **cols: Column) -> DataFrame:
        base = {
            "mh": F.xxhash64("msg_id"),
            "at": null_long,
            "need": zero.cast("long"),
            "got": zero.cast("long"),
            "stored": zero,
            "dlq": zero,
            "outbox_at": null_long,
        }
        return df.select(*[c.alias(n) for n, c in (base | cols).items()])

    outbox_rows = counted(
        msg_rows(outbox, outbox_at=F.unix_millis("created_at")),
        "outbox_rows",
        window(F.col("outbox_at")),
    )
    per_msg = (
        msg_rows(
            messages,
            at=F.col("store_ts"),
            need=_map(F.col("topic"), need, 0).cast("long"),
            stored=F.lit(1),
        )
        .unionByName(
            matched.select(
                "mh",
                null_long.alias("at"),
                zero.cast("long").alias("need"),
                _map(F.col("group"), bit, 0).cast("long").alias("got"),
                zero.alias("stored"),
                zero.alias("dlq"),
                null_long.alias("outbox_at"),
            )
        )
        .unionByName(msg_rows(store.where(F.col("kind") == "dlq"), dlq=F.lit(1)))
        .unionByName(outbox_rows)
        .groupBy("mh")
        .agg(
            F.min("at").alias("at"),
            F.max("need").alias("need"),
            F.bit_or("got").alias("got"),
            F.max("stored").alias("stored"),
            F.max("dlq").alias("dlq"),
            F.min("outbox_at").alias("outbox_at"),
        )
    )
    stored_in_window = (F.col("stored") == 1) & window(F.col("at"))
    per_msg = counted(per_msg, "messages", stored_in_window)
    missing = F.col("need").bitwiseAND(F.bitwise_not("got"))
    is_late = stored_in_window & (F.col("at") < cutoff) & (F.col("dlq") == 0) & (missing != 0)
    never_sent = (
        (F.col("stored") == 0)
        & F.col("outbox_at").isNotNull()
        & window(F.col("outbox_at"))
        & (F.col("outbox_at") < cutoff)
    )
    flagged = keep(per_msg.where(is_late | never_sent))
    late = flagged.where(is_late).select(
        "mh",
        "at",
        F.explode(
            F.filter(
                F.array(*[F.when(missing.bitwiseAND(b) != 0, F.lit(g)) for g, b in bit.items()]),
                lambda g: g.isNotNull(),
            )
            if bit
            else F.array().cast("array<string>")
        ).alias("group"),
    )
    msg_attrs = _first(
        messages.select(F.xxhash64("msg_id").alias("mh"), "msg_id", "topic", "key").join(
            F.broadcast(late.select("mh").distinct()), "mh", "left_semi"
        ),
        "mh",
        [F.col("msg_id")],
    )
    unconsumed = _shape(
        late.join(msg_attrs, "mh"),
        "unconsumed",
        **_message_cols(
            broker_state=F.lit("COMMITTED"), detail=F.lit("no consumed key after the SLA")
        ),
    )
    lost_outbox = outbox.withColumn("mh", F.xxhash64("msg_id")).join(
        F.broadcast(flagged.where(never_sent).select("mh")), "mh", "left_semi"
    )
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

    # -- duplicates: an event applied by a group under more than one consumed key -----------
    twice = keep(
        matched.where(window(F.col("at")))
        .groupBy("group", "kh")
        .agg(F.min("t0").alias("lo"), F.max("t0").alias("hi"))
        .where(F.col("lo") != F.col("hi"))
        .select("group", "kh")
    )
    # their strings: the messages of those events and the consumed keys that matched them
    dup_msgs = messages.withColumn("kh", F.xxhash64("key")).join(
        F.broadcast(twice.select("kh").distinct()), "kh", "left_semi"
    )
    dup_tokens = keep(
        dup_msgs.select(
            "kh",
            "msg_id",
            "topic",
            "key",
            F.col("store_ts").alias("at"),
            _tokens(dup_msgs).alias("token"),
        ).where(window(F.col("at")))
    )
    dup_done = _restrict(done, "key", dup_tokens.select("token")).select(
        F.col("consumer_group").alias("group"), F.col("key").alias("token"), "db"
    )
    applied = (
        dup_tokens.join(F.broadcast(dup_done), "token")
        .join(F.broadcast(twice), ["group", "kh"], "left_semi")
        .groupBy("group", "key")
        .agg(
            F.countDistinct("token").alias("n"),
            F.sort_array(F.collect_set("token")).alias("tokens"),
            F.min("msg_id").alias("msg_id"),
            F.first("topic").alias("topic"),
            F.min("at").alias("at"),
            F.first("db").alias("db"),
        )
        .where("n > 1")  # not two keys that share a hash
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

    # -- dead letters and retries (few rows) ------------------------------------------------
    letters = keep(
        store.where((F.col("kind") == "dlq") & window(F.col("store_ts")))
        .groupBy("group", "msg_id")
        .agg(
            F.first("topic").alias("topic"),
            F.first("key").alias("key"),
            F.max("reconsume_times").alias("times"),
            F.max("store_ts").alias("at"),
        )
        .withColumn("mh", F.xxhash64("msg_id"))
    )
    # consumed since by a group that expects its topic (the original topic is on the copy)
    expected_df = spark.createDataFrame(expected, "group string, topic string")
    consumed_since = (
        matched.join(F.broadcast(letters.select("mh").distinct()), "mh", "left_semi")
        .join(F.broadcast(expected_df), ["group", "topic"], "left_semi")
        .select("mh")
    )
    dead = letters.join(consumed_since, "mh", "left_anti")
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
    retry = keep(
        store.where(F.col("kind") == "retry")
        .select("group", "msg_id", F.xxhash64("msg_id").alias("mh"))
        .distinct()
    )
    retrying = retry.join(
        matched.join(F.broadcast(retry.select("mh")), "mh", "left_semi").select("mh"),
        "mh",
        "left_anti",
    )
    retrying = counted(retrying, "retrying", F.lit(True))
    retrying.collect()
    anomalies = {
        "lost": lost,
        "phantom": phantom,
        "unconsumed": unconsumed,
        "duplicate": duplicate,
        "parked": parked,
        "dead_lettered": dead_lettered,
    }
    return anomalies, Facts(observations, expected), cached
