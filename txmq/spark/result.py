"""A run's result and the summary the job prints.

The printed summary writes spans as the command line does everywhere
(:func:`txmq.observability.fmt.span`: ``19.5 s``, ``10 min``, ``1.02 h``; never
``str(timedelta)``'s ``0:10:00``) and times as its tables do
(:func:`txmq.observability.fmt.ms_time`: local time to the millisecond,
``2026-11-23 10:00:00.250``).  ``summary.json`` keeps its values as they were (ISO 8601
UTC times, the rows' ``age`` as ``H:MM:SS``): scripts and the web console read them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from txmq.observability.fmt import ms_time, span

__all__ = ["Result", "age_span", "example_rows", "when"]

#: ``str(timedelta)``: ``1:02:03``, ``2 days, 1:02:03``
_TIMEDELTA = re.compile(r"^(?:(-?\d+) days?, )?(\d+):(\d\d):(\d\d(?:\.\d+)?)$")


def when(t: datetime | None) -> str:
    """A time (naive: UTC) as the command line's tables show times: local, to the ms."""
    if t is None:
        return "-"
    from txmq.spark.common import ms

    return ms_time(ms(t))


def age_span(text: Any) -> Any:
    """A row's ``age`` (``str(timedelta)``: ``1:01:00``) as a span (``1.02 h``); anything
    else as it is."""
    m = _TIMEDELTA.match(text) if isinstance(text, str) else None
    if m is None:
        return text
    days, h, mins, s = m.groups()
    return span(timedelta(days=int(days or 0), hours=int(h), minutes=int(mins), seconds=float(s)))


@dataclass
class Result:
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    facts: dict[str, Any]
    out: str
    seconds: float
    #: the run's cut ("as of"), window and SLA, for the printed summary (None: the facts'
    #: text is printed)
    now: datetime | None = None
    since: datetime | None = None
    until: datetime | None = None
    sla: timedelta | None = None

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    def summary(self) -> str:
        from txmq.observability.fmt import format_table
        from txmq.spark.classify import CLASSES, columns

        f = self.facts
        window = (
            f"{when(self.since) if self.since else 'beginning'} .. "
            f"{when(self.until) if self.until else 'end'}"
            if self.now is not None
            else f["window"]
        )
        sla = span(self.sla) if self.sla is not None else f["sla"]
        now = when(self.now) if self.now is not None else f["now"]
        lines = [
            f"reconciled {f['transactions']} transactional sends, {f['outbox_rows']} outbox "
            f"rows and {f['messages']} committed messages in "
            f"{span(timedelta(seconds=self.seconds))}",
            f"window: {window}; SLA {sla}; as of {now}",
            "expected consumers: "
            + (", ".join(f"{g} <- {t}" for g, t in f["expected"]) or "(none)"),
            f"messages waiting in retry topics: {f['retrying']}",
        ]
        evidence = f.get("evidence") or {}
        if evidence:
            lines.append(
                "evidence of consumption: "
                + "; ".join(f"{g}: {e}" for g, e in sorted(evidence.items()))
            )
        if f.get("sagas") or f.get("saga_participants"):
            served = f.get("saga_participants") or {}
            lines.append(
                f"sagas judged: {f.get('sagas', 0)}; participant databases: "
                + ("; ".join(f"{s}: {', '.join(d)}" for s, d in served.items()) or "(none)")
            )
        stores = f.get("stores", {})
        if len(stores) > 1:
            lines += [
                "broker stores: " + ", ".join(f"{n} ({p})" for n, p in stores.items()),
                "messages stored on more than one broker set (a send retried on another: one "
                f"message, and no anomaly of itself): {f.get('multi_stored', 0)}",
            ]
        lines.append("")
        lines.append(format_table([{"class": c, "count": self.counts[c]} for c in CLASSES]))
        for c, n in f.get("truncated", {}).items():
            lines.append(f"{c}: the table holds the first {n:,} of {self.counts[c]:,} (--max-rows)")
        for c in CLASSES:
            if self.examples[c]:
                lines += ["", f"{c} (first {len(self.examples[c])}):"]
                cols = [x for x in columns(c) if x not in ("anomaly", "db", "participant_db")]
                lines.append(format_table([_shown(r) for r in self.examples[c]], cols))
        lines += [
            "",
            "nothing needs attention"
            if self.ok
            else f"needs attention: {sum(self.counts.values())} anomalies; Parquet tables in "
            f"{self.out}/<class>",
        ]
        return "\n".join(lines)


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    """An example row as the summary's table shows it: its time and its age readable."""
    out = dict(row)
    if isinstance(out.get("at"), datetime):
        out["at"] = when(out["at"])
    if "age" in out:
        out["age"] = age_span(out["age"])
    return out


def example_rows(rows: Any, n: int) -> list[dict[str, Any]]:
    """The first ``n`` anomaly rows (by time, then ids), as dicts of plain values."""
    ids = [c for c in ("msg_id", "transaction_id", "saga_id") if c in rows.columns]
    first = rows.sort_values(["at", *ids], na_position="first").head(n)
    out = []
    for r in first.drop(columns="anomaly").to_dict("records"):
        at = r["at"]
        r["at"] = None if at is None or at != at else at.tz_convert(None).to_pydatetime()
        out.append({k: None if _missing(v) else v for k, v in r.items()})
    return out


def _missing(value: Any) -> bool:
    """A null as pandas has it (None, NaN, pd.NA)."""
    import pandas as pd  # type: ignore[import-untyped]

    return value is None or (not isinstance(value, list | dict | str) and bool(pd.isna(value)))
