"""The anomaly rows (:data:`COLUMNS`), with the strings of the few transactions and
messages the passes flagged (the passes carry hashes and offsets).

The broker's strings come from one scan of the stores that keeps only the wanted rows (three
broadcast lookups: by half (broker set and offset), message id hash and event hash); the
``broker`` column of a row about stored messages names the broker sets that hold them
(comma-separated: a message a retried send stored on two broker sets is one message); the
databases' strings
from their primary keys, a query per chunk of keys (:meth:`spark.sources.Database.fetch`).
What is left is small, so it is collected (as Arrow) and put together here, on the driver,
with pandas: a Spark job per small join would cost more than the joins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from txmq.spark.common import Run, local_frame, ms
from txmq.spark.messages import FLAGGED, reason
from txmq.spark.sources import TABLES, Database
from txmq.spark.transactions import CANDIDATES, LOCAL_COMMITTED, RANK

__all__ = ["COLUMNS", "SCHEMA", "Anomalies", "anomalies"]

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
    "broker",
)
#: an anomaly table's Arrow schema (every column a string, but ``at``)
SCHEMA = pa.schema(
    [(c, pa.timestamp("us", tz="UTC") if c == "at" else pa.string()) for c in COLUMNS[1:]]
)
#: an unconsumed row's detail, by the evidence its group's consumption was judged on
_UNCONSUMED = {
    "consumed keys": "no consumed key after the SLA",
    "committed offsets": "not passed by the group's committed offset after the SLA",
    "both": "no consumed key, and not passed by the group's committed offset, after the SLA",
    "none": "the group has neither consumed keys nor committed offsets: no evidence it "
    "consumed anything",
}
_OREF_BITS = 48
_ID_MASK = (1 << _OREF_BITS) - 1
_NULLABLE = {
    pa.int64(): pd.Int64Dtype(),
    pa.int32(): pd.Int32Dtype(),
    pa.bool_(): pd.BooleanDtype(),
}


def _pandas(df: DataFrame) -> pd.DataFrame:
    """A small DataFrame on the driver (integers stay integers, nulls and all)."""
    return df.toArrow().to_pandas(types_mapper=_NULLABLE.get)


def _fetched(
    dbs: Sequence[Database], kind: str, where: dict[str, Sequence[Any]], extra: str = ""
) -> pd.DataFrame:
    rows = [r for db in dbs for r in db.fetch(kind, where, extra)]
    return pd.DataFrame(rows, columns=[*TABLES[kind].names, "db"])


def _ts(ms: pd.Series) -> pd.Series:
    return pd.to_datetime(ms.astype("float64"), unit="ms", utc=True)


def _shape(df: pd.DataFrame, anomaly: str, **cols: Any) -> pd.DataFrame:
    """The rows of ``df`` as anomaly rows: ``cols`` (Series or scalars) by column name."""
    out = pd.DataFrame(index=df.index)
    for name in COLUMNS:
        if name == "anomaly":
            out[name] = anomaly
        elif name == "at":
            out[name] = pd.to_datetime(cols[name], utc=True) if name in cols else pd.NaT
        else:
            value = cols.get(name)
            out[name] = (
                value.astype(object).where(value.notna(), None)
                if isinstance(value, pd.Series)
                else value
            )
    return out.reset_index(drop=True)


def _about_messages(df: pd.DataFrame, anomaly: str, **more: Any) -> pd.DataFrame:
    """Anomaly rows about one message each: ``df``'s group, id, topic, key and time (ms),
    and ``more``."""
    cols = {n: df[n] for n in ("group", "msg_id", "topic", "key")}
    return _shape(df, anomaly, **cols, at=_ts(df["at"]), **more)


def _in_window(run: Run, at_ms: pd.Series) -> pd.Series:
    """``at_ms`` is inside the run's window (:meth:`spark.common.Run.window`, in pandas)."""
    ok = pd.Series(True, index=at_ms.index)
    if run.since is not None:
        ok &= at_ms >= ms(run.since)
    if run.until is not None:
        ok &= at_ms < ms(run.until)
    return ok.fillna(False).astype(bool)


#: up to this many values, a lookup of :func:`_wanted` is a list of literals, not a join
#: (each literal is a call into the JVM: 10,000 of them took 5 s)
_INLINE = 64
#: the columns of the store's rows the anomalies' rows are made of
_FOUND = ("kind", "topic", "group", "msg_id", "key", "keys", "store_ts", "reconsume_times")


def _wanted(run: Run, store: DataFrame, flags: pd.DataFrame) -> pd.DataFrame:
    """The store rows the anomalies need the strings of (the halves' come with the
    candidates, :func:`spark.transactions.candidates`): the messages and dead letters
    ``flags`` says, the messages of the events applied twice.  The lookups are made here,
    from the candidates collected: a few are lists of values, more a local relation
    broadcast; only the messages and dead letters are scanned, and only the columns the rows
    are made of."""
    spark = run.spark
    rows = store.where(F.col("kind").isin("message", "dlq")).select(
        *_FOUND,
        "broker",
        F.xxhash64("msg_id").alias("mh"),
        F.xxhash64("key").alias("kh"),
        F.hash("group").alias("gh"),
    )
    late_or_dead = flags["late"].fillna(False) | flags["dead"].fillna(False)
    for col, mask, flag in (("mh", late_or_dead, "wm"), ("kh", flags["part"] == 1, "wk")):
        keys = [int(k) for k in pd.unique(flags.loc[mask.fillna(False), "k"].dropna())]
        if len(keys) <= _INLINE:
            rows = rows.withColumn(flag, F.when(F.col(col).isin(keys), True))
        else:
            wanted = local_frame(spark, [(k, True) for k in keys], f"{col} long, {flag} boolean")
            rows = rows.join(F.broadcast(wanted), col, "left")
    found = _pandas(rows.where(F.col("wm") | F.col("wk")))
    for flag in ("wm", "wk"):
        found[flag] = found[flag].fillna(False).astype(bool)
    return found


def _transactions(txc: pd.DataFrame, dbs: Sequence[Database]) -> dict[str, pd.DataFrame]:
    logged = _fetched(dbs, "log", {"transaction_id": txc["transaction_id"].tolist()})
    logged = (
        logged.sort_values(["transaction_id", "db"])
        .drop_duplicates("transaction_id")[["transaction_id", "producer_group", "state", "db"]]
        .rename(columns={"producer_group": "lgroup", "state": "local_state"})
    )
    txa = txc.merge(logged, on="transaction_id", how="left")
    rank = txa["rank"]
    cols = {
        "group": txa["lgroup"].combine_first(txa["pgroup"]),
        "transaction_id": txa["transaction_id"],
        "msg_id": txa["msg_id"],
        "topic": txa["topic"],
        "key": txa["key"],
        "local_state": txa["local_state"].fillna("NONE"),
        "broker_state": rank.map({v: k for k, v in RANK.items()}).fillna("MISSING").astype(object),
        "at": _ts(txa["at"]),
        "db": txa["db"],
        "broker": txa["broker"],
    }
    # a half of a transaction another half of which the broker committed
    beside = ((txa["ranks"] & (1 << RANK["COMMITTED"])) != 0).fillna(False).to_numpy(bool)
    detail = {
        "lost": np.char.add(
            np.select(
                [
                    rank.isna().to_numpy(bool),
                    (rank == RANK["ROLLED_BACK"]).fillna(False).to_numpy(bool),
                ],
                ["the broker never got the half message", "the broker rolled the message back"],
                "the half message is still undecided after the SLA",
            ),
            np.where(beside, " (another of the transaction committed)", ""),
        ),
        "phantom": np.where(
            txa["local_state"].isna(),
            "no local transaction with this id",
            "the local transaction is " + txa["local_state"].fillna(""),
        ),
        "parked": np.where(
            (txa["local"] == LOCAL_COMMITTED).fillna(False),
            "decide COMMIT: it committed locally",
            "decide ROLLBACK: it did not commit locally",
        ),
    }
    out = {}
    for c, text in detail.items():
        mask = (txa["class"] == c).to_numpy(bool)
        out[c] = _shape(
            txa[mask],
            c,
            detail=pd.Series(text, index=txa.index)[mask],
            **{k: v[mask] for k, v in cols.items()},
        )
    return out


@dataclass
class Anomalies:
    """The rows of each class (pandas, :data:`COLUMNS`, at most ``max_rows`` a class, the
    first by time), and for a class with more, how many it has."""

    rows: dict[str, pd.DataFrame]
    totals: dict[str, int]

    def count(self, anomaly: str) -> int:
        return self.totals.get(anomaly, len(self.rows[anomaly]))


def _first(run: Run, df: DataFrame, by: Column, n: int) -> DataFrame:
    """The first ``n`` rows of ``df`` (by time) of each value of ``by`` (column ``what``),
    kept: what is collected and what the store scan looks for must be the same rows."""
    ranked = df.withColumn("what", by).where(F.col("what").isNotNull())
    rank = F.row_number().over(Window.partitionBy("what").orderBy("at", "k"))
    return run.keep(ranked.withColumn("_rank", rank).where(F.col("_rank") <= n).drop("_rank"))


def anomalies(
    run: Run,
    store: DataFrame,
    txc: DataFrame,
    flagged: DataFrame,
    *,
    dbs: Sequence[Database],
    bits: Mapping[str, int],
    groups: Sequence[str],
    evidence: Mapping[str, str] | None = None,
    max_rows: int,
) -> Anomalies:
    """The anomalies of each class, from the transaction candidates ``txc`` and the messages
    and events ``flagged``.  ``bits``: expected group -> bit; ``groups``: consumer group
    names by index; ``evidence``: expected group -> what its consumption was judged on
    (:data:`spark.offsets.EVIDENCE`; the detail of its unconsumed rows says it);
    ``max_rows``: the most rows a class gets (its count stays exact)."""
    what = reason()
    # the candidates of each class and reason, as the passes counted them
    candidates: dict[str | None, int] = {
        c: int(n or 0) for c, n in run.observed(CANDIDATES).items()
    }
    reasons = run.observed(FLAGGED)
    pairs = int(reasons.pop("pairs") or 0)
    candidates |= {None if r == "none" else r: int(n or 0) for r, n in reasons.items()}
    if max(candidates.values(), default=0) > max_rows:  # else every candidate is wanted
        txc = _first(run, txc.withColumn("k", F.col("half_offset")), F.col("class"), max_rows)
        flagged = _first(run, flagged, what, max_rows)
    tx = _pandas(txc)
    flags = _pandas(flagged)
    found = _wanted(run, store, flags)
    out = _transactions(tx, dbs)

    # -- outbox rows the broker never got ----------------------------------------------------
    refs = flags.loc[flags["never_sent"].fillna(False), "oref"].to_numpy("int64")
    unsent = pd.concat(
        [
            _fetched(
                [dbs[i]], "outbox", {"id": (refs[refs >> _OREF_BITS == i] & _ID_MASK).tolist()}
            )
            for i in sorted(set((refs >> _OREF_BITS).tolist()))
        ]
        or [_fetched([], "outbox", {})]
    )
    out["lost"] = pd.concat(
        [
            out["lost"],
            _shape(
                unsent,
                "lost",
                msg_id=unsent["msg_id"],
                topic=unsent["topic"],
                key=unsent["keys"].str.split(" ").str[0].fillna(unsent["msg_id"]),
                local_state="outbox " + unsent["state"],
                broker_state="MISSING",
                detail="outbox row not at the broker after "
                + unsent["attempts"].astype(str)
                + " attempts"
                + (": " + unsent["last_error"]).fillna(""),
                at=pd.to_datetime(unsent["created_at"], utc=True),
                db=unsent["db"],
            ),
        ],
        ignore_index=True,
    )

    # -- unconsumed messages: one row per group that did not consume -------------------------
    late = flags[flags["late"].fillna(False)]
    late = pd.concat(
        [
            late.loc[(late["missing"].to_numpy("int64") & b) != 0, ["k", "at"]].assign(group=g)
            for g, b in bits.items()
        ]
        or [pd.DataFrame(columns=["k", "at", "group"])]
    ).rename(columns={"k": "mh"})
    messages = found[(found["kind"] == "message") & found["wm"]]
    messages = _with_joined(
        messages.sort_values("msg_id")
        .groupby("mh", as_index=False, sort=False)
        .agg(
            msg_id=("msg_id", "first"),
            topic=("topic", "first"),
            key=("key", "first"),
        ),
        messages,
        ["mh"],
        "broker",
    )
    late = late.merge(messages, on="mh")
    said = {g: _UNCONSUMED[(evidence or {}).get(g, "consumed keys")] for g in bits}
    out["unconsumed"] = _about_messages(
        late,
        "unconsumed",
        broker_state="COMMITTED",
        detail=late["group"].map(said),
        broker=late["broker"],
    )
    out["duplicate"] = _duplicates(run, flags, found, dbs, groups)

    # -- dead letters their group has not consumed since ---------------------------------------
    dead = flags.loc[flags["dead"].fillna(False), ["k", "g"]].rename(columns={"k": "mh", "g": "gh"})
    letters = found[(found["kind"] == "dlq") & found["wm"] & _in_window(run, found["store_ts"])]
    letters = letters.merge(dead, on=["mh", "gh"])
    letters = _with_joined(
        letters.groupby(["group", "msg_id"], as_index=False).agg(
            topic=("topic", "first"),
            key=("key", "first"),
            times=("reconsume_times", "max"),
            at=("store_ts", "max"),
        ),
        letters,
        ["group", "msg_id"],
        "broker",
    )
    out["dead_lettered"] = _about_messages(
        letters,
        "dead_lettered",
        broker_state="DLQ",
        detail="dead-lettered after " + letters["times"].astype(str) + " deliveries",
        broker=letters["broker"],
    )
    # a class's count: its rows, or when there are more than max_rows, the candidates
    # Spark counted (the rows of a class are confirmed on strings only up to max_rows)
    sources = {
        "lost": ("lost", "never_sent"),
        "phantom": ("phantom",),
        "parked": ("parked",),
        "unconsumed": ("late",),
        "duplicate": ("twice",),
        "dead_lettered": ("dead",),
    }
    totals = {}
    for c, rows in out.items():
        n = {w: candidates.get(w, 0) for w in sources[c]}
        if len(rows) > max_rows or any(v > max_rows for v in n.values()):
            totals[c] = pairs if c == "unconsumed" else sum(n.values())
            out[c] = rows.sort_values("at", na_position="first").head(max_rows)
    return Anomalies(out, totals)


def _duplicates(
    run: Run,
    flags: pd.DataFrame,
    found: pd.DataFrame,
    dbs: Sequence[Database],
    groups: Sequence[str],
) -> pd.DataFrame:
    """The events applied twice, confirmed on the consumed keys' strings."""
    twice = flags.loc[flags["part"] == 1, ["k", "g"]].rename(columns={"k": "kh"})
    if twice.empty:
        return _shape(twice, "duplicate")
    twice["group"] = [groups[int(g)] for g in twice["g"]]
    msgs = found[(found["kind"] == "message") & found["wk"] & _in_window(run, found["store_ts"])]
    tokens = msgs.assign(
        token=[
            list(dict.fromkeys([m, *(keys.split(" ") if isinstance(keys, str) else [])]))
            for m, keys in zip(msgs["msg_id"], msgs["keys"], strict=True)
        ]
    ).explode("token")[["kh", "msg_id", "topic", "key", "store_ts", "token", "broker"]]
    done = _fetched(
        dbs,
        "consumed",
        {"key": sorted(set(tokens["token"])), "consumer_group": sorted(set(twice["group"]))},
        "state = 'done'",
    ).rename(columns={"consumer_group": "group", "key": "token"})[["group", "token", "db"]]
    applied = tokens.merge(done, on="token").merge(twice[["kh", "group"]], on=["group", "kh"])
    by = ["group", "key"]
    grouped = applied.groupby(by, as_index=False).agg(
        n=("token", "nunique"),
        msg_id=("msg_id", "min"),
        topic=("topic", "first"),
        at=("store_ts", "min"),
        db=("db", "first"),
    )
    grouped = _with_joined(_with_joined(grouped, applied, by, "token"), applied, by, "broker")
    applied = grouped.rename(columns={"token": "tokens"})
    applied = applied[applied["n"] > 1]  # not two keys that share a hash
    return _about_messages(
        applied,
        "duplicate",
        broker_state="COMMITTED",
        detail="applied " + applied["n"].astype(str) + " times, as " + applied["tokens"],
        db=applied["db"],
        broker=applied["broker"],
    )


def _with_joined(
    grouped: pd.DataFrame, rows: pd.DataFrame, by: list[str], col: str
) -> pd.DataFrame:
    """``grouped`` (one row per value of ``by``) with column ``col``: the distinct values of
    ``rows[col]`` in its group, nulls left out, sorted and comma-separated ("" when none),
    e.g. the broker sets that hold a message (or its copies).  Without a Python call per
    group: most groups have one value, which is taken as it is."""
    values = rows.loc[rows[col].notna(), [*by, col]].drop_duplicates()
    values = values.sort_values([*by, col], kind="stable")
    many = values.duplicated(by, keep=False).to_numpy(bool)
    joined = values[~many]
    if many.any():
        several = values[many].groupby(by, as_index=False, sort=False)[col].agg(", ".join)
        joined = pd.concat([joined, several]) if len(joined) else several
    out = grouped.drop(columns=[col], errors="ignore").merge(joined, on=by, how="left")
    out[col] = out[col].astype(object).where(out[col].notna(), "")
    return out
