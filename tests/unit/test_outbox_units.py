"""Outbox and idempotent-consumer pieces that need no server: batching runs, backoff,
async URLs, the stable message id, the lazy ``txmq.idempotent``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from txmq.outbox import OutboxRelay, Row, async_url
from txmq.outbox.claim import backoff_delay
from txmq.outbox.relay import MAX_BATCH_BYTES, MAX_BATCH_MESSAGES, _message, _runs
from txmq.protocol.message import Prop


def row(i: int, topic: str = "t", body: bytes = b"x", key: str | None = "k") -> Row:
    return Row(i, f"ID{i}", topic, key, None, None, None, body, 0)


def test_runs_split_on_topic_count_and_size() -> None:
    rows = [row(1), row(2), row(3, "u"), row(4)]
    assert [[r.id for r in run] for run in _runs(rows)] == [[1, 2], [3], [4]]
    many = [row(i) for i in range(MAX_BATCH_MESSAGES + 1)]
    assert [len(run) for run in _runs(many)] == [MAX_BATCH_MESSAGES, 1]
    big = [row(i, body=b"x" * (MAX_BATCH_BYTES // 2 + 1)) for i in range(3)]
    assert [len(run) for run in _runs(big)] == [1, 1, 1]
    assert list(_runs([])) == []


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_async_url() -> None:
    assert async_url("sqlite:///a.db").drivername == "sqlite+aiosqlite"
    assert async_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert async_url("postgresql+psycopg://u@h/d?options=x").query == {"options": "x"}
    assert async_url("sqlite+aiosqlite:///a.db").drivername == "sqlite+aiosqlite"
    with pytest.raises(ValueError, match="no async driver"):
        async_url("postgresql+psycopg2://u@h/d")


def test_the_message_keeps_the_rows_id() -> None:
    r = Row(7, "FIXEDID", "orders", "k", "created", "a b", {"p": "v"}, b"body", 2)
    msg = _message(r)
    props = msg.wire_properties("A-FRESH-ID-THE-PRODUCER-MADE")
    assert props[Prop.UNIQ_KEY] == "FIXEDID" and props[Prop.SHARDING_KEY] == "k"
    assert props[Prop.KEYS] == "a b" and props[Prop.TAGS] == "created" and props["p"] == "v"
    assert msg.body == b"body" and msg.topic == "orders"


def test_relay_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        OutboxRelay("sqlite:///x.db", "127.0.0.1:1", batch_size=0)
    with pytest.raises(ValueError, match="max_attempts"):
        OutboxRelay("sqlite:///x.db", "127.0.0.1:1", max_attempts=0)
    with pytest.raises(ValueError, match="claim_lease"):
        OutboxRelay("sqlite:///x.db", "127.0.0.1:1", claim_lease=0)


def test_importing_txmq_does_not_import_sqlalchemy() -> None:
    code = (
        "import sys, txmq; assert 'sqlalchemy' not in sys.modules; "
        "f = txmq.idempotent; assert 'sqlalchemy' in sys.modules; "
        "from txmq import idempotent; assert idempotent is f; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.strip() == "ok", r.stderr
