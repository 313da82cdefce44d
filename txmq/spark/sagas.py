"""The saga classes: sagas (``txmq.saga``) reconciled across the databases given, the
coordinators' (``txmq_sagas``, its step log ``txmq_saga_steps``) and the participants'
(``txmq_saga_barrier``).

``saga_stuck``
    a saga not in a final state (COMPLETED, COMPENSATED) whose row has not changed for
    longer than the SLA: its state, the step and operation it waits on, and for how long
    (``age``).  A PARKED saga waits for an operator (``txmq admin sagas retry`` or
    ``resolve``), by design: past the SLA it is stuck too, and says so.
``saga_partly_compensated``
    compensation did not undo every effect: a saga COMPENSATED with a step that took
    effect but has no compensation barrier row in its participant's database (nor an
    operator's ``resolved`` in the step log: an operator undid it by hand) — COMPENSATED
    says every effect is undone, so one such step is enough, whether or not the others
    are; or a saga COMPENSATING (or PARKED on a compensation) past the SLA, some of whose
    effects are undone while others are not (none undone yet is only stuck: compensations
    run one at a time, the last effect first).  The row names the steps not undone.  A
    step took effect when the step log says its action was ``done``, its participant's
    barrier row for the action says ``action`` (not refused, failed, nor a compensation
    that came first), or the coordinator's ``effected`` list holds it; steps without a
    compensation have nothing to undo and are not counted.
``saga_effect_without_barrier``
    the step log says a branch's action (a TCC try), confirm or compensation was ``done``,
    but its participant's database has no barrier row (saga, branch, operation): the
    participant commits the row with the effect and before its answer, so the effect is
    not where the barrier says (a row deleted, or the effect committed elsewhere).
``saga_barrier_without_saga``
    barrier rows in a participant's database whose saga is in none of the coordinators'
    databases given (the coordinator commits the saga's row before it sends a command, so
    a row was deleted, or the coordinator's database is not the one given).  Judged only
    for the branches the definitions of the sagas read know (a barrier row of a saga whose
    coordinator's database was not given is no evidence), one row per saga and database.

Which database is which participant: nothing stores a participant database's service
name, so it is deduced.  A barrier row of (saga, branch) in database D makes D a database
of the service that runs the branch in that saga's stored definition (``definition``:
its steps and their services); a service is "given" when some database holds a barrier
row of one of its branches, and a service no database holds any barrier row of is taken
to be absent: its branches are not judged (``facts.saga_participants`` lists what was
deduced).  So a participant's database that lost every barrier row is seen as absent.

Every fact judged is older than the SLA: a saga's row (stuck, partly compensated: its last
change), a step log event (effect without barrier), a barrier row (without saga); what is
younger may be in flight, or two database clocks apart.  A saga belongs to the run when it
was created inside the window (a barrier row without saga: when it was written).  The
tables are read as of ``--now`` (steps and barrier rows written later are left out), but a
saga's row holds its latest state only: a saga that changed after ``--now`` is judged as
it is now, and not stuck.

How: the sagas' distinct definitions are read first (a few: one per saga and version),
then the three tables are grouped once by (saga, branch), every aggregate buffer numeric,
and kept; every class is a filter of that, or of its grouping by saga; the strings of the
few sagas flagged are fetched by primary key at the end and the rows put together on the
driver (:mod:`spark.saga_rows`).  The state names are
``txmq.saga``'s (the job may not import the application side: a test checks they agree).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from txmq.spark.common import Run, local_frame, mapped
from txmq.spark.options import BadOption
from txmq.spark.saga_rows import (
    ENDED,
    SAGA_CLASSES,
    SAGA_COLUMNS,
    SAGA_SCHEMA,
    STATES,
    Participants,
    SagaFindings,
    definition_steps,
    fetch_sagas,
    frame,
    orphan_rows,
    partly_row,
    stuck_row,
    unbarred_rows,
    when,
)
from txmq.spark.sources import Database

__all__ = [
    "ENDED",
    "MAX_DATABASES",
    "SAGA_CLASSES",
    "SAGA_COLUMNS",
    "SAGA_SCHEMA",
    "STATES",
    "SagaFindings",
    "reconcile_sagas",
]

_CODE = {s: i for i, s in enumerate(STATES)}
_ACTION, _COMPENSATION, _CONFIRM = "action", "compensation", "confirm"
#: the part of a stored definition the job reads (``Saga.to_dict``)
_DEFINITION = "struct<steps: array<struct<action: string, service: string, compensation: string>>>"
#: the step log's ``done`` time of each operation (a column of the grouping each)
_DONE = {_ACTION: "a_done", _COMPENSATION: "c_done", _CONFIRM: "f_done"}
#: a branch's facts (bits), OR-ed together by the grouping
_DEFINED = 1  # the definition of a saga read has the branch
_EFFECTED = 2  # the coordinator's effected list holds it
_UNDOABLE = 4  # its step has a compensation
_LOG_ACTION = 8  # the step log: its action done
_RESOLVED = 16  # the step log: an operator resolved it (did it by hand)
_B_ACTION = 32  # a barrier row of its action, whatever the reason
_B_EFFECT = 64  # ... that says the action took effect (reason "action")
_B_COMP = 128  # a barrier row of its compensation
_B_CONFIRM = 256  # a barrier row of its confirm
_BARRIER_OPS = {_ACTION: _B_ACTION, _COMPENSATION: _B_COMP, _CONFIRM: _B_CONFIRM}
#: the most databases a run tells apart (a bit each)
MAX_DATABASES = 62
#: the names of the counts taken on the way (:meth:`Run.observe`)
_SAGAS, _FLAGGED = "sagas", "flagged_sagas"


def _has(bit: int) -> Column:
    return F.col("flags").bitwiseAND(bit) != 0


def _older(run: Run, col: str) -> Column:
    """``col`` (ms) is older than the SLA (false when null)."""
    return F.coalesce(F.col(col) < run.cutoff, F.lit(False))


def _branches(
    run: Run,
    sagas: DataFrame,
    steps: DataFrame,
    barrier: DataFrame,
    db_bit: Column,
    services: Mapping[str, int],
) -> DataFrame:
    """One row per (saga, branch) met in any of the three tables, kept: ``flags`` (the bits
    above), ``svc`` (its service's index in ``services``), the saga's state (``sc``, its
    index in :data:`STATES`), whether it waits on a compensation (``comp``), its creation
    and last change (``crt``, ``upd``: ms), when the step log first says the branch's
    action, compensation, confirm was done (``a_done``, ``c_done``, ``f_done``), the
    databases holding its barrier rows (``dbs``: a bit per database) and the first of those
    rows' time (``b_at``)."""
    null_long = F.lit(None).cast("long")
    null_int = F.lit(None).cast("int")
    blank: dict[str, Column] = {c: null_int for c in ("svc", "sc", "comp")}
    blank |= {c: null_long for c in ("crt", "upd", "a_done", "c_done", "f_done", "b_at")}
    blank["dbs"] = F.lit(0).cast("long")

    def row(flags: Column, **cols: Column) -> list[Column]:
        """A row of the union: ``flags`` and ``cols``, the other columns null."""
        return [
            F.col("saga_id"),
            F.col("branch"),
            flags.alias("flags"),
            *(cols.get(c, v).alias(c) for c, v in blank.items()),
        ]

    step = F.col("s")
    defined = (
        sagas.select(
            "saga_id",
            "state",
            "op",
            "created_ms",
            "updated_ms",
            F.from_json("effected", "array<int>").alias("effected"),
            F.posexplode_outer(F.from_json("definition", _DEFINITION)["steps"]).alias("i", "s"),
        )
        .withColumn("branch", step["action"])
        .select(
            *row(
                F.lit(_DEFINED)
                .bitwiseOR(F.when(F.array_contains("effected", F.col("i")), _EFFECTED).otherwise(0))
                .bitwiseOR(F.when(step["compensation"].isNotNull(), _UNDOABLE).otherwise(0)),
                svc=mapped(step["service"], services, -1).cast("int"),
                sc=mapped(F.col("state"), _CODE, -1).cast("int"),
                comp=F.when(F.col("op") == _COMPENSATION, 1).otherwise(0),
                crt=F.col("created_ms"),
                upd=F.col("updated_ms"),
            )
        )
    )
    op, event = F.col("op"), F.col("event")

    def done_at(name: str) -> Column:
        return F.when((event == "done") & (op == name), F.col("at_ms"))

    logged = steps.select(
        *row(
            F.when((event == "done") & (op == _ACTION), _LOG_ACTION)
            .when((op == "operator") & (event == "resolved"), _RESOLVED)
            .otherwise(0),
            a_done=done_at(_ACTION),
            c_done=done_at(_COMPENSATION),
            f_done=done_at(_CONFIRM),
        )
    )
    barriers = barrier.select(
        *row(
            mapped(op, _BARRIER_OPS, 0).bitwiseOR(
                F.when((op == _ACTION) & (F.col("reason") == _ACTION), _B_EFFECT).otherwise(0)
            ),
            dbs=db_bit,
            b_at=F.col("created_ms"),
        )
    )
    grouped = (
        defined.unionByName(logged)
        .unionByName(barriers)
        .repartition("saga_id")  # the grouping by saga below shares this shuffle
        .groupBy("saga_id", "branch")
        .agg(
            F.bit_or("flags").alias("flags"),
            *(F.max(c).alias(c) for c in ("svc", "sc", "comp", "crt", "upd")),
            *(F.min(c).alias(c) for c in ("a_done", "c_done", "f_done", "b_at")),
            F.bit_or("dbs").alias("dbs"),
        )
    )
    return run.keep(grouped)


def _first(df: DataFrame, by: str, max_rows: int, name: str, out: SagaFindings) -> pd.DataFrame:
    """The first ``max_rows`` rows of ``df`` by ``by`` (then saga id), on the driver; the
    count of class ``name`` in ``out.totals`` when it has more."""
    rows = df.orderBy(by, "saga_id").limit(max_rows + 1).toArrow().to_pandas()
    if len(rows) > max_rows:
        out.totals[name] = int(df.count())
    return rows.head(max_rows)


def reconcile_sagas(
    run: Run,
    sagas: DataFrame,
    steps: DataFrame,
    barrier: DataFrame,
    *,
    dbs: Sequence[Database],
    max_rows: int,
) -> SagaFindings:
    """The saga classes from the three tables (each with its ``db`` column) of ``dbs``; the
    job reads them as of ``run.now`` (see the module docstring)."""
    out = SagaFindings()
    if len(dbs) > MAX_DATABASES:
        raise BadOption(f"sagas are reconciled across at most {MAX_DATABASES} databases")
    names = [d.name for d in dbs]
    with run.step("sagas", "classifying the sagas"):
        # the definitions are few (one per saga and version): their services and branches
        definitions = [
            definition_steps(r[0]) for r in sagas.select("definition").distinct().collect()
        ]
        services = sorted({str(s.get("service")) for d in definitions for s in d})
        branches: dict[str, set[str]] = {
            str(s.get("action")): set() for d in definitions for s in d
        }
        for d in definitions:
            for s in d:
                branches[str(s.get("action"))].add(str(s.get("service")))
        index = {s: i for i, s in enumerate(services)}
        db_bit = mapped(F.col("db"), {n: 1 << i for i, n in enumerate(names)}, 0).cast("long")
        pb = _branches(run, sagas, steps, barrier, db_bit, index)
        defined = _has(_DEFINED)
        # the participants: the services with barrier rows of their branches, and where
        served = {
            int(r["svc"]): int(r["dbs"])
            for r in pb.where(defined & (F.col("dbs") != 0) & (F.col("svc") >= 0))
            .groupBy("svc")
            .agg(F.bit_or("dbs").alias("dbs"))
            .collect()
        }
        out.participants = {
            services[i]: [n for b, n in enumerate(names) if mask >> b & 1]
            for i, mask in sorted(served.items())
        }
        given = F.col("svc").isin(list(served)) if served else F.lit(False)
        in_window = run.window(F.col("crt"))
        # -- a done in the step log, older than the SLA, whose barrier row is nowhere
        lacks = {op: _older(run, at) & ~_has(_BARRIER_OPS[op]) for op, at in _DONE.items()}
        unbarred = (
            pb.where(defined & in_window & given & reduce(operator.or_, lacks.values()))
            .select(
                "saga_id",
                "branch",
                *(F.when(c, F.col(_DONE[op])).alias(op) for op, c in lacks.items()),
            )
            .withColumn("first", F.least(*map(F.col, _DONE)))
        )
        unbarred_found = _first(unbarred, "first", max_rows, SAGA_CLASSES[2], out)
        # -- per saga: stuck, partly compensated
        judged = defined & _has(_UNDOABLE) & ((F.col("dbs") != 0) | given)
        effect = _has(_LOG_ACTION) | _has(_B_EFFECT) | _has(_EFFECTED)
        undone = judged & effect & ~(_has(_B_COMP) | _has(_RESOLVED))
        per_saga = (
            pb.where(defined)
            .groupBy("saga_id")
            .agg(
                *(F.max(c).alias(c) for c in ("sc", "comp", "crt", "upd")),
                F.sum(F.when(judged & effect, 1).otherwise(0)).alias("effects"),
                F.sum(F.when(undone, 1).otherwise(0)).alias("undone"),
            )
            .where(in_window)
        )
        sc, left = F.col("sc"), F.col("undone")
        settled = _older(run, "upd")
        compensating = (sc == _CODE["COMPENSATING"]) | (
            (sc == _CODE["PARKED"]) & (F.col("comp") == 1)
        )
        stuck = settled & ~sc.isin(*(_CODE[s] for s in ENDED))
        partly = (
            settled
            & (left > 0)
            & ((sc == _CODE["COMPENSATED"]) | (compensating & (left < F.col("effects"))))
        )
        # counted as they are computed: the sagas judged, and how many are stuck, partly
        per_saga = run.observe(per_saga, _SAGAS, n=F.count(F.lit(1)))
        flagged = per_saga.select(
            "saga_id", "upd", "effects", "undone", stuck.alias("stuck"), partly.alias("partly")
        ).where(F.col("stuck") | F.col("partly"))
        flagged = run.keep(
            run.observe(
                flagged,
                _FLAGGED,
                **{c: F.sum(F.when(F.col(c), 1).otherwise(0)) for c in ("stuck", "partly")},
            )
        )
        out.sagas = int(run.observed(_SAGAS)["n"] or 0)
        flags = {c: int(n or 0) for c, n in run.observed(_FLAGGED).items()}
        if max(flags.values()) <= max_rows:  # all of them, in one go
            both = flagged.toArrow().to_pandas()
            stuck_found, partly_found = (
                both[both[c].fillna(False).astype(bool)]
                .sort_values(["upd", "saga_id"])
                .reset_index(drop=True)
                for c in ("stuck", "partly")
            )
        else:
            stuck_found = _first(flagged.where("stuck"), "upd", max_rows, SAGA_CLASSES[0], out)
            partly_found = _first(flagged.where("partly"), "upd", max_rows, SAGA_CLASSES[1], out)
        left_undone: dict[str, list[str]] = {}
        if len(partly_found):
            few = local_frame(run.spark, [(i,) for i in partly_found["saga_id"]], "saga_id string")
            for r in pb.join(F.broadcast(few), "saga_id").where(undone).collect():
                left_undone.setdefault(r["saga_id"], []).append(r["branch"])
        # -- barrier rows of the branches the definitions know, of no saga read
        known = sorted(b for b in branches if b)
        orphans = pb.where(
            ~defined
            & (F.col("dbs") != 0)
            & _older(run, "b_at")
            & run.window(F.col("b_at"))
            & F.col("branch").isin(known)
        ).select(
            "saga_id",
            "branch",
            "dbs",
            "b_at",
            *(_has(bit).alias(op) for op, bit in _BARRIER_OPS.items()),
        )
        orphans_found = orphans.toArrow().to_pandas() if known else pd.DataFrame()
    with run.step("saga details", "putting the sagas' rows together"):
        now = run.now
        named = Participants(out.participants)
        ids = {*stuck_found["saga_id"], *partly_found["saga_id"], *unbarred_found["saga_id"]}
        found = fetch_sagas(dbs, sorted(ids))
        rows: dict[str, list[dict[str, Any]]] = {c: [] for c in SAGA_CLASSES}
        for r in stuck_found.itertuples():
            if r.saga_id in found and found[r.saga_id]["state"] not in ENDED:
                rows[SAGA_CLASSES[0]].append(stuck_row(now, found[r.saga_id], when(r.upd), named))
        for r in partly_found.itertuples():
            if r.saga_id in found:
                rows[SAGA_CLASSES[1]].append(
                    partly_row(
                        now,
                        found[r.saga_id],
                        when(r.upd),
                        (int(r.effects), int(r.undone)),
                        sorted(left_undone.get(r.saga_id, [])),
                        named,
                    )
                )
        for r in unbarred_found.itertuples():
            if r.saga_id in found:
                done = {op: when(getattr(r, op)) for op in _DONE}
                rows[SAGA_CLASSES[2]] += unbarred_rows(now, found[r.saga_id], r.branch, done, named)
        rows[SAGA_CLASSES[3]] = orphan_rows(now, orphans_found, dbs, branches)
        for c in SAGA_CLASSES:
            df = frame(rows[c])
            if len(df) > max_rows:
                out.totals[c] = len(df)
            out.rows[c] = df.head(max_rows).reset_index(drop=True)
    return out
