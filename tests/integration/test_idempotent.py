"""Idempotent consumers (txmq.idempotent) on PostgreSQL and SQLite, sync and async: the
dedupe key commits with the handler's writes or not at all; duplicates are skipped and
acknowledged; racing consumers apply a message once; mark mode for outside effects;
retention of old keys."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import txmq
from tests.conftest import ROOT
from tests.outbox_support import Db, effects, make_db
from txmq import ConsumeResult, MessageExt
from txmq.sqla.inbox import cleanup_consumed_keys, default_key
from txmq.sqla.tables import consumed_keys

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    with make_db(request.param, tmp_path) as d:
        yield d


def message(body: str, keys: str | None = None, msg_id: str = "MSG1") -> MessageExt:
    props = {"UNIQ_KEY": msg_id}
    if keys:
        props["KEYS"] = keys
    return MessageExt("t", body.encode(), 0, 0, 0, 0, 0, 0, all_properties=props)


def key_rows(db: Db) -> list[tuple[str, str, str]]:
    with db.engine.connect() as conn:
        t = consumed_keys
        q = select(t.c.consumer_group, t.c.key, t.c.state).order_by(t.c.key)
        return [tuple(r) for r in conn.execute(q)]


class Flaky:
    """A handler body that fails (raises, or asks for later) the first times."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def next(self) -> Any:
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_default_key() -> None:
    assert default_key(message("x", keys="order-1-paid order-1")) == "order-1-paid"
    assert default_key(message("x", msg_id="ABC")) == "ABC"


async def test_transaction_mode_sync(db: Db) -> None:
    flaky = Flaky(RuntimeError("db write failed"), ConsumeResult.RECONSUME_LATER)
    skipped: list[tuple[str, str]] = []

    @txmq.idempotent(
        db.engine, group="billing", on_duplicate=lambda m, k: skipped.append((m.msg_id, k))
    )
    def apply(msg: MessageExt, session: Session) -> Any:
        key = default_key(msg)
        session.execute(insert(effects).values(key=key, body=msg.body.decode()))
        return flaky.next()

    with pytest.raises(RuntimeError):
        apply(message("a", "k1"))
    assert db.effects() == [] and key_rows(db) == []  # both rolled back
    assert apply(message("a", "k1")) is ConsumeResult.RECONSUME_LATER
    assert db.effects() == [] and key_rows(db) == []
    assert apply(message("a", "k1")) is ConsumeResult.SUCCESS
    assert skipped == []
    again = message("a again", "k1")
    assert apply(again) is ConsumeResult.SUCCESS  # duplicate: skipped
    assert skipped == [(again.msg_id, "k1")]
    assert apply(message("b", msg_id="M2")) is ConsumeResult.SUCCESS  # no keys: the id
    assert db.effects() == [("k1", "a"), ("M2", "b")]
    assert key_rows(db) == [("billing", "M2", "done"), ("billing", "k1", "done")]
    assert flaky.calls == 4
    assert apply.__name__ == "apply"


async def test_transaction_mode_async_with_a_long_key(db: Db) -> None:
    aengine = create_async_engine(db.aurl)
    flaky = Flaky(RuntimeError("boom"))
    long_key = "x" * 300

    @txmq.idempotent(aengine, key=lambda m: m.body.decode())
    async def apply(msg: MessageExt, session: AsyncSession) -> None:
        await session.execute(insert(effects).values(key="k", body=msg.body.decode()[:10]))
        flaky.next()

    try:
        with pytest.raises(RuntimeError):
            await apply(message(long_key))
        assert await apply(message(long_key)) is ConsumeResult.SUCCESS
        assert await apply(message(long_key)) is ConsumeResult.SUCCESS
    finally:
        await aengine.dispose()
    assert db.effects() == [("k", "x" * 10)]
    [(group, key, state)] = key_rows(db)
    assert group.endswith("test_transaction_mode_async_with_a_long_key.<locals>.apply")
    assert key.startswith("sha256:") and state == "done"


def run_mark_flavour(db: Db, flavour: str, handler_body: Any, **options: Any) -> Any:
    """A mark-mode listener (sync or async flavour) whose handler calls handler_body(msg)."""
    if flavour == "sync":

        @txmq.idempotent(db.engine, group="mailer", mode="mark", expiry=30, **options)
        def send_mail(msg: MessageExt) -> Any:
            return handler_body(msg)

        async def call(msg: MessageExt) -> Any:
            return send_mail(msg)

        return call, None
    aengine = create_async_engine(db.aurl)

    @txmq.idempotent(aengine, group="mailer", mode="mark", expiry=30, **options)
    async def send_mail_async(msg: MessageExt) -> Any:
        return handler_body(msg)

    return send_mail_async, aengine


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_mark_mode(db: Db, flavour: str) -> None:
    sent: list[str] = []
    flaky = Flaky(RuntimeError("smtp down"), False)

    def body(msg: MessageExt) -> Any:
        result = flaky.next()
        sent.append(msg.body.decode())
        return result

    skipped: list[str] = []
    listener, aengine = run_mark_flavour(
        db, flavour, body, on_duplicate=lambda m, k: skipped.append(k)
    )
    try:
        with pytest.raises(RuntimeError):
            await listener(message("mail-1", "m1"))
        assert key_rows(db) == []  # the mark was released: retry at once
        assert await listener(message("mail-1", "m1")) is ConsumeResult.RECONSUME_LATER
        assert key_rows(db) == []
        assert await listener(message("mail-1", "m1")) is ConsumeResult.SUCCESS
        assert key_rows(db) == [("mailer", "m1", "done")]
        assert skipped == []
        assert await listener(message("mail-1 again", "m1")) is ConsumeResult.SUCCESS
        assert skipped == ["m1"]
        assert sent == ["mail-1", "mail-1"]  # the failing call raised before appending
        # someone else's valid mark: later, without running; once expired: taken over
        soon = datetime.now(UTC) + timedelta(seconds=30)
        past = datetime.now(UTC) - timedelta(seconds=1)
        if db.backend == "sqlite":
            soon, past = soon.replace(tzinfo=None), past.replace(tzinfo=None)
        with db.engine.begin() as conn:
            conn.execute(
                insert(consumed_keys).values(
                    consumer_group="mailer", key="m2", state="consuming", expires_at=soon
                )
            )
        assert await listener(message("mail-2", "m2")) is ConsumeResult.RECONSUME_LATER
        assert sent == ["mail-1", "mail-1"]
        with db.engine.begin() as conn:
            conn.execute(
                update(consumed_keys).values(expires_at=past).where(consumed_keys.c.key == "m2")
            )
        assert await listener(message("mail-2", "m2")) is ConsumeResult.SUCCESS
        assert sent[-1] == "mail-2"
        assert key_rows(db) == [("mailer", "m1", "done"), ("mailer", "m2", "done")]
    finally:
        if aengine is not None:
            await aengine.dispose()


async def test_binding_must_match_the_handler(db: Db) -> None:
    aengine = create_async_engine(db.aurl)
    try:
        with pytest.raises(TypeError, match="async def with an AsyncEngine"):

            @txmq.idempotent(aengine)
            def sync_handler(msg: MessageExt, session: Session) -> None: ...

        with pytest.raises(TypeError, match="async def with an AsyncEngine"):

            @txmq.idempotent(db.engine)
            async def async_handler(msg: MessageExt, session: AsyncSession) -> None: ...

        with pytest.raises(ValueError, match="mode"):
            txmq.idempotent(db.engine, mode="exactly-once")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="expiry"):
            txmq.idempotent(db.engine, mode="mark", expiry=0)
    finally:
        await aengine.dispose()


def age_keys(engine: Engine, hours: float) -> None:
    long_ago = datetime.now(UTC) - timedelta(hours=hours)
    if engine.dialect.name == "sqlite":
        long_ago = long_ago.replace(tzinfo=None)
    with engine.begin() as conn:
        conn.execute(
            update(consumed_keys)
            .where(consumed_keys.c.key.like("old%"))
            .values(created_at=long_ago)
        )


def test_retention_cleanup(db: Db) -> None:
    @txmq.idempotent(db.engine, group="g1")
    def apply(msg: MessageExt, session: Session) -> None: ...

    @txmq.idempotent(db.engine, group="g2")
    def apply2(msg: MessageExt, session: Session) -> None: ...

    for k in ("old1", "old2", "new1"):
        apply(message("x", k))
        apply2(message("x", k))
    age_keys(db.engine, 48)
    with db.engine.connect() as conn:
        assert cleanup_consumed_keys(conn, timedelta(days=1), group="g1") == 2
        assert cleanup_consumed_keys(conn, timedelta(days=1), batch_size=1) == 2
    assert {(g, k) for g, k, _ in key_rows(db)} == {("g1", "new1"), ("g2", "new1")}
    apply(message("x", "old3"))
    age_keys(db.engine, 48)
    r = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "db", "cleanup", "--url", db.url,
         "--table", "consumed-keys", "--older-than-days", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and "deleted 1 consumed key(s)" in r.stdout, r.stderr


async def test_two_engines_racing_on_one_key_apply_once(db: Db) -> None:
    """Two consumers' transactions on the same key at the same moment: the second waits
    for the first and then skips (PostgreSQL: the key's unique index; SQLite: the writer
    lock)."""
    aengine_a, aengine_b = create_async_engine(db.aurl), create_async_engine(db.aurl)
    inside = anyio.Event()

    def make(aengine: AsyncEngine, name: str) -> Any:
        @txmq.idempotent(aengine, group="race")
        async def apply(msg: MessageExt, session: AsyncSession) -> None:
            await session.execute(insert(effects).values(key=msg.keys[0], body=name))
            inside.set()
            await anyio.sleep(0.3)  # hold the transaction open while the other one tries

        return apply

    a, b = make(aengine_a, "a"), make(aengine_b, "b")
    results: list[ConsumeResult] = []
    try:
        async with anyio.create_task_group() as tg:

            async def run_b() -> None:
                await inside.wait()
                start = time.monotonic()
                results.append(await b(message("x", "k1")))
                assert time.monotonic() - start > 0.1  # it waited for a's transaction

            tg.start_soon(run_b)
            results.append(await a(message("x", "k1")))
    finally:
        await aengine_a.dispose()
        await aengine_b.dispose()
    assert results == [ConsumeResult.SUCCESS, ConsumeResult.SUCCESS]
    assert db.effects() == [("k1", "a")]
