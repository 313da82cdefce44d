"""What the producer databases' transaction logs (``txmq_transaction_log``) say about the
half messages a page shows, for ``txmq console --db URL``: COMMITTED (the local
transaction committed: COMMIT is right), ROLLED_BACK (a check-back found it had not), or
no row (it has not committed, or the transaction is not this database's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio

__all__ = ["LogState", "log_states"]

#: transaction ids asked per query
_CHUNK = 500


@dataclass(frozen=True)
class LogState:
    #: the database (its URL, password hidden)
    database: str
    #: COMMITTED, ROLLED_BACK, or "" (no row)
    state: str


def _shown(url: str) -> str:
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a database URL)"


def _read(url: str, ids: Sequence[str]) -> dict[str, str]:
    from sqlalchemy import Connection, select

    from txmq.sqla.db import with_connection
    from txmq.sqla.tables import transaction_log

    def query(conn: Connection) -> dict[str, str]:
        found: dict[str, str] = {}
        for at in range(0, len(ids), _CHUNK):
            chunk = list(ids[at : at + _CHUNK])
            rows = conn.execute(
                select(transaction_log.c.transaction_id, transaction_log.c.state).where(
                    transaction_log.c.transaction_id.in_(chunk)
                )
            )
            found.update({str(tid): str(state) for tid, state in rows})
        return found

    return with_connection(url, query)


async def log_states(
    urls: Sequence[str], ids: Sequence[str]
) -> tuple[dict[str, list[LogState]], list[str]]:
    """Per transaction id, what each database's log says (only databases that answered);
    and one line per database that could not be read."""
    from sqlalchemy.exc import SQLAlchemyError

    from txmq.sqla.db import describe_db_error

    wanted = sorted({i for i in ids if i})
    states: dict[str, list[LogState]] = {i: [] for i in wanted}
    errors: list[str] = []
    if not wanted:
        return states, errors
    for url in urls:
        try:
            found = await anyio.to_thread.run_sync(_read, url, wanted)
        except SQLAlchemyError as exc:
            errors.append(describe_db_error(exc, url))
            continue
        shown = _shown(url)
        for tid in wanted:
            states[tid].append(LogState(shown, found.get(tid, "")))
    return states, errors
