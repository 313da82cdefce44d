"""The outbox relay: sends outbox rows to the broker, at least once, in order per key.

::

    async with OutboxRelay("postgresql+psycopg://app@db/orders", "127.0.0.1:10911") as relay:
        ...                       # relays in the background until the block ends
        print(await relay.lag_seconds(), await relay.backlog())

or ``txmq outbox relay --db URL --broker HOST:PORT``. Several relays may run at once:
each cycle claims whole sharding keys (see :mod:`outbox.claim`: row locks on PostgreSQL,
a lease on SQLite), so no row is sent by two relays at a time and a key's order holds.
The relay never holds a lock that the application's own writes would wait for while it
talks to the broker. (One relay is all SQLite needs.)

A relay wakes on PostgreSQL ``LISTEN txmq_outbox`` (``outbox.add`` notifies at commit),
and polls every ``poll_interval`` seconds besides (only polls on SQLite). It sends the
rows of all keys that hash to one queue in one ``send_batch`` (in ``id`` order, so each
key's order holds), the queues concurrently, then marks them sent (on PostgreSQL in the
transaction that claimed them; on SQLite in a second one, the claim being a lease): a
crash between the send and the mark sends them again — consumers deduplicate on the
message id, which stays the same (``txmq.idempotent``). A row whose send fails is
retried with exponential backoff; after ``max_attempts`` failures it is *parked* and the
rows after it in its key go on (its key's order is broken at that row, as RocketMQ moves
on to the next message after the last retry). A broker outage (unreachable, timeout,
busy) costs no attempts: the relay waits.

Order holds per sharding key *within a topic* (a key's rows of one topic land on one
queue, in ``id`` order), as RocketMQ orders per queue; rows without a key go in any order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Self

import anyio
from sqlalchemy import Engine, event, inspect, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from txmq.client.producer import Producer, QueueOptions
from txmq.client.route import Route
from txmq.observability import hooks as observe
from txmq.outbox.claim import ASYNC_COMMIT, Outcome, Pipelined, Row, claim, mark
from txmq.outbox.store import CHANNEL, OutboxStats, cleanup, pending_lag, stats
from txmq.protocol.message import FixedIdMessage, MessageQueue, Prop, stable_hash
from txmq.protocol.wire.errors import (
    BrokerBusy,
    BrokerUnavailable,
    FlushDiskTimeout,
    RequestTimeout,
    TopicNotFound,
    TxmqError,
)
from txmq.sqla.db import async_url, describe_db_error
from txmq.sqla.tables import outbox as outbox_table
from txmq.transports.port import Transport

__all__ = ["OUTAGE_ERRORS", "OutboxNotReady", "OutboxRelay"]

log = logging.getLogger("txmq.outbox")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    BrokerUnavailable,
    RequestTimeout,
    BrokerBusy,
    FlushDiskTimeout,
)
"""Errors that say the broker, not the row, is the problem: no attempt is counted."""


class OutboxNotReady(TxmqError):
    """The relay's database is unreachable, or has no ``txmq_outbox`` table yet."""


MAX_BATCH_MESSAGES = 256
MAX_BATCH_BYTES = 1024 * 1024


@dataclass(slots=True)
class _OutboxMessage(FixedIdMessage):
    """A message that keeps the id fixed when the row was added, on every (re-)send, and
    says its sharding key (the relay picks the key's queue itself)."""

    sharding_key: str | None = None

    def wire_properties(self, msg_id: str) -> dict[str, str]:
        props = FixedIdMessage.wire_properties(self, msg_id)
        if self.sharding_key is not None:
            props[Prop.SHARDING_KEY] = self.sharding_key
        return props


def _async_commits(dbapi_connection: Any, _record: Any) -> None:
    """A new connection of the relay's own engine: its commits do not wait for the disk."""
    cursor = dbapi_connection.cursor()
    cursor.execute(f"SET {ASYNC_COMMIT}")
    cursor.close()
    dbapi_connection.commit()  # a session setting, kept past the pool's rollback


def _message(row: Row) -> _OutboxMessage:
    return _OutboxMessage(
        row.topic,
        row.body,
        row.tags,
        row.keys or (),
        dict(row.properties or {}),
        fixed_id=row.msg_id,
        sharding_key=row.sharding_key,
    )


class OutboxRelay:
    """Sends the outbox of one database to one broker. See the module documentation.

    ``db``: a database URL, an :class:`AsyncEngine` or an :class:`Engine` (its URL is used
    with the async driver). ``broker``: a broker address (the relay runs its own
    producer) or a started :class:`txmq.Producer`; or ``namesrv``: name servers, for a
    cluster (a sharding key's rows go to the key's queue of the whole route, in order).

    ``batch_size`` rows per cycle; ``max_attempts`` failed sends before a row is parked;
    ``backoff`` / ``max_backoff`` seconds between a failed row's attempts (doubling);
    ``poll_interval`` seconds between polls (default 1 s with LISTEN on PostgreSQL, 0.1 s on
    SQLite); ``retention``: sent rows are deleted this long after being sent (checked
    every ``cleanup_interval`` seconds); ``retention=timedelta(0)`` deletes rows as they
    are sent instead of marking them. ``claim_lease`` (SQLite only, seconds): how long the
    rows of a cycle are claimed while the relay sends them without holding the database's
    lock; rows of a relay that died while sending are sent again after it (make it longer
    than a cycle's sends can take: the producer's send timeout and retries).
    ``transport``: of the relay's own producer (default ``$TXMQ_TRANSPORT``): ``"grpc"``
    sends to a RocketMQ 5 endpoint at ``broker`` (a sharding key becomes the message group,
    so the endpoint keeps a key's rows in one queue, in order).  ``metrics_interval``:
    seconds between readings of the backlog, lag and parked rows into the client metrics
    (:meth:`update_metrics`; 0: none).  Each row's send continues the trace that was current
    when it was added (see :mod:`txmq.observability.hooks`).  ``cycles_in_flight``
    (PostgreSQL; SQLite runs one): how many cycles may be in flight at once — claims are
    taken one at a time, and the next one starts as soon as the last has its rows, while
    those are sent and marked (a key's rows are still sent by one cycle at a time: its
    head's row lock).
    """

    def __init__(
        self,
        db: str | URL | AsyncEngine | Engine,
        broker: str | Producer | None = None,
        *,
        batch_size: int = 500,
        max_attempts: int = 10,
        backoff: float = 0.5,
        max_backoff: float = 60.0,
        poll_interval: float | None = None,
        listen: bool = True,
        retention: timedelta = timedelta(days=1),
        cleanup_interval: float = 60.0,
        send_concurrency: int = 16,
        producer_group: str = "txmq-outbox-relay",
        claim_lease: float = 30.0,
        namesrv: str | Sequence[str] | None = None,
        transport: str | Transport | None = None,
        metrics_interval: float = 5.0,
        cycles_in_flight: int = 2,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if cycles_in_flight < 1:
            raise ValueError("cycles_in_flight must be at least 1")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if retention < timedelta(0):
            raise ValueError("retention must not be negative")
        if not claim_lease > 0:
            raise ValueError("claim_lease must be positive")
        self.claim_lease = timedelta(seconds=claim_lease)
        if isinstance(db, AsyncEngine):
            self.engine, self._own_engine = db, False
            given: str | URL = db.url
        else:
            given = db.url if isinstance(db, Engine) else db
            self.engine, self._own_engine = create_async_engine(async_url(given)), True
        self.shown_url = make_url(given).render_as_string(hide_password=True)
        """The database URL as given (password hidden), for messages."""
        self.dialect = self.engine.dialect.name
        if self.dialect not in ("postgresql", "sqlite"):
            raise ValueError(f"the outbox relay supports postgresql and sqlite, not {self.dialect}")
        #: PostgreSQL: the relay's commits do not wait for the disk (claim.ASYNC_COMMIT): on
        #: its own engine's connections once, as they connect; else in each cycle
        self._async_commit_each_cycle = self.dialect == "postgresql" and not self._own_engine
        if self.dialect == "postgresql" and self._own_engine:
            event.listen(self.engine.sync_engine, "connect", _async_commits)
        if isinstance(broker, Producer):
            if namesrv or transport:
                raise ValueError("give a started producer, or name servers / a transport")
            self.producer, self._own_producer = broker, False
        else:
            producer = Producer(broker, producer_group, namesrv=namesrv, transport=transport)
            self.producer, self._own_producer = producer, True
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.listen = listen and self.dialect == "postgresql"
        if poll_interval is None:
            poll_interval = 1.0 if self.listen else 0.1
        self.poll_interval = poll_interval
        self.retention = retention
        self.cleanup_interval = cleanup_interval
        self.send_concurrency = send_concurrency
        self.metrics_interval = metrics_interval
        # counters since start
        self.sent_total = 0
        self.failed_total = 0
        self.parked_total = 0
        self.cycles = 0
        self.listening = False
        """True while the LISTEN connection is up (PostgreSQL)."""
        self.cycles_in_flight = cycles_in_flight if self.dialect == "postgresql" else 1
        self._wake = anyio.Event()
        #: wake() calls so far, and what it was when the latest claim began: a worker woken
        #: by a notification that a later claim has covered goes back to waiting
        self._notified = 0
        self._claimed_at = 0
        #: claims begun so far (a cycle that saw another begin while it was in flight claims
        #: again at once: that one skipped the keys it held)
        self._claims = 0
        self._claiming = anyio.Lock()
        #: the cycle's statements for psycopg's own connection (False: the engine's
        #: connections are not psycopg's to PostgreSQL; None: not known yet)
        self._pipelined: Pipelined | Literal[False] | None = None
        self._limiter = anyio.CapacityLimiter(max(1, send_concurrency))
        self._lifetime: asyncio.Task[None] | None = None
        self._stop: anyio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start relaying in the background (any task may call :meth:`stop` later)."""
        if self._lifetime is not None:
            return
        try:
            await self._check_database()
            if self._own_producer:
                await self.producer.start()
        except BaseException:
            if self._own_engine:
                await self.engine.dispose()
            raise
        started = anyio.Event()
        stop = self._stop = anyio.Event()

        async def lifetime() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.run)
                    started.set()
                    await stop.wait()
                    tg.cancel_scope.cancel()
            finally:
                started.set()

        self._lifetime = asyncio.get_running_loop().create_task(lifetime())
        await started.wait()

    async def _check_database(self) -> None:
        """Fail at start, with a clear message, on a database the relay cannot use; once
        running, the relay rides out a database outage (it retries every cycle)."""
        try:
            async with self.engine.connect() as conn:
                has = await conn.run_sync(lambda c: inspect(c).has_table(outbox_table.name))
        except SQLAlchemyError as exc:
            raise OutboxNotReady(describe_db_error(exc, self.shown_url)) from None
        if not has:
            raise OutboxNotReady(
                f"{self.shown_url} has no {outbox_table.name} table: run "
                f"'txmq db upgrade --url {self.shown_url}' (or txmq.sqla.upgrade) first"
            )

    async def stop(self) -> None:
        """Stop relaying (after the cycle in flight, if any)."""
        task, self._lifetime = self._lifetime, None
        try:
            if task is not None:
                if self._stop is not None:
                    self._stop.set()
                await task
        finally:
            if self._own_producer:
                await self.producer.stop()
            if self._own_engine:
                await self.engine.dispose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- metrics -------------------------------------------------------------------------

    async def lag_seconds(self) -> float:
        """Age of the oldest unsent row, in seconds (0 when the outbox is drained)."""
        async with self.engine.connect() as conn:
            return (await conn.run_sync(pending_lag))[1]

    async def backlog(self) -> int:
        """How many rows wait to be sent (including rows backing off)."""
        async with self.engine.connect() as conn:
            return (await conn.run_sync(pending_lag))[0]

    async def stats(self) -> OutboxStats:
        """Backlog, lag, parked and sent rows."""
        async with self.engine.connect() as conn:
            return await conn.run_sync(stats)

    async def update_metrics(self) -> OutboxStats:
        """Read the outbox's backlog, lag and parked rows into the client metrics
        (``txmq_outbox_backlog_rows``, ``txmq_outbox_lag_seconds``,
        ``txmq_outbox_parked_rows``; see :mod:`txmq.observability.hooks`); the relay does it every
        ``metrics_interval`` seconds while it runs."""
        now = await self.stats()
        observe.outbox_stats(now.backlog, now.lag_seconds, now.parked)
        return now

    async def _metrics_loop(self) -> None:
        while True:
            try:
                with anyio.CancelScope(shield=True):
                    await self.update_metrics()
            except SQLAlchemyError as exc:
                log.debug("outbox metrics not read: %s", self._short(exc))
            await anyio.sleep(self.metrics_interval)

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Relay until cancelled (the producer must be started)."""
        async with anyio.create_task_group() as tg:
            if self.listen:
                tg.start_soon(self._listen_loop)
            if self.retention > timedelta(0) and self.cleanup_interval > 0:
                tg.start_soon(self._cleanup_loop)
            if self.metrics_interval > 0 and observe.metrics() is not None:
                tg.start_soon(self._metrics_loop)
            await self._relay_loop()

    async def _relay_loop(self) -> None:
        """``cycles_in_flight`` workers (PostgreSQL; one on SQLite), each claiming, sending and
        marking; claims are taken one at a time, so a free worker claims the rows that
        arrived since the last claim while earlier cycles still send theirs."""
        async with anyio.create_task_group() as tg:
            for _ in range(self.cycles_in_flight):
                tg.start_soon(self._worker)

    async def _worker(self) -> None:
        outage_delay = error_delay = 0.0
        polled = True  # the first cycle claims whatever is there
        while True:
            try:
                # a cycle in flight finishes before the relay stops (its sends are bounded
                # by the producer's timeout): cancelling a database driver mid-statement
                # may leave its connection behind
                with anyio.CancelScope(shield=True):
                    outcome = await self._cycle(polled)
            except Exception as exc:
                error_delay = min(10.0, max(1.0, error_delay * 2))
                log.warning(
                    "outbox cycle failed (%s); retrying in %.0f s", self._short(exc), error_delay
                )
                await anyio.sleep(error_delay)
                polled = True
                continue
            error_delay = 0.0
            if outcome.outage is not None:
                outage_delay = min(10.0, max(0.2, outage_delay * 2))
                log.warning(
                    "broker unavailable (%s); outbox relay waits %.1f s",
                    outcome.outage,
                    outage_delay,
                )
                await anyio.sleep(outage_delay)
                polled = True
                continue
            outage_delay = 0.0
            if outcome.more:
                polled = True  # there may be more right away
                continue
            polled = await self._idle()

    async def _idle(self) -> bool:
        """Wait for a notification no claim has covered yet (False), or for the poll
        interval to pass (True: claim whatever is due)."""
        with anyio.move_on_after(self.poll_interval):
            while self._notified <= self._claimed_at:
                await self._wake.wait()
            return False
        return True

    async def relay_once(self) -> Outcome:
        """One cycle: claim, send, mark, commit. Returns what happened."""
        return await self._cycle(polled=True)

    async def _cycle(self, polled: bool) -> Outcome:
        """:meth:`relay_once`; unless not ``polled`` (woken by a notification) and a claim
        begun since the notification has covered it: then nothing."""
        async with self.engine.connect() as conn:
            # psycopg on PostgreSQL: the cycle's statements on its own connection, pipelined
            on = await self._pipelined_driver(conn)
            async with self._claiming:
                if not polled and self._notified <= self._claimed_at:
                    return Outcome()
                # a notification from now on may be for rows this claim does not see
                self._claimed_at = self._notified
                self._claims += 1
                claims = self._claims
                t0 = time.perf_counter()
                if on is not None:
                    rows = await on[0].claim(on[1])
                else:
                    rows = await conn.run_sync(claim, self.batch_size, self.claim_lease)
            if not rows:
                await (on[1].rollback() if on is not None else conn.rollback())
                return Outcome()
            t1 = time.perf_counter()
            outcome = await self._send(rows)
            t2 = time.perf_counter()
            await self._finish(conn, on, outcome, rows)
        t3 = time.perf_counter()
        # claim again at once: a full batch, a failure (retried or parked, the key's next
        # row may go), or another claim begun meanwhile (it skipped the keys held here)
        outcome.more = (
            len(rows) >= self.batch_size or bool(outcome.failed) or self._claims != claims
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "cycle: %d rows (%d keys); claim %.1f ms, send %.1f ms, mark+commit %.1f ms",
                len(rows),
                len({r.sharding_key for r in rows}),
                (t1 - t0) * 1000,
                (t2 - t1) * 1000,
                (t3 - t2) * 1000,
            )
        self.cycles += 1
        self.sent_total += len(outcome.sent)
        self.failed_total += len(outcome.failed)
        return outcome

    async def _pipelined_driver(self, conn: AsyncConnection) -> tuple[Pipelined, Any] | None:
        """The cycle's statements and psycopg's own connection under ``conn``, when the
        cycle can use them (see :class:`outbox.claim.Pipelined`), else None."""
        if self._pipelined is None:
            sync = conn.sync_connection
            assert sync is not None
            usable = Pipelined.usable(sync)
            self._pipelined = Pipelined(self.engine.dialect, self.batch_size) if usable else False
        if self._pipelined is False:
            return None
        raw = await conn.get_raw_connection()
        return self._pipelined, raw.driver_connection

    async def _finish(
        self,
        conn: AsyncConnection,
        on: tuple[Pipelined, Any] | None,
        outcome: Outcome,
        rows: list[Row],
    ) -> None:
        """Mark what became of the cycle's ``rows`` and commit: pipelined ``on`` psycopg's
        connection under ``conn`` (None: through SQLAlchemy) unless a row failed."""
        if on is not None and not outcome.failed:
            pipelined, driver = on
            await pipelined.finish(
                driver,
                outcome.sent,
                delete_sent=self.retention == timedelta(0),
                async_commit=self._async_commit_each_cycle,
            )
            return
        await self._mark(conn, outcome, rows)  # (in the transaction the driver began)
        await conn.commit()

    async def _mark(self, conn: AsyncConnection, outcome: Outcome, rows: list[Row]) -> None:
        """Write the outcome of sending ``rows`` (committed by the caller)."""
        parked = await conn.run_sync(
            mark,
            outcome,
            max_attempts=self.max_attempts,
            backoff=self.backoff,
            max_backoff=self.max_backoff,
            delete_sent=self.retention == timedelta(0),
            claimed=rows,
            async_commit=self._async_commit_each_cycle,
        )
        for row, exc in outcome.failed:
            if row.id in parked:
                log.error(
                    "outbox row %d (%s, key %r) parked after %d attempts: %s",
                    row.id,
                    row.topic,
                    row.sharding_key,
                    row.attempts + 1,
                    exc,
                )
            else:
                log.warning("outbox row %d: send failed (%s); will retry", row.id, exc)
        self.parked_total += len(parked)

    # -- sending -------------------------------------------------------------------------

    async def _send(self, rows: list[Row]) -> Outcome:
        """Send the cycle's rows: one batch per (topic, queue) — a key's rows all go to its
        queue, in order — the groups concurrently. A key stops at its first failure."""
        outcome = Outcome()
        groups: dict[tuple[str, MessageQueue | None], list[Row]] = {}
        routes: dict[str, Route | Exception] = {}
        stopped: set[str | None] = set()
        for row in rows:
            queue: MessageQueue | None = None
            if row.sharding_key is not None:
                if row.sharding_key in stopped:
                    continue
                if row.topic not in routes:
                    try:
                        routes[row.topic] = await self.producer.route(row.topic, create=True)
                    except OUTAGE_ERRORS as exc:
                        outcome.outage = exc
                        return outcome
                    except Exception as exc:  # e.g. the broker refuses the topic
                        routes[row.topic] = exc
                route = routes[row.topic]
                if isinstance(route, Exception):
                    self._failed(row, route, stopped, outcome)
                    continue
                queues = route.write_queues
                if not queues:
                    no_queue = TopicNotFound(f"topic {row.topic!r} has no writable queue")
                    self._failed(row, no_queue, stopped, outcome)
                    continue
                # the producer's own rule for a sharding key: one queue of the whole route
                queue = queues[stable_hash(row.sharding_key) % len(queues)]
            groups.setdefault((row.topic, queue), []).append(row)
        async with anyio.create_task_group() as tg:
            for (_, queue), group in groups.items():
                tg.start_soon(self._send_group, queue, group, outcome)
        return outcome

    async def _send_group(
        self, queue: MessageQueue | None, rows: list[Row], outcome: Outcome
    ) -> None:
        stopped: set[str | None] = set()  # keys that failed: their later rows wait
        async with self._limiter:
            for run in _runs(rows):
                run = [r for r in run if r.sharding_key is None or r.sharding_key not in stopped]
                if outcome.outage is not None:
                    return
                if not run:
                    continue
                try:
                    if len(run) == 1:
                        await self.producer.send(_message(run[0]), **self._to(queue))
                    else:
                        await self.producer.send_batch(
                            [_message(r) for r in run], **self._to(queue)
                        )
                except OUTAGE_ERRORS as exc:
                    outcome.outage = exc
                    return
                except Exception as exc:
                    if len(run) == 1:
                        self._failed(run[0], exc, stopped, outcome)
                    else:
                        await self._one_by_one(run, queue, stopped, outcome)
                    continue
                outcome.sent.extend(r.id for r in run)

    async def _one_by_one(
        self,
        run: list[Row],
        queue: MessageQueue | None,
        stopped: set[str | None],
        outcome: Outcome,
    ) -> None:
        """A batch failed: send its rows singly, to find the one(s) that fail."""
        for row in run:
            if row.sharding_key is not None and row.sharding_key in stopped:
                continue
            try:
                await self.producer.send(_message(row), **self._to(queue))
            except OUTAGE_ERRORS as exc:
                outcome.outage = exc
                return
            except Exception as exc:
                self._failed(row, exc, stopped, outcome)
                continue
            outcome.sent.append(row.id)

    @staticmethod
    def _failed(row: Row, exc: Exception, stopped: set[str | None], outcome: Outcome) -> None:
        outcome.failed.append((row, exc))
        if row.sharding_key is not None:
            stopped.add(row.sharding_key)

    # -- waking and cleaning -------------------------------------------------------------

    def _to(self, queue: MessageQueue | None) -> QueueOptions:
        """Send options for a sharding key's queue (None: the producer picks one).  Over
        gRPC the endpoint picks it: by the key, sent as the message group."""
        if not self.producer.carrier.full_protocol:
            return {}
        return _to(queue)

    def wake(self) -> None:
        """Start the next cycle now (what a NOTIFY does): an idle worker claims (each
        notification makes one claim, however many workers it wakes)."""
        self._notified += 1
        self._wake.set()
        self._wake = anyio.Event()

    def _short(self, exc: BaseException) -> str:
        """One line for a cycle's error (a database error without its SQL statement)."""
        if isinstance(exc, DBAPIError):
            return describe_db_error(exc, self.shown_url)
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__

    async def _listen_loop(self) -> None:
        import psycopg

        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        delay = 0.5
        while True:
            try:
                # shielded: a connection made as the relay stops is still closed below
                # (cancelled inside connect(), psycopg would leave it open)
                with anyio.CancelScope(shield=True), anyio.fail_after(30):
                    aconn = await psycopg.AsyncConnection.connect(
                        *cargs, **cparams, autocommit=True
                    )
                try:
                    await aconn.execute(f"LISTEN {CHANNEL}")
                    self.listening, delay = True, 0.5
                    self.wake()  # rows may have arrived while nobody listened
                    async for _ in aconn.notifies():
                        self.wake()
                finally:
                    # shielded: the relay's stop cancels this task, and anyio re-raises the
                    # cancellation at every await inside it — an unshielded close was cut
                    # short and left the connection open (a ResourceWarning at collection)
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        await aconn.close()
            except Exception as exc:
                log.warning("outbox LISTEN connection lost (%s); polling meanwhile", exc)
            finally:
                self.listening = False
            await anyio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def _cleanup_loop(self) -> None:
        while True:
            try:
                with anyio.CancelScope(shield=True):
                    async with self.engine.connect() as conn:
                        deleted = await conn.run_sync(cleanup, self.retention)
                if deleted:
                    log.info("outbox: deleted %d row(s) sent over %s ago", deleted, self.retention)
            except SQLAlchemyError as exc:
                log.warning("outbox cleanup failed: %s", self._short(exc))
            await anyio.sleep(self.cleanup_interval)


def _to(queue: MessageQueue | None) -> QueueOptions:
    """Send options for a sharding key's queue (None: the producer picks one)."""
    if queue is None:
        return {}
    return {"queue_id": queue.queue_id, "broker_name": queue.broker_name}


def _runs(rows: list[Row]) -> Iterator[list[Row]]:
    """Consecutive rows of one topic, as batches within the broker's limits."""
    run: list[Row] = []
    size = 0
    for row in rows:
        if run and (
            row.topic != run[0].topic
            or len(run) >= MAX_BATCH_MESSAGES
            or size + len(row.body) > MAX_BATCH_BYTES
        ):
            yield run
            run, size = [], 0
        run.append(row)
        size += len(row.body)
    if run:
        yield run
