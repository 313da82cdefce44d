"""Helpers for the outbox and idempotent-consumer tests: databases (PostgreSQL schema or
SQLite file) with txmq's tables and an ``effects`` table, and reading a topic back."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
)

from tests.sqla_support import pg_schema
from txmq import PullConsumer
from txmq.outbox import async_url
from txmq.protocol.message import MessageExt, Prop
from txmq.sqla import metadata as txmq_metadata
from txmq.sqla.tables import outbox as outbox_table

effects_metadata = MetaData()
effects = Table(
    "effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),  # deliberately not unique: twice is visible
    Column("body", String(255), nullable=False),
)


@dataclass
class Db:
    backend: str
    url: str  # sync driver
    engine: Engine

    @property
    def aurl(self) -> str:
        return async_url(self.url).render_as_string(hide_password=False)

    def effects(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(select(effects.c.key, effects.c.body))]

    def outbox_rows(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            q = select(outbox_table).order_by(outbox_table.c.id)
            return [dict(r._mapping) for r in conn.execute(q)]

    def count(self, **where: Any) -> int:
        with self.engine.connect() as conn:
            q = select(func.count()).select_from(outbox_table)
            for name, value in where.items():
                q = q.where(outbox_table.c[name] == value)
            return int(conn.execute(q).scalar_one())


@contextmanager
def make_db(backend: str, tmp_path: Path) -> Iterator[Db]:
    """A database with txmq's tables and ``effects``: a fresh PostgreSQL schema (skips
    when the server is unreachable) or a new SQLite file."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / f'db-{uuid.uuid4().hex[:8]}.db'}"
        with _db(backend, url) as db:
            yield db
    else:
        with pg_schema() as url, _db(backend, url) as db:
            yield db


@contextmanager
def _db(backend: str, url: str) -> Iterator[Db]:
    engine = create_engine(url)
    with engine.begin() as conn:
        txmq_metadata.create_all(conn)
        effects_metadata.create_all(conn)
    try:
        yield Db(backend, url, engine)
    finally:
        engine.dispose()


async def read_topic(address: str, topic: str) -> list[MessageExt]:
    """Every message stored in ``topic``, queue by queue, each queue in offset order."""
    out: list[MessageExt] = []
    async with PullConsumer(address, f"reader-{uuid.uuid4().hex[:8]}") as consumer:
        for q in await consumer.queues(topic):
            offset, end = 0, await consumer.max_offset(topic, q)
            while offset < end:
                res = await consumer.pull(topic, q, offset, max_msgs=256, long_poll=0)
                out.extend(res.messages)
                if res.next_offset <= offset:
                    break
                offset = res.next_offset
    return out


def by_key(msgs: list[MessageExt]) -> dict[str | None, list[str]]:
    """Bodies per sharding key, in the order the broker stored them."""
    out: dict[str | None, list[str]] = {}
    for m in msgs:
        out.setdefault(m.get_property(Prop.SHARDING_KEY), []).append(m.body.decode())
    return out


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Poll a sync or async predicate until truthy (deadline ``timeout`` seconds)."""
    with anyio.fail_after(timeout):
        while True:
            value = predicate()
            if hasattr(value, "__await__"):
                value = await value
            if value:
                return value
            await anyio.sleep(0.05)
