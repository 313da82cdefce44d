"""The reconciliation page: the last ``summary.json`` that ``txmq reconcile`` wrote
(:mod:`txmq.spark.job` writes it to its ``--out`` folder), read from the folder the console
was given with ``--reports DIR``: ``DIR/summary.json``, or the newest ``summary.json`` of
DIR's sub-folders (one per run) when they are newer.

The file is ``{"ok": bool, "counts": {class: n}, "facts": {...}, "examples": {class:
[row, ...]}}``; the classes and what they mean are :mod:`txmq.spark.classify`'s (repeated
here: the console does not import PySpark).  No folder, no file, a file that cannot be
read or is not such a summary: the page says so in one line.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from txmq.console.web import page, state_of

__all__ = [
    "CLASSES",
    "EXPLAINED",
    "Report",
    "example_columns",
    "find_summary",
    "load_report",
    "reconcile",
]

SUMMARY = "summary.json"
#: the anomaly classes, in the order the job prints them (spark.classify.CLASSES)
CLASSES = (
    *("lost", "phantom", "unconsumed", "duplicate", "parked", "dead_lettered"),
    *("saga_stuck", "saga_partly_compensated", "saga_effect_without_barrier"),
    "saga_barrier_without_saga",
)
#: what each class means, and where the console helps with it
EXPLAINED: dict[str, tuple[str, str]] = {
    "lost": (
        "committed in the producer's database, but its message never committed: the broker "
        "rolled the half back, or after the SLA still holds it undecided or never got it; or "
        "an outbox row older than the SLA whose message the broker does not have",
        "/outbox",
    ),
    "phantom": (
        "the broker committed a transactional message whose local transaction did not "
        "commit (a check-back rolled it back, or the log has no row)",
        "",
    ),
    "unconsumed": (
        "a committed message of a topic a consumer group is expected to consume, older than "
        "the SLA, that the group has not consumed (nor dead-lettered): no consumed key of the "
        "group names it, and the group's committed offset has not passed it",
        "/groups",
    ),
    "duplicate": (
        "one event applied by a consumer group under more than one consumed key (e.g. once "
        "by message id and once by key)",
        "",
    ),
    "parked": (
        "a half message parked after the last check-back: an operator decides COMMIT or "
        "ROLLBACK (local_state says which is right)",
        "/transactions",
    ),
    "dead_lettered": (
        "a message in %DLQ%<group> that the group has not consumed since",
        "/dlq",
    ),
    "saga_stuck": (
        "a saga not COMPLETED nor COMPENSATED whose row has not changed for longer than the "
        "SLA (a PARKED one waits for an operator to retry or resolve it)",
        "/sagas",
    ),
    "saga_partly_compensated": (
        "compensation did not undo every effect: a COMPENSATED saga (or one compensating past "
        "the SLA) with a step that took effect but has no compensation barrier row",
        "/sagas",
    ),
    "saga_effect_without_barrier": (
        "the step log says an operation was done, but its participant's database has no "
        "barrier row for it",
        "/sagas",
    ),
    "saga_barrier_without_saga": (
        "barrier rows in a participant's database whose saga none of the coordinators' "
        "databases given has",
        "",
    ),
}
#: the columns of an example row the page shows (the job's summary leaves out "db" too)
EXAMPLE_COLUMNS = (
    "group",
    "transaction_id",
    "msg_id",
    "topic",
    "key",
    "local_state",
    "broker_state",
    "detail",
    "at",
    "broker",
)
#: ... of a saga class's row (spark.sagas.SAGA_COLUMNS)
SAGA_EXAMPLE_COLUMNS = (
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
    "participant_db",
)
#: a column's heading, where it is not its name with spaces
HEADINGS = {"broker": "broker set", "participant_db": "participant database"}


def example_columns(name: str) -> tuple[str, ...]:
    """The columns the page shows of class ``name``'s example rows."""
    return SAGA_EXAMPLE_COLUMNS if name.startswith("saga_") else EXAMPLE_COLUMNS


class BadSummary(ValueError):
    """The file is not a summary the job writes."""


@dataclass(frozen=True)
class ClassRow:
    name: str
    count: int
    explanation: str
    link: str
    #: the first rows of the class, as text per :attr:`columns`
    examples: list[list[str]] = field(default_factory=list)
    #: the columns of the examples (:func:`example_columns`)
    columns: tuple[str, ...] = EXAMPLE_COLUMNS
    #: rows its Parquet table holds when --max-rows cut it (0: all of them)
    truncated: int = 0


@dataclass(frozen=True)
class Report:
    path: str
    #: when the file was written (epoch seconds)
    written: float
    ok: bool
    classes: list[ClassRow]
    facts: dict[str, Any]

    @property
    def anomalies(self) -> int:
        return sum(c.count for c in self.classes)


def find_summary(folder: Path) -> Path:
    """The newest ``summary.json`` in ``folder`` or one of its sub-folders."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    found: list[tuple[float, Path]] = []
    for candidate in [folder / SUMMARY, *(p / SUMMARY for p in folder.iterdir() if p.is_dir())]:
        try:
            found.append((candidate.stat().st_mtime, candidate))
        except OSError:
            continue
    if not found:
        raise FileNotFoundError(
            f"no {SUMMARY} in {folder} or its sub-folders yet: run txmq reconcile --out {folder}"
        )
    return max(found)[1]


def _text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(value)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadSummary(f"{what} is not a count: {value!r}")
    return value


def parse_report(data: Any, path: str, written: float) -> Report:
    """A :class:`Report` of a summary's JSON value (:class:`BadSummary` if it is not one)."""
    if not isinstance(data, dict):
        raise BadSummary("it is not a JSON object")
    counts = data.get("counts")
    if not isinstance(counts, dict) or not counts:
        raise BadSummary('it has no "counts" of anomaly classes')
    facts = data.get("facts", {})
    examples = data.get("examples", {})
    if not isinstance(facts, dict) or not isinstance(examples, dict):
        raise BadSummary('its "facts" or "examples" are not JSON objects')
    truncated = facts.get("truncated")
    if not isinstance(truncated, dict):
        truncated = {}
    names = [c for c in CLASSES if c in counts] + sorted(c for c in counts if c not in CLASSES)
    classes = []
    for name in names:
        rows = examples.get(name) or []
        if not isinstance(rows, list):
            raise BadSummary(f"the examples of {name!r} are not a list")
        columns = example_columns(str(name))
        shown = [[_text(r.get(col)) for col in columns] for r in rows if isinstance(r, dict)]
        explanation, link = EXPLAINED.get(name, ("(a class this console does not know)", ""))
        cut = truncated.get(name, 0)
        classes.append(
            ClassRow(
                name=str(name),
                count=_count(counts[name], f"the count of {name!r}"),
                explanation=explanation,
                link=link,
                examples=shown,
                columns=columns,
                truncated=cut if isinstance(cut, int) and not isinstance(cut, bool) else 0,
            )
        )
    ok = data.get("ok")
    if not isinstance(ok, bool):
        ok = not any(c.count for c in classes)
    return Report(path=path, written=written, ok=ok, classes=classes, facts=facts)


def load_report(folder: str) -> Report:
    """The newest summary under ``folder``, read and checked (raises
    :class:`FileNotFoundError`, :class:`OSError` or :class:`BadSummary`)."""
    path = find_summary(Path(folder))
    written = path.stat().st_mtime
    try:
        data = json.loads(path.read_bytes())
    except UnicodeDecodeError as exc:
        raise BadSummary(f"it is not UTF-8 text ({exc.reason})") from exc
    except ValueError as exc:
        raise BadSummary(f"it is not JSON ({exc})") from exc
    return parse_report(data, str(path), written)


def _facts(report: Report) -> list[tuple[str, str]]:
    """The run's inputs and figures, as (label, text) lines."""
    f = report.facts
    out: list[tuple[str, str]] = []

    def add(label: str, key: str, fmt: str = "{}") -> None:
        if f.get(key) not in (None, ""):
            out.append((label, fmt.format(f[key])))

    add("as of", "now")
    add("window", "window")
    add("SLA", "sla")
    stores = f.get("stores")
    if isinstance(stores, dict) and stores:
        out.append(("broker stores", ", ".join(f"{n} ({p})" for n, p in stores.items())))
    expected = f.get("expected")
    if isinstance(expected, list):
        pairs = [f"{e[0]} <- {e[1]}" for e in expected if isinstance(e, list) and len(e) == 2]
        out.append(("expected consumers", ", ".join(pairs) or "(none)"))
    evidence = f.get("evidence")
    if isinstance(evidence, dict) and evidence:
        shown = "; ".join(f"{g}: {e}" for g, e in sorted(evidence.items()))
        out.append(("evidence of consumption", shown))
    add("transactional sends", "transactions")
    add("outbox rows", "outbox_rows")
    add("committed messages", "messages")
    add("stored on more than one broker set", "multi_stored")
    add("waiting in retry topics", "retrying")
    add("consumed keys", "consumed_keys")
    add("sagas judged", "sagas")
    served = f.get("saga_participants")
    if isinstance(served, dict) and served:
        out.append(
            (
                "saga participants",
                "; ".join(
                    f"{s}: {', '.join(map(str, d)) if isinstance(d, list) else d}"
                    for s, d in sorted(served.items())
                ),
            )
        )
    add("Spark master", "master")
    seconds = f.get("seconds")
    if isinstance(seconds, dict) and seconds:
        steps = [(k, v) for k, v in seconds.items() if isinstance(v, int | float)]
        total = sum(v for _, v in steps)
        out.append(
            ("took", f"{total:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in steps) + ")")
        )
    return out


async def reconcile(request: Request) -> Response:
    folder = state_of(request).config.reports
    context: dict[str, Any] = {"folder": folder or "", "report": None, "problem": "", "facts": []}
    if not folder:
        context["problem"] = (
            "the console was started without --reports DIR: start it with the --out folder "
            "of txmq reconcile to see its last report here"
        )
        return page(request, "reconcile", context)
    try:
        report = await anyio.to_thread.run_sync(load_report, folder)
    except FileNotFoundError as exc:
        context["problem"] = str(exc)
    except BadSummary as exc:
        context["problem"] = f"the last {SUMMARY} under {folder} is not a reconcile summary: {exc}"
    except OSError as exc:
        context["problem"] = f"cannot read the report under {folder}: {exc}"
    else:
        context.update(
            report=report,
            facts=_facts(report),
            age_s=max(time.time() - report.written, 0.0),
            headings=HEADINGS,
        )
    return page(request, "reconcile", context)
