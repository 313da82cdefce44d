"""The transactional outbox with a real broker and real databases (PostgreSQL and SQLite):
rows commit or roll back with the caller's session, the relay sends them in order per key
with stable message ids, wakes on NOTIFY, parks a poison row while other keys flow,
survives a broker outage without spending attempts, reports lag and backlog, cleans up."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from sqlalchemy import create_engine, event, insert, text, update
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from tests.conftest import ROOT
from tests.outbox_support import Db, by_key, effects, make_db, read_topic, until
from tests.sqla_support import TRANSPORTS, start_broker
from txmq import AdminClient, Message, Producer, outbox
from txmq.broker.server import EmbeddedBroker
from txmq.outbox import async_url
from txmq.protocol.message import Prop
from txmq.protocol.wire.errors import InvalidTopic, NoPermission
from txmq.sqla.tables import outbox as outbox_table

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    with make_db(request.param, tmp_path) as d:
        yield d


def _add_rows(db: Db, topic: str, rows: list[tuple[str | None, str]]) -> list[str]:
    with Session(db.engine) as session, session.begin():
        return [
            outbox.add(session, Message(topic, body.encode()), sharding_key=key)
            for key, body in rows
        ]


async def add_rows(db: Db, topic: str, rows: list[tuple[str | None, str]]) -> list[str]:
    """The application's insert, in a worker thread: on SQLite a blocking insert on the
    event loop would wait for a lock held by a relay cycle that needs the loop to finish."""
    return await anyio.to_thread.run_sync(_add_rows, db, topic, rows)


async def test_add_commits_and_rolls_back_with_the_session(db: Db) -> None:
    with Session(db.engine) as session:
        with session.begin():
            session.execute(insert(effects).values(key="order-1", body="created"))
            msg_id = outbox.add(
                session,
                Message("orders", b"one", tags="created", properties={"a": "b"}),
                sharding_key="1",
            )
        with pytest.raises(RuntimeError), session.begin():
            session.execute(insert(effects).values(key="order-2", body="created"))
            outbox.add(session, Message("orders", b"two"), sharding_key="2")
            raise RuntimeError("declined")
    aengine = create_async_engine(db.aurl)
    try:
        async with AsyncSession(aengine) as asession:
            async with asession.begin():
                ids = await outbox.add_many_async(
                    asession, [Message("orders", b"three", keys=["k3"]), Message("orders", b"four")]
                )
            with pytest.raises(RuntimeError):
                async with asession.begin():
                    await outbox.add_async(asession, Message("orders", b"five"))
                    raise RuntimeError("declined")
    finally:
        await aengine.dispose()
    rows = db.outbox_rows()
    assert [r["body"] for r in rows] == [b"one", b"three", b"four"]
    assert [r["msg_id"] for r in rows] == [msg_id, *ids]
    assert rows[0]["state"] == "pending" and rows[0]["attempts"] == 0
    assert rows[0]["sharding_key"] == "1" and rows[0]["tags"] == "created"
    assert rows[0]["properties"] == {"a": "b"} and rows[0]["keys"] == msg_id  # keyless: its id
    assert rows[1]["keys"] == "k3"
    assert db.effects() == [("order-1", "created")]


async def test_add_refuses_what_the_broker_would(db: Db) -> None:
    aengine = create_async_engine(db.aurl)
    try:
        with Session(db.engine) as session:
            with pytest.raises(InvalidTopic):
                outbox.add(session, Message("%DLQ%x", b""))
            with pytest.raises(InvalidTopic):
                outbox.add(session, Message("bad topic", b""))
            with pytest.raises(ValueError, match="reserved"):
                outbox.add(session, Message("t", b"", properties={"KEYS": "x"}))
            with pytest.raises(ValueError, match="delay"):
                outbox.add(session, Message("t", b"", delay_level=3))
            with pytest.raises(TypeError, match="add_async"):
                outbox.add(AsyncSession(aengine), Message("t", b""))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="add\\(\\)"):
            await outbox.add_async(Session(db.engine), Message("t", b""))  # type: ignore[arg-type]
    finally:
        await aengine.dispose()
    assert db.outbox_rows() == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_relay_sends_in_order_per_key_with_stable_ids(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker], transport: str
) -> None:
    via = start_broker(embedded_broker, transport)
    b = via.broker
    rows = [(f"k{i % 3}", f"{i % 3}:{i // 3}") for i in range(30)] + [(None, "free")]
    ids = await add_rows(db, "ordered", rows)
    async with outbox.OutboxRelay(db.aurl, via.address, **via.kw) as relay:
        await until(lambda: db.count(state="sent") == 31)
        assert await relay.backlog() == 0 and await relay.lag_seconds() == 0.0
        assert relay.sent_total == 31
    msgs = await read_topic(b.address, "ordered")
    seen = by_key(msgs)
    for k in range(3):
        assert seen[f"k{k}"] == [f"{k}:{i}" for i in range(10)]
        assert len({m.queue_id for m in msgs if m.get_property(Prop.SHARDING_KEY) == f"k{k}"}) == 1
    assert seen[None] == ["free"]
    assert sorted(m.msg_id for m in msgs) == sorted(ids)  # the ids add() returned
    assert all(m.keys == [m.msg_id] for m in msgs)
    assert all(r["sent_at"] is not None for r in db.outbox_rows())


async def test_notify_wakes_the_relay_without_polling(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    if db.backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    b = embedded_broker()
    async with outbox.OutboxRelay(db.aurl, b.address, poll_interval=60) as relay:
        await until(lambda: relay.listening)
        await anyio.sleep(0.2)  # the first cycle (after LISTEN) is over: it waits now
        start = time.monotonic()
        await add_rows(db, "woken", [("k", "x")])
        await until(lambda: db.count(state="sent") == 1, timeout=5)
        assert time.monotonic() - start < 2.0  # far below the 60 s poll


async def test_a_relay_stopped_at_any_moment_closes_its_listen_connection(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """Stopped while its LISTEN connection connects, runs LISTEN or waits for NOTIFYs,
    the relay closes that connection (left open, psycopg warns when the garbage collector
    finds it: "connection ... was deleted while still open")."""
    if db.backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    b = embedded_broker()
    rng = random.Random(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(40):
            async with outbox.OutboxRelay(db.aurl, b.address, poll_interval=60):
                await anyio.sleep(rng.uniform(0, 0.03))
        gc.collect()
    left_open = [str(w.message) for w in caught if "deleted while still open" in str(w.message)]
    assert not left_open, f"{len(left_open)} of 40: {left_open[0]}"


class PoisonProducer(Producer):
    """Refuses any message whose body is b"poison", as a broker refusing it would."""

    async def send(self, msg: Message, **kwargs: Any) -> Any:
        if msg.body == b"poison":
            raise NoPermission("refused: poison")
        return await super().send(msg, **kwargs)

    async def send_batch(self, msgs: Any, **kwargs: Any) -> Any:
        if any(m.body == b"poison" for m in msgs):
            raise NoPermission("refused: poison in batch")
        return await super().send_batch(msgs, **kwargs)


async def test_poison_row_is_parked_after_n_attempts_while_other_keys_flow(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker()
    behind = [("bad", f"after{i}") for i in range(20)]  # a backlog behind the poison row,
    await add_rows(db, "poisoned", [("bad", "before"), ("bad", "poison"), *behind])  # > a window
    await add_rows(db, "poisoned", [("good", f"g{i}") for i in range(5)] + [("bad", "last")])
    async with PoisonProducer(b.address) as producer:
        relay = outbox.OutboxRelay(
            db.aurl, producer, max_attempts=3, backoff=0.3, poll_interval=0.05, batch_size=4
        )
        async with relay:
            # the good key is all sent while the poison row still waits for attempt 2
            await until(lambda: db.count(state="sent") == 6)
            poison = next(r for r in db.outbox_rows() if r["body"] == b"poison")
            assert poison["state"] == "pending" and 1 <= poison["attempts"] < 3
            # more rows of other keys keep flowing during its backoff
            await add_rows(db, "poisoned", [("good", "g5"), ("other", "o0")])
            await until(lambda: db.count(state="sent") == 8, timeout=5)
            await until(lambda: db.count(state="parked") == 1)
            await until(lambda: db.count(state="sent") == 29)  # then its key moves on
            assert relay.parked_total == 1
            assert (await relay.stats()).parked == 1
    poison = next(r for r in db.outbox_rows() if r["body"] == b"poison")
    assert poison["state"] == "parked" and poison["attempts"] == 3
    assert "NoPermission: refused: poison" in poison["last_error"]
    seen = by_key(await read_topic(b.address, "poisoned"))
    assert seen["bad"] == ["before", *(body for _, body in behind), "last"]
    assert seen["good"] == [f"g{i}" for i in range(6)]
    with db.engine.connect() as conn:
        listed = outbox.parked(conn)
        assert [p["id"] for p in listed] == [poison["id"]]
        assert outbox.requeue(conn) == 1
        conn.commit()  # parked() began a transaction: requeue() joined it
    row = next(r for r in db.outbox_rows() if r["body"] == b"poison")
    assert row["state"] == "pending" and row["attempts"] == 0


async def test_a_topic_the_broker_refuses_is_parked_and_others_flow(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker(auto_create_topic=False)
    async with AdminClient(b.address) as admin:
        await admin.create_topic("exists", 2)
    await add_rows(db, "missing", [("k", "m1"), (None, "m2")])
    await add_rows(db, "exists", [("k2", "e1"), (None, "e2")])
    async with outbox.OutboxRelay(db.aurl, b.address, max_attempts=2, backoff=0.05):
        await until(lambda: db.count(state="parked") == 2 and db.count(state="sent") == 2)
    assert {r["body"]: r["state"] for r in db.outbox_rows()} == {
        b"m1": "parked",
        b"m2": "parked",
        b"e1": "sent",
        b"e2": "sent",
    }
    assert all("TopicNotFound" in (r["last_error"] or "") for r in db.outbox_rows()[:2])


async def test_broker_outage_costs_no_attempts(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    b = embedded_broker()
    address = b.address
    await add_rows(db, "outage", [("k", "before")])
    async with outbox.OutboxRelay(db.aurl, address, max_attempts=2, poll_interval=0.05) as relay:
        await until(lambda: db.count(state="sent") == 1)
        b.stop()
        await add_rows(db, "outage", [("k", "during1"), ("k", "during2")])
        added = time.monotonic()
        cycles = relay.cycles
        await until(lambda: relay.cycles >= cycles + 3, timeout=10)  # against a dead broker
        assert relay.failed_total == 0
        rows = db.outbox_rows()
        assert [(r["state"], r["attempts"]) for r in rows[1:]] == [("pending", 0)] * 2
        waited = time.monotonic() - added  # the rows are at least this old
        assert await relay.backlog() == 2 and await relay.lag_seconds() >= waited - 0.01


async def test_retention_cleanup_and_delete_on_send(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker()
    await add_rows(db, "kept", [("k", "a"), ("k", "b")])
    async with outbox.OutboxRelay(db.aurl, b.address, retention=timedelta(hours=1)):
        await until(lambda: db.count(state="sent") == 2)
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    if db.backend == "sqlite":
        long_ago = long_ago.replace(tzinfo=None)
    with db.engine.begin() as conn:
        first = conn.execute(outbox_table.select().order_by(outbox_table.c.id)).first()
        assert first is not None
        conn.execute(
            update(outbox_table).where(outbox_table.c.id == first.id).values(sent_at=long_ago)
        )
    with db.engine.connect() as conn:
        assert outbox.cleanup(conn, timedelta(hours=1)) == 1
    assert [r["body"] for r in db.outbox_rows()] == [b"b"]
    await add_rows(db, "kept", [("k", "c")])
    async with outbox.OutboxRelay(db.aurl, b.address, retention=timedelta(0)):
        await until(lambda: db.count(state="pending") == 0)
    assert [r["body"] for r in db.outbox_rows()] == [b"b"]  # "c" deleted on send
    assert by_key(await read_topic(b.address, "kept"))["k"] == ["a", "b", "c"]


def test_sync_relay_and_cli(db: Db, embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    b = embedded_broker()
    _add_rows(db, "synced", [("k", "a"), (None, "b")])
    with outbox.sync.OutboxRelay(db.url, b.address, poll_interval=0.05) as relay:
        deadline = time.monotonic() + 20
        while relay.backlog() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.backlog() == 0 and relay.lag_seconds() == 0.0
        assert relay.stats().sent == 2
    with db.engine.begin() as conn:
        conn.execute(update(outbox_table).values(state="parked", last_error="x", attempts=9))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "txmq.cli", "outbox", *args, "--db", db.url],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    r = cli("stats")
    assert r.returncode == 0 and "PARKED" in r.stdout, r.stderr
    r = cli("stats", "--json")
    assert '"parked": 2' in r.stdout and '"backlog": 0' in r.stdout, r.stdout
    r = cli("parked")
    assert r.returncode == 0 and r.stdout.count("synced") == 2, r.stdout
    first = db.outbox_rows()[0]["id"]
    r = cli("requeue", "--id", str(first))
    assert "requeued 1 " in r.stdout, r.stderr
    r = cli("requeue", "--all")
    assert "requeued 1 " in r.stdout, r.stderr
    assert db.count(state="pending") == 2
    r = cli("cleanup", "--older-than-hours", "1")
    assert r.returncode == 0 and "deleted 0 " in r.stdout, r.stderr


async def test_relay_refuses_a_database_it_cannot_use(
    tmp_path: Path, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """At start, with one clear line naming the URL the user gave (password hidden), not
    a retry loop printing SQL: no txmq_outbox table yet, or no server."""
    b = embedded_broker()
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    with pytest.raises(outbox.OutboxNotReady) as info:
        await outbox.OutboxRelay(empty, b.address).start()
    assert str(info.value) == (
        f"{empty} has no txmq_outbox table: run 'txmq db upgrade --url {empty}' "
        "(or txmq.sqla.upgrade) first"
    )
    nowhere = "postgresql+psycopg://app:secret@127.0.0.1:1/orders"
    with pytest.raises(outbox.OutboxNotReady, match=r"cannot connect to .*app:\*\*\*@127"):
        await outbox.OutboxRelay(nowhere, b.address).start()
    with anyio.fail_after(60):
        r = await anyio.run_process(
            [
                sys.executable,
                "-m",
                "txmq.cli",
                "outbox",
                "relay",
                "--db",
                empty,
                "--broker",
                b.address,
            ],
            cwd=ROOT,
            check=False,
        )
    assert r.returncode == 1 and r.stdout == b"", r
    assert r.stderr.decode().strip() == f"txmq: error: {info.value}"


async def test_relay_rides_out_its_database_connections_being_killed(
    tmp_path: Path, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """PostgreSQL: every connection of a running relay (pool and LISTEN) is terminated by
    the server; the relay reconnects, listens again and sends what was added meanwhile."""
    b = embedded_broker()
    with make_db("postgresql", tmp_path) as db:
        name = f"txmq-relay-{id(db):x}"
        relay_url = async_url(db.url).update_query_dict({"application_name": name})
        async with outbox.OutboxRelay(relay_url, b.address) as relay:
            await add_rows(db, "killed", [("k", "before")])
            await until(lambda: db.count(state="sent") == 1 and relay.listening)
            with db.engine.begin() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :name"
                    ),
                    {"name": name},
                ).scalar_one()
            assert killed >= 2  # the LISTEN connection and the pool's
            await until(lambda: not relay.listening, timeout=10)
            await add_rows(db, "killed", [("k", "after1"), ("k", "after2")])
            await until(lambda: db.count(state="sent") == 3 and relay.listening)
        assert by_key(await read_topic(b.address, "killed"))["k"] == ["before", "after1", "after2"]


class StalledProducer(Producer):
    """Sends wait while ``stalled`` is set: a broker that has stopped answering."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stalled = False
        self.waiting = anyio.Event()
        self.resume = anyio.Event()

    async def _stall(self) -> None:
        if self.stalled:
            self.waiting.set()
            await self.resume.wait()

    async def send(self, msg: Message, **kwargs: Any) -> Any:
        await self._stall()
        return await super().send(msg, **kwargs)

    async def send_batch(self, msgs: Any, **kwargs: Any) -> Any:
        await self._stall()
        return await super().send_batch(msgs, **kwargs)


async def test_a_stalled_broker_never_holds_up_the_applications_writes(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """While the relay waits on the broker, the application keeps committing its own
    transactions (with outbox rows) at once: the relay holds no lock on SQLite (its
    claim is a lease in a short transaction) and none that inserts wait for on
    PostgreSQL. A crash while sending is covered by the lease (see the crash tests)."""
    b = embedded_broker()
    # a write that waits on a lock fails instead: SQLite after 0.5 s busy, PostgreSQL after
    # 2 s lock_timeout (a time bound would fail on a loaded machine, a lock wait not)
    quick = create_engine(db.url, connect_args={"timeout": 0.5} if db.backend == "sqlite" else {})
    try:
        async with StalledProducer(b.address) as producer:
            relay = outbox.OutboxRelay(db.aurl, producer, poll_interval=0.02)
            async with relay:
                await add_rows(db, "stalled", [("k", "first")])
                await until(lambda: db.count(state="sent") == 1)
                producer.stalled = True
                try:
                    await add_rows(db, "stalled", [("k", "second")])
                    with anyio.fail_after(10):
                        await producer.waiting.wait()  # the relay is inside a send now

                    def during() -> None:
                        with Session(quick) as session, session.begin():
                            if db.backend == "postgresql":
                                session.execute(text("SET LOCAL lock_timeout = '2s'"))
                            for i in range(3):
                                body = f"during{i}".encode()
                                outbox.add(session, Message("stalled", body), sharding_key="k")

                    await anyio.to_thread.run_sync(during)  # no lock to wait for: no error
                    assert db.count(state="pending") == 4
                finally:
                    producer.stalled = False
                    producer.resume.set()  # else stopping the relay waits for the stalled send
                await until(lambda: db.count(state="sent") == 5)
    finally:
        quick.dispose()
    stored = by_key(await read_topic(b.address, "stalled"))
    assert stored["k"] == ["first", "second", "during0", "during1", "during2"]


async def test_the_relays_commits_do_not_wait_for_the_disk_the_applications_do(
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL a lost mark only means a re-send, so the relay commits without
    waiting for the disk: its own engine's connections say so once; on an engine it is
    given (the application's), each cycle says it for its own transaction only."""
    b = embedded_broker()
    with make_db("postgresql", tmp_path) as db:
        await add_rows(db, "fast-commits", [("k", "1")])
        async with outbox.OutboxRelay(db.aurl, b.address) as relay:
            await until(lambda: db.count(state="sent") == 1)
            async with relay.engine.connect() as conn:
                assert (await conn.execute(text("SHOW synchronous_commit"))).scalar() == "off"
        given = create_async_engine(db.aurl)
        seen: list[str] = []
        event.listen(
            given.sync_engine, "before_cursor_execute", lambda *a: seen.append(a[2]), named=False
        )
        # (on psycopg, the cycle's statements go on the driver's own connection, pipelined)
        execute = psycopg.AsyncConnection.execute

        def spied(self: psycopg.AsyncConnection[Any], query: Any, *args: Any, **kw: Any) -> Any:
            seen.append(str(query))
            return execute(self, query, *args, **kw)

        monkeypatch.setattr(psycopg.AsyncConnection, "execute", spied)
        try:
            await add_rows(db, "fast-commits", [("k", "2")])
            async with outbox.OutboxRelay(given, b.address):
                await until(lambda: db.count(state="sent") == 2)
            async with given.connect() as conn:  # the application's: as the server says
                assert (await conn.execute(text("SHOW synchronous_commit"))).scalar() == "on"
        finally:
            await given.dispose()
        assert any(s == "SET LOCAL synchronous_commit TO OFF" for s in seen), seen
