"""The message side: committed messages, outbox rows, dead-letter and retry copies and the
consumed keys, reduced to the few that need a person.

A message is matched to a consumer group's ``done`` consumed keys by its id or any of its
keys (``txmq.idempotent``'s key functions may pick either).  The consumed keys are hashed
(xxhash64 and murmur3 of the key: 96 bits, so a false match needs both to collide) and
broadcast once (when they fit in the driver's memory); every message probes them with its
id, its first key and any further keys, without a shuffle.  Then one shuffle groups two
kinds of rows at once:

* per message (``part`` 0, by the id's hash): stored? dead-lettered? waiting in a retry
  topic? its outbox row? which expected groups consumed it?
* per event and group (``part`` 1, by the first key's hash): the smallest and largest
  consumed token, so an event applied under two keys shows as two different tokens.  Only
  messages that can take part in a duplicate add these rows: those consumed by their id
  while having a key, and those with more than one key (a message consumed only by its
  first key adds the one token every message of its event has).

Every aggregate buffer is numeric, so Spark keeps to hash aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from txmq.spark.common import Run, mapped

__all__ = ["MAX_GROUPS", "consumed_hashes", "flags", "pairs"]

#: expected consumer groups are bits of a long
MAX_GROUPS = 62
_TOKEN = "c0"


def consumed_hashes(consumed: DataFrame, groups: DataFrame, broadcast: bool) -> DataFrame:
    """The ``done`` consumed keys as ``c0``/``c1`` (the key's two hashes), ``gi`` (the group's
    index) and ``gbit`` (its bit if it is an expected group, else 0), from ``groups``
    (``consumer_group``, ``gi``, ``gbit``: a few rows).  ``broadcast``: the messages probe
    them where they are (else both sides are shuffled by token, once for ids and once for
    keys: slower, but the keys need not fit in the driver's memory)."""
    keys = (
        consumed.where(F.col("state") == "done")
        .join(F.broadcast(groups), "consumer_group")
        .select(F.xxhash64("key").alias("c0"), F.hash("key").alias("c1"), "gi", "gbit")
    )
    return F.broadcast(keys) if broadcast else keys


def _probe(rows: DataFrame, keys: DataFrame, side: str, token: str, h0: str) -> DataFrame:
    """``rows`` with the groups that consumed ``token`` (a string column whose xxhash64 is
    ``h0``): ``g<side>`` the group's index (null: none), ``b<side>`` its bit (0: none or not
    expected).  A token consumed by several groups gives a row for each."""
    t = keys.alias(side)
    return rows.join(
        t,
        (F.col(h0) == F.col(f"{side}.c0"))
        # the second hash as a condition, not a key: the lookup stays long-keyed, and the
        # second hash is computed for the matches only
        & (F.hash(token).bitwiseXOR(F.col(f"{side}.c1")) == 0),
        "left",
    ).select(
        rows["*"],
        F.col(f"{side}.gi").alias(f"g{side}"),
        F.coalesce(F.col(f"{side}.gbit"), F.lit(0).cast("long")).alias(f"b{side}"),
    )


def _probed(
    store: DataFrame, keys: DataFrame, kinds: tuple[str, ...]
) -> tuple[DataFrame, DataFrame]:
    """The store's rows of ``kinds`` with the consumed keys their id (``gm``, ``bm``) and
    their first key (``gk``, ``bk``) matched; and, for the few with more than one key, a row
    per further key (``xh`` its hash) with the keys it matched (``gx``, ``bx``)."""
    rows = store.where(F.col("kind").isin(*kinds))
    multi = F.col("nkeys") > 1
    main = rows.select(
        "kind",
        "topic",
        "store_ts",
        "msg_id",
        "key",
        F.xxhash64("msg_id").alias("mh"),
        F.xxhash64("key").alias("kh"),
        multi.alias("multi"),
    ).withColumn("keyed", (F.col("kh") != F.col("mh")))  # a first key other than the id
    main = _probe(_probe(main, keys, "m", "msg_id", "mh"), keys, "k", "key", "kh")
    extra = rows.where(multi).select(
        "kind",
        "topic",
        "store_ts",
        F.xxhash64("msg_id").alias("mh"),
        F.xxhash64("key").alias("kh"),
        F.explode(F.slice(F.split("keys", " "), 2, 1 << 16)).alias("x"),
    )
    extra = _probe(extra.withColumn("xh", F.xxhash64("x")), keys, "x", "x", "xh")
    return main, extra


def pairs(store: DataFrame, keys: DataFrame) -> DataFrame:
    """(``topic``, ``gi``): each group that consumed at least one message of each topic."""
    main, extra = _probed(store, keys, ("message",))
    return (
        main.select("topic", F.explode(F.array("gm", "gk")).alias("gi"))
        .unionByName(extra.select("topic", F.col("gx").alias("gi")))
        .where(F.col("gi").isNotNull())
        .distinct()
    )


#: a message's facts, OR-ed together by the grouping
_STORED, _HIT, _DLQ, _DLQ_WIN, _RETRY = 1, 2, 4, 8, 16


def flags(
    run: Run,
    store: DataFrame,
    outbox: DataFrame,
    keys: DataFrame,
    need: Mapping[str, int],
    db_index: Column,
) -> DataFrame:
    """The messages and events with something wrong, in one pass (see the module docstring).

    ``need``: topic -> the bits of the groups expected to consume it.  ``db_index``: the
    outbox row's database as a small int (``oref`` is ``db_index << 48 | id``).

    Rows of ``part`` 0 (``k`` the message id's hash) say ``late`` (unconsumed: ``missing``
    bits), ``never_sent`` (an outbox row the broker does not have: ``oref``) or ``dead``
    (dead-lettered, consumed by no expected group since), or ``retrying`` (waiting in a retry
    topic, consumed by nobody); rows of ``part`` 1 (``k`` the event's hash, ``g`` the group's
    index) are events a group applied under two tokens or more."""
    null_long = F.lit(None).cast("long")
    zero = F.lit(0)
    main, extra = _probed(store, keys, ("message", "dlq", "retry"))
    kind = F.col("kind")
    is_msg = kind == "message"
    in_window = run.window(F.col("store_ts"))

    def facts(got: Column, hit: Column, own: bool) -> list[Column]:
        """The columns every row adds to its message (``own``: a row of the message itself,
        else only what a further key matched)."""
        f = F.when(hit, _HIT).otherwise(0)
        if own:
            f = (
                f.bitwiseOR(F.when(is_msg, _STORED).otherwise(0))
                .bitwiseOR(F.when(kind == "dlq", _DLQ).otherwise(0))
                .bitwiseOR(F.when((kind == "dlq") & in_window, _DLQ_WIN).otherwise(0))
                .bitwiseOR(F.when(kind == "retry", _RETRY).otherwise(0))
            )
        return [
            f.alias("flags"),
            (F.when(is_msg, F.col("store_ts")) if own else null_long).alias("at"),
            (
                F.when(is_msg | (kind == "dlq"), mapped(F.col("topic"), need, 0)).otherwise(0)
                if own
                else zero
            )
            .cast("long")
            .alias("need"),
            got.alias("got"),
            null_long.alias("outbox_at"),
            null_long.alias("oref"),
        ]

    # a row of the message itself (pos 0), and for the messages that may take part in a
    # duplicate, a token row for its id (1) and its first key (2)
    dup_source = (
        is_msg
        & in_window
        & ((F.col("gm").isNotNull() & F.col("keyed")) | (F.col("multi") & F.col("gk").isNotNull()))
    )
    pos = F.col("pos")
    message_rows = (
        main.select(
            "*",
            F.posexplode(
                F.when(dup_source, F.array(*map(F.lit, (0, 1, 2)))).otherwise(F.array(F.lit(0)))
            ).alias("pos", "_"),
        )
        .select(
            F.when(pos == 0, 0).otherwise(1).alias("part"),
            F.when(pos == 0, F.col("mh")).otherwise(F.col("kh")).alias("k"),
            F.when(pos == 0, -1).when(pos == 1, F.col("gm")).otherwise(F.col("gk")).alias("g"),
            F.when(pos == 1, F.col("mh")).when(pos == 2, F.col("kh")).alias("tok"),
            *facts(
                F.col("bm").bitwiseOR(F.col("bk")),
                F.col("gm").isNotNull() | F.col("gk").isNotNull(),
                own=True,
            ),
        )
        .where((F.col("part") == 0) | F.col("g").isNotNull())
    )
    extra_rows = extra.select(
        F.posexplode(
            F.when(
                is_msg & in_window & F.col("gx").isNotNull(), F.array(F.lit(0), F.lit(1))
            ).otherwise(F.array(F.lit(0)))
        ).alias("pos", "_"),
        "*",
    ).select(
        F.when(pos == 0, 0).otherwise(1).alias("part"),
        F.when(pos == 0, F.col("mh")).otherwise(F.col("kh")).alias("k"),
        F.when(pos == 0, -1).otherwise(F.col("gx")).alias("g"),
        F.when(pos == 1, F.col("xh")).alias("tok"),
        *facts(F.col("bx"), F.col("gx").isNotNull(), own=False),
    )
    outbox_rows = outbox.select(
        F.lit(0).alias("part"),
        F.xxhash64("msg_id").alias("k"),
        F.lit(-1).alias("g"),
        null_long.alias("tok"),
        zero.alias("flags"),
        null_long.alias("at"),
        zero.cast("long").alias("need"),
        zero.cast("long").alias("got"),
        F.col("created_ms").alias("outbox_at"),
        F.shiftleft(db_index.cast("long"), 48).bitwiseOR(F.col("id")).alias("oref"),
    )
    outbox_rows = run.counted(outbox_rows, "outbox_rows", run.window(F.col("outbox_at")))
    grouped = (
        message_rows.unionByName(extra_rows)
        .unionByName(outbox_rows)
        # one row per key: a partial aggregation before the shuffle would only cost
        .repartition("k")
        .groupBy("part", "k", "g")
        .agg(
            F.bit_or("flags").alias("flags"),
            F.min("at").alias("at"),
            F.bit_or("need").alias("need"),
            F.bit_or("got").alias("got"),
            F.min("outbox_at").alias("outbox_at"),
            F.min("oref").alias("oref"),
            F.min("tok").alias("lo"),
            F.max("tok").alias("hi"),
        )
    )

    def has(flag: int) -> Column:
        return F.col("flags").bitwiseAND(flag) != 0

    own_row = F.col("part") == 0
    stored_in_window = own_row & has(_STORED) & run.window(F.col("at"))
    grouped = run.counted(grouped, "messages", stored_in_window)
    missing = F.col("need").bitwiseAND(F.bitwise_not("got"))
    late = stored_in_window & (F.col("at") < run.cutoff) & ~has(_DLQ) & (missing != 0)
    never_sent = (
        own_row
        & ~has(_STORED)
        & F.col("outbox_at").isNotNull()
        & run.window(F.col("outbox_at"))
        & (F.col("outbox_at") < run.cutoff)
    )
    dead = own_row & has(_DLQ_WIN) & (F.col("got").bitwiseAND(F.col("need")) == 0)
    retrying = own_row & has(_RETRY) & ~has(_HIT)
    twice = (F.col("part") == 1) & (F.col("lo") != F.col("hi"))
    return run.keep(
        grouped.where(late | never_sent | dead | retrying | twice).select(
            "part",
            "k",
            "g",
            "at",
            "oref",
            missing.alias("missing"),
            late.alias("late"),
            never_sent.alias("never_sent"),
            dead.alias("dead"),
            retrying.alias("retrying"),
        )
    )
