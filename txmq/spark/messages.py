"""The message side: committed messages, outbox rows, dead-letter and retry copies and the
consumed keys, reduced to the few that need a person.

A message is matched to a consumer group's ``done`` consumed keys by its id or any of its
keys (``txmq.idempotent``'s key functions may pick either).  The consumed keys are hashed
(xxhash64 and murmur3 of the key: 96 bits, so a false match needs both to collide) and
broadcast once (when they fit in the driver's memory); every message probes them with its
id, its first key and any further keys, without a shuffle.  Then one shuffle groups two
kinds of rows at once:

* per message (``part`` 0, by the id's hash): stored? dead-lettered by which expected
  groups? waiting in a retry topic? its outbox row? which expected groups consumed it, by
  a consumed key, or by their committed offsets (:mod:`txmq.spark.offsets`: the message
  below the group's offset for its queue, and no retry copy of it above the group's offset
  in ``%RETRY%<group>``)?
  Message ids are unique in a cluster: the copies of one message on several broker sets
  (a send retried on another) are one message, consumed when any copy is.
* per dead letter (``part`` 2, by the id's hash and the group's): has the group that gave
  up on the message consumed it since?
* per event and group (``part`` 1, by the first key's hash): the smallest and largest
  consumed token, so an event applied under two keys shows as two different tokens.  Only
  messages that can take part in a duplicate add these rows: those consumed by their id
  while having a key, and those with more than one key (a message consumed only by its
  first key adds the one token every message of its event has).

Every aggregate buffer is numeric, so Spark keeps to hash aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from txmq.protocol.message import retry_topic
from txmq.spark.common import Run, local_frame, mapped

__all__ = [
    "FLAGGED",
    "MAX_GROUPS",
    "REASONS",
    "broker_group",
    "consumed_hashes",
    "flags",
    "pairs",
    "reason",
]

#: expected consumer groups are bits of a long
MAX_GROUPS = 62
_TOKEN = "c0"


#: up to this many consumer groups are told apart by a CASE expression, not a join
_FEW_GROUPS = 64


def consumed_hashes(
    consumed: DataFrame, groups: DataFrame | Mapping[str, tuple[int, int]], broadcast: bool
) -> DataFrame:
    """The ``done`` consumed keys as ``c0``/``c1`` (the key's two hashes), ``gi`` (the group's
    index) and ``gbit`` (its bit if it is an expected group, else 0), from ``groups``
    (``consumer_group``, ``gi``, ``gbit``: a few rows; or group -> (``gi``, ``gbit``)): the
    keys of other groups are left out.  ``broadcast``: the messages probe them where they
    are (else both sides are shuffled by token, once for ids and once for keys: slower, but
    the keys need not fit in the driver's memory)."""
    done = consumed.where(F.col("state") == "done")
    hashes = [F.xxhash64("key").alias("c0"), F.hash("key").alias("c1")]
    if isinstance(groups, Mapping) and len(groups) <= _FEW_GROUPS:
        # an expression, not a join: consumed keys read on the driver stay a local relation,
        # which Spark broadcasts without a job of its own
        group = F.col("consumer_group")
        gi = mapped(group, {g: i for g, (i, _) in groups.items()}).cast("int")
        gbit = mapped(group, {g: b for g, (_, b) in groups.items()}, 0).cast("long")
        keys = done.where(group.isin(list(groups))).select(
            *hashes, gi.alias("gi"), gbit.alias("gbit")
        )
    else:
        if isinstance(groups, Mapping):
            groups = local_frame(
                done.sparkSession,
                [(g, i, b) for g, (i, b) in groups.items()],
                "consumer_group string, gi int, gbit long",
            )
        keys = done.join(F.broadcast(groups), "consumer_group").select(*hashes, "gi", "gbit")
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
        "group",
        "broker",
        "store_ts",
        "msg_id",
        "key",
        "queue_id",
        "queue_offset",
        F.xxhash64("msg_id").alias("mh"),
        F.xxhash64("key").alias("kh"),
        multi.alias("multi"),
    ).withColumn("keyed", (F.col("kh") != F.col("mh")))  # a first key other than the id
    main = _probe(_probe(main, keys, "m", "msg_id", "mh"), keys, "k", "key", "kh")
    extra = rows.where(multi).select(
        "kind",
        "topic",
        "group",
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


def broker_group(group: str) -> str:
    """The broker's consumer group whose consumed keys ``group`` names: ``group`` up to its
    first ``/`` (a broker group's name has none): ``billing`` for ``billing``, and for the
    ``inventory-service/order-created`` of the orders example, ``inventory-service``."""
    return group.split("/", 1)[0]


#: a message's facts, OR-ed together by the grouping
_STORED, _HIT, _RETRY = 1, 2, 4


def _passed(main: DataFrame, marks: DataFrame | None) -> DataFrame:
    """``main`` with ``opass`` (a message's row: the bits of the expected groups whose
    committed offset for its queue passed it) and ``waiting`` (a retry copy's row: its
    group's committed offset in ``%RETRY%<group>`` has not passed it), from ``marks``
    (:func:`txmq.spark.offsets.marks`: a few rows, broadcast)."""
    kind = F.col("kind")
    zero = F.lit(0).cast("long")
    if marks is None:
        return main.withColumn("opass", zero).withColumn("waiting", kind == "retry")
    qtopic = F.when(kind == "message", F.col("topic")).when(
        kind == "retry", F.concat(F.lit(retry_topic("")), F.col("group"))
    )
    joined = main.withColumn("qtopic", qtopic).join(
        F.broadcast(marks), ["broker", "qtopic", "queue_id"], "left"
    )

    def below(x: Column) -> Column:
        return F.col("queue_offset") < x["offset"]

    opass = F.aggregate(
        "marks", zero, lambda acc, x: acc.bitwiseOR(F.when(below(x), x["bits"]).otherwise(zero))
    )
    done = F.exists("marks", lambda x: (x["bgroup"] == F.col("group")) & below(x))
    return joined.select(
        *main.columns,
        F.when(kind == "message", F.coalesce(opass, zero)).otherwise(zero).alias("opass"),
        ((kind == "retry") & ~F.coalesce(done, F.lit(False))).alias("waiting"),
    )


def flags(
    run: Run,
    store: DataFrame,
    outbox: DataFrame,
    keys: DataFrame,
    need: Mapping[str, int],
    db_index: Column,
    bits: Mapping[str, int],
    groups: Sequence[str],
    marks: DataFrame | None = None,
) -> DataFrame:
    """The messages and events with something wrong, in one pass (see the module docstring).

    ``need``: topic -> the bits of the groups expected to consume it.  ``db_index``: the
    outbox row's database as a small int (``oref`` is ``db_index << 48 | id``).  ``bits``:
    expected group -> its bit; ``groups``: the consumer groups by index (``gi``).  A dead
    letter of broker group B is matched to the consumed keys of the groups that name B
    (:func:`broker_group`), and so are B's committed offsets (``marks``, see
    :func:`txmq.spark.offsets.marks`; None: no store has any).

    Rows of ``part`` 0 (``k`` the message id's hash) say ``late`` (unconsumed: ``missing``
    bits, without the groups that dead-lettered it), ``never_sent`` (an outbox row the broker
    does not have: ``oref``), or ``retrying`` (waiting in a retry topic, its group's offset
    there short of it, and consumed by nobody's key);
    rows of ``part`` 1 (``k`` the event's hash, ``g`` the group's index) are events a group
    applied under two tokens or more; rows of ``part`` 2 (``k`` the message id's hash, ``g``
    the hash of a group's name) say ``dead``: the group dead-lettered the message and has not
    consumed it since."""
    null_long = F.lit(None).cast("long")
    null_int = F.lit(None).cast("int")
    zero = F.lit(0)
    main, extra = _probed(store, keys, ("message", "dlq", "retry"))
    main = _passed(main, marks)
    kind = F.col("kind")
    is_msg = kind == "message"
    is_dlq = kind == "dlq"
    in_window = run.window(F.col("store_ts"))
    # a dead letter's ``group`` is the consumer group that gave up on it: the bits of the
    # expected groups that are its consumed keys', and whether a consumed key is its
    gave_up_bits: dict[str, int] = {}
    for g, b in bits.items():
        gave_up_bits[broker_group(g)] = gave_up_bits.get(broker_group(g), 0) | b
    gave_up = F.when(is_dlq, mapped(F.col("group"), gave_up_bits, 0)).otherwise(0).cast("long")
    # a retry copy its group has not passed yet: the expected groups of that broker group
    # have not consumed the message by their offsets (whatever the original's offset says)
    waiting = F.col("waiting")
    pending = F.when(waiting, mapped(F.col("group"), gave_up_bits, 0)).otherwise(0).cast("long")
    owners = {i: broker_group(g) for i, g in enumerate(groups)}

    def its_own(gi: Column) -> Column:
        """The consumed key's group (index ``gi``) is the dead letter's group's."""
        return mapped(gi, owners) == F.col("group")

    def facts(got: Column, hit: Column, own: bool) -> dict[str, Column]:
        """The columns every row adds to its message (``own``: a row of the message itself,
        else only what a further key matched)."""
        f = F.when(hit, _HIT).otherwise(0)
        if own:
            f = f.bitwiseOR(F.when(is_msg, _STORED).otherwise(0)).bitwiseOR(
                F.when(waiting, _RETRY).otherwise(0)
            )
        return {
            "flags": f,
            "at": F.when(is_msg, F.col("store_ts")) if own else null_long,
            # the broker set that stored the message (a hash): two of them, two sets
            "bh": F.when(is_msg, F.hash("broker")) if own else null_int,
            "need": (
                F.when(is_msg, mapped(F.col("topic"), need, 0)).otherwise(0) if own else zero
            ).cast("long"),
            "got": got,
            "gave_up": gave_up if own else zero.cast("long"),
            "opass": F.col("opass") if own else zero.cast("long"),
            "rpend": pending if own else zero.cast("long"),
            "outbox_at": null_long,
            "oref": null_long,
        }

    def dead_letter(hit: Column) -> dict[str, Column]:
        """The columns of a dead letter's row (``part`` 2): ``hit``, its group consumed it."""
        return {
            "flags": F.when(hit, _HIT).otherwise(0),
            "at": F.col("store_ts"),
            "bh": null_int,
            "need": zero.cast("long"),
            "got": zero.cast("long"),
            "gave_up": zero.cast("long"),
            "opass": zero.cast("long"),
            "rpend": zero.cast("long"),
            "outbox_at": null_long,
            "oref": null_long,
        }

    def either(letter: Column, cols: dict[str, Column], other: dict[str, Column]) -> list[Column]:
        """``cols`` where ``letter`` holds, else ``other``, by name."""
        return [F.when(letter, c).otherwise(other[n]).alias(n) for n, c in cols.items()]

    # a row of the message itself (pos 0); for the messages that may take part in a
    # duplicate, a token row for its id (1) and its first key (2); for a dead letter of the
    # window, a row of it and its group (3)
    dup_source = (
        is_msg
        & in_window
        & ((F.col("gm").isNotNull() & F.col("keyed")) | (F.col("multi") & F.col("gk").isNotNull()))
    )
    pos = F.col("pos")
    own = facts(
        F.col("bm").bitwiseOR(F.col("bk")),
        F.col("gm").isNotNull() | F.col("gk").isNotNull(),
        own=True,
    )
    consumed_by_its_group = F.coalesce(its_own(F.col("gm")) | its_own(F.col("gk")), F.lit(False))
    message_rows = (
        main.select(
            "*",
            F.explode(
                F.when(dup_source, F.array(*map(F.lit, (0, 1, 2))))
                .when(is_dlq & in_window, F.array(F.lit(0), F.lit(3)))
                .otherwise(F.array(F.lit(0)))
            ).alias("pos"),
        )
        .select(
            F.when(pos == 0, 0).when(pos == 3, 2).otherwise(1).alias("part"),
            F.when(pos.isin(1, 2), F.col("kh")).otherwise(F.col("mh")).alias("k"),
            F.when(pos == 0, -1)
            .when(pos == 1, F.col("gm"))
            .when(pos == 2, F.col("gk"))
            .otherwise(F.hash("group"))
            .alias("g"),
            F.when(pos == 1, F.col("mh")).when(pos == 2, F.col("kh")).alias("tok"),
            *either(pos == 3, dead_letter(consumed_by_its_group), own),
        )
        .where((F.col("part") == 0) | F.col("g").isNotNull())
    )
    # a further key: what it matched (pos 0); a token row for a message that may take part
    # in a duplicate (1); for a dead letter of the window its group consumed by this key, a
    # row of it and its group (2)
    extra_rows = extra.select(
        F.explode(
            F.when(is_msg & in_window & F.col("gx").isNotNull(), F.array(F.lit(0), F.lit(1)))
            .when(is_dlq & in_window & its_own(F.col("gx")), F.array(F.lit(0), F.lit(2)))
            .otherwise(F.array(F.lit(0)))
        ).alias("pos"),
        "*",
    ).select(
        F.when(pos == 0, 0).when(pos == 2, 2).otherwise(1).alias("part"),
        F.when(pos == 1, F.col("kh")).otherwise(F.col("mh")).alias("k"),
        F.when(pos == 0, -1).when(pos == 1, F.col("gx")).otherwise(F.hash("group")).alias("g"),
        F.when(pos == 1, F.col("xh")).alias("tok"),
        *either(
            pos == 2,
            dead_letter(F.lit(True)),
            facts(F.col("bx"), F.col("gx").isNotNull(), own=False),
        ),
    )
    outbox_rows = outbox.select(
        F.lit(0).alias("part"),
        F.xxhash64("msg_id").alias("k"),
        F.lit(-1).alias("g"),
        null_long.alias("tok"),
        zero.alias("flags"),
        null_long.alias("at"),
        null_int.alias("bh"),
        zero.cast("long").alias("need"),
        zero.cast("long").alias("got"),
        zero.cast("long").alias("gave_up"),
        zero.cast("long").alias("opass"),
        zero.cast("long").alias("rpend"),
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
            F.min("bh").alias("blo"),
            F.max("bh").alias("bhi"),
            F.bit_or("need").alias("need"),
            F.bit_or("got").alias("got"),
            F.bit_or("gave_up").alias("gave_up"),
            F.bit_or("opass").alias("opass"),
            F.bit_or("rpend").alias("rpend"),
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
    grouped = run.counted(
        grouped, "multi_stored", stored_in_window & (F.col("blo") != F.col("bhi"))
    )
    # the expected groups that neither consumed the message (by a consumed key, or by their
    # committed offsets with no retry copy still waiting) nor dead-lettered it
    by_offsets = F.col("opass").bitwiseAND(F.bitwise_not(F.col("rpend")))
    done = F.col("got").bitwiseOR(F.col("gave_up")).bitwiseOR(by_offsets)
    missing = F.col("need").bitwiseAND(F.bitwise_not(done))
    late = stored_in_window & (F.col("at") < run.cutoff) & (missing != 0)
    never_sent = (
        own_row
        & ~has(_STORED)
        & F.col("outbox_at").isNotNull()
        & run.window(F.col("outbox_at"))
        & (F.col("outbox_at") < run.cutoff)
    )
    dead = (F.col("part") == 2) & ~has(_HIT)
    retrying = own_row & has(_RETRY) & ~has(_HIT)
    twice = (F.col("part") == 1) & (F.col("lo") != F.col("hi"))
    grouped = run.counted(grouped, "retrying", retrying)
    flagged = grouped.where(late | never_sent | dead | retrying | twice).select(
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
    # how many of each reason (spark.details.reason), and the (message, group) pairs late
    why = reason()
    one = F.lit(1)
    return run.keep(
        run.observe(
            flagged,
            FLAGGED,
            **{str(r): F.sum(F.when(why == r, one).otherwise(0)) for r in REASONS},
            none=F.sum(F.when(why.isNull(), one).otherwise(0)),
            pairs=F.sum(F.when(why == "late", F.bit_count("missing"))),
        )
    )


#: the reasons a flagged row is there for (:func:`reason`), but retrying
REASONS = ("late", "never_sent", "dead", "twice")
#: the name of the metrics of the flagged rows (:meth:`Run.observe`): a count per reason
#: (``none``: retrying only) and ``pairs``, the late rows' (message, group) pairs
FLAGGED = "flagged"


def reason() -> Column:
    """Why a flagged row (of :func:`flags`) is there: one of :data:`REASONS`, in that order
    (null: it is retrying, and only that)."""
    return (
        F.when(F.col("late"), "late")
        .when(F.col("never_sent"), "never_sent")
        .when(F.col("dead"), "dead")
        .when(F.col("part") == 1, "twice")
    )
