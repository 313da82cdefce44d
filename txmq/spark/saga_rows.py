"""The saga classes' rows (:data:`SAGA_COLUMNS`), put together on the driver from the few
sagas the pass of :mod:`spark.sagas` flagged, with their strings fetched from the
coordinators' databases by primary key."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]

from txmq.spark.sources import TABLES, Database

__all__ = [
    "ENDED",
    "OPS",
    "SAGA_CLASSES",
    "SAGA_COLUMNS",
    "SAGA_SCHEMA",
    "STATES",
    "Participants",
    "SagaFindings",
    "age",
    "definition_steps",
    "fetch_sagas",
    "frame",
    "orphan_rows",
    "partly_row",
    "stuck_row",
    "unbarred_rows",
    "when",
]

SAGA_CLASSES = (
    "saga_stuck",
    "saga_partly_compensated",
    "saga_effect_without_barrier",
    "saga_barrier_without_saga",
)
#: a saga anomaly's columns: ``db`` is the coordinator's database, ``participant_db`` the
#: participant's (comma-separated when there are several); ``step``, ``branch`` and ``op``
#: what the row is about (a stuck saga: what it waits on), ``at`` when it happened (a
#: saga's last change, a step log event, a barrier row) and ``age`` how long ago
SAGA_COLUMNS = (
    "anomaly",
    "saga_id",
    "saga",
    "state",
    "step",
    "branch",
    "op",
    "service",
    "detail",
    "at",
    "age",
    "db",
    "participant_db",
)
_TYPES = {"step": pa.int32(), "at": pa.timestamp("us", tz="UTC")}
#: a saga anomaly table's Arrow schema
SAGA_SCHEMA = pa.schema([(c, _TYPES.get(c, pa.string())) for c in SAGA_COLUMNS[1:]])

#: ``txmq_sagas.state`` (``txmq.saga.model.State``: the application side, which the job may
#: not import; a test checks they agree)
STATES = ("RUNNING", "CONFIRMING", "COMPENSATING", "PARKED", "COMPLETED", "COMPENSATED")
ENDED = ("COMPLETED", "COMPENSATED")
#: a branch's operations, as the step log and the barrier name them
OPS = ("action", "compensation", "confirm")


@dataclass
class SagaFindings:
    """The rows of each saga class (pandas, :data:`SAGA_COLUMNS`, at most ``max_rows`` a
    class, the first by time), the count of each class that has more, and facts."""

    rows: dict[str, pd.DataFrame] = field(
        default_factory=lambda: {c: frame([]) for c in SAGA_CLASSES}
    )
    totals: dict[str, int] = field(default_factory=dict)
    #: the sagas judged (created inside the window)
    sagas: int = 0
    #: service -> the databases deduced to be its participant databases
    participants: dict[str, list[str]] = field(default_factory=dict)


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Anomaly rows (dicts; a column left out is null) as a table of :data:`SAGA_COLUMNS`,
    the first by time."""
    df = pd.DataFrame(rows, columns=list(SAGA_COLUMNS))
    text = [c for c in SAGA_COLUMNS if c not in ("at", "step")]
    df[text] = df[text].astype(object).where(df[text].notna(), None)
    df["at"] = pd.to_datetime(df["at"], utc=True)
    df["step"] = df["step"].astype(pd.Int32Dtype())
    return df.sort_values(["at", "saga_id"], na_position="first").reset_index(drop=True)


def definition_steps(definition: Any) -> list[dict[str, Any]]:
    """The steps of a stored definition (``Saga.to_dict``: JSON text, or already decoded);
    none if it is not one."""
    try:
        d = json.loads(definition) if isinstance(definition, str | bytes) else definition
        steps = d["steps"]
    except (ValueError, TypeError, KeyError):
        return []
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []


def when(at_ms: Any) -> datetime | None:
    """Epoch milliseconds (or null) as a time."""
    if at_ms is None or at_ms != at_ms:
        return None
    return datetime.fromtimestamp(int(at_ms) / 1000, UTC)


def age(now: datetime, at: datetime | None) -> str | None:
    """How long before ``now`` (naive: UTC) ``at`` was, to the second: ``1:02:03``."""
    if at is None:
        return None
    now = now if now.tzinfo else now.replace(tzinfo=UTC)
    return str(timedelta(seconds=max(int((now - at).total_seconds()), 0)))


def fetch_sagas(dbs: Sequence[Database], ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The saga rows of ``ids`` (their columns, and ``db``: the database they are in), by
    primary key."""
    names = [*TABLES["sagas"].names, "db"]
    out: dict[str, dict[str, Any]] = {}
    for db in dbs:
        for r in db.fetch("sagas", {"saga_id": list(ids)}):
            out.setdefault(r[0], dict(zip(names, r, strict=True)))
    return out


@dataclass(frozen=True)
class Participants:
    """The participant databases deduced, by service."""

    dbs_of: Mapping[str, Sequence[str]]

    def dbs(self, services: Sequence[str | None]) -> str | None:
        """The databases of ``services``, comma-separated (None: none given)."""
        found = sorted({d for s in services if s for d in self.dbs_of.get(s, ())})
        return ", ".join(found) or None


def _step_of(saga: Mapping[str, Any], branch: str) -> tuple[int | None, str | None]:
    """The step index and service of ``branch`` in ``saga``'s stored definition."""
    for i, s in enumerate(definition_steps(saga["definition"])):
        if s.get("action") == branch:
            return i, s.get("service")
    return None, None


def _row(
    now: datetime, anomaly: str, saga: Mapping[str, Any], at: datetime | None, **cols: Any
) -> dict[str, Any]:
    """An anomaly row about ``saga`` (a fetched row), at ``at``, with ``cols``."""
    return {
        "anomaly": anomaly,
        "saga_id": saga["saga_id"],
        "saga": saga["name"],
        "state": saga["state"],
        "step": saga["step"],
        "op": saga["op"],
        "at": at,
        "age": age(now, at),
        "db": saga["db"],
        **cols,
    }


def stuck_row(
    now: datetime, saga: Mapping[str, Any], at: datetime | None, participants: Participants
) -> dict[str, Any]:
    """A ``saga_stuck`` row: what the saga waits on since ``at`` (its last change)."""
    steps = definition_steps(saga["definition"])
    k = saga["step"]
    step = steps[k] if isinstance(k, int) and 0 <= k < len(steps) else {}
    branch, service = step.get("action"), step.get("service")
    waiting = f"step {k} ({branch}), its {saga['op']}"
    if saga["state"] == "PARKED":
        detail = (
            f"PARKED for {age(now, at)}, past the SLA: waits for an operator to retry or "
            f"resolve {waiting} (txmq admin sagas)"
        )
    else:
        detail = f"{saga['state']} for {age(now, at)} without a change, waiting on {waiting}"
    if saga["error"]:
        detail += f"; {saga['error']}"
    return _row(
        now,
        SAGA_CLASSES[0],
        saga,
        at,
        branch=branch,
        service=service,
        detail=detail,
        participant_db=participants.dbs([service]),
    )


def partly_row(
    now: datetime,
    saga: Mapping[str, Any],
    at: datetime | None,
    counts: tuple[int, int],
    undone: Sequence[str],
    participants: Participants,
) -> dict[str, Any]:
    """A ``saga_partly_compensated`` row: ``counts`` (the steps that took effect, those not
    undone), ``undone`` the branches not undone."""
    effects, left = counts
    steps = [_step_of(saga, b) for b in undone]
    services = [s for _, s in steps]
    listed = ", ".join(f"{b} ({s})" for b, (_, s) in zip(undone, steps, strict=True))
    return _row(
        now,
        SAGA_CLASSES[1],
        saga,
        at,
        step=steps[0][0] if len(steps) == 1 else None,
        branch=", ".join(undone),
        op="compensation",
        service=", ".join(sorted({s for s in services if s})) or None,
        detail=f"{saga['state']}: compensation undid {effects - left} of the {effects} steps "
        f"that took effect; not undone (no compensation barrier row): {listed}",
        participant_db=participants.dbs(services),
    )


def unbarred_rows(
    now: datetime,
    saga: Mapping[str, Any],
    branch: str,
    done: Mapping[str, datetime | None],
    participants: Participants,
) -> list[dict[str, Any]]:
    """The ``saga_effect_without_barrier`` rows of a branch: an operation of it the step
    log says was done (at ``done[op]``) whose barrier row its participant does not have."""
    k, service = _step_of(saga, branch)
    return [
        _row(
            now,
            SAGA_CLASSES[2],
            saga,
            at,
            step=k,
            branch=branch,
            op=op,
            service=service,
            detail=f"the step log says its {op} was done, but no database of {service} has "
            f"its barrier row ({saga['saga_id']}, {branch}, {op})",
            participant_db=participants.dbs([service]),
        )
        for op, at in done.items()
        if at is not None
    ]


def orphan_rows(
    now: datetime,
    candidates: pd.DataFrame,
    dbs: Sequence[Database],
    branches: Mapping[str, set[str]],
) -> list[dict[str, Any]]:
    """The ``saga_barrier_without_saga`` rows, one per saga and participant database: the
    ``candidates`` (a barrier row's ``saga_id``, ``branch``, ``dbs``: a bit per database of
    ``dbs``, its time ``b_at`` in ms, and a bool column per operation of :data:`OPS`) whose
    saga no coordinator database has (looked up by primary key: it may be older than the
    sagas read).  ``branches``: branch -> the services the definitions read give it."""
    if candidates.empty:
        return []
    have = set(fetch_sagas(dbs, sorted(set(candidates["saga_id"]))))
    per: dict[tuple[str, str], list[tuple[str, list[str], int]]] = {}
    for r in candidates.to_dict("records"):
        if r["saga_id"] in have:
            continue
        ops = [op for op in OPS if r[op]]
        for b, db in enumerate(dbs):
            if int(r["dbs"]) >> b & 1:
                per.setdefault((r["saga_id"], db.name), []).append((r["branch"], ops, r["b_at"]))
    out = []
    for (saga_id, where), found in sorted(per.items()):
        rows = [f"{branch}/{op}" for branch, ops, _ in sorted(found) for op in ops]
        at = when(min(t for _, _, t in found))
        services = sorted({s for branch, _, _ in found for s in branches.get(branch, ())})
        out.append(
            {
                "anomaly": SAGA_CLASSES[3],
                "saga_id": saga_id,
                "branch": ", ".join(sorted({branch for branch, _, _ in found})),
                "op": ", ".join(sorted({op for _, ops, _ in found for op in ops})),
                "service": ", ".join(services) or None,
                "detail": f"barrier rows {', '.join(rows)}, but no coordinator database "
                "given has the saga",
                "at": at,
                "age": age(now, at),
                "participant_db": where,
            }
        )
    return out
