"""The txmq command: broker start/stop and the admin views, as a person would run them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from tests.conftest import ROOT, BrokerProcess, read_line, wait_for
from txmq import outbox
from txmq.observability.fmt import ms_time
from txmq.protocol.message import Message
from txmq.sqla.db import with_connection
from txmq.sync import Producer, PullConsumer


def txmq(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "txmq.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=check,
    )


def admin_json(address: str, *args: str) -> Any:
    return json.loads(txmq("admin", "--broker", address, "--json", *args).stdout)


def test_admin_views(broker_process: Callable[..., BrokerProcess]) -> None:
    bp = broker_process().start()
    with Producer(bp.address) as p:
        r = p.send(Message("cli-topic", b"hello cli", tags="t1", keys=["order-1"]), queue_id=2)
        p.send(Message("cli-topic", b"second", keys=["order-1"]), queue_id=2)
    with PullConsumer(bp.address, "cli-group") as c:
        c.commit_offset("cli-topic", 2, 1)

    topics = {t["topic"]: t for t in admin_json(bp.address, "topics")}
    assert topics["cli-topic"]["queue_nums"] == 4 and topics["cli-topic"]["messages"] == 2
    stats = admin_json(bp.address, "topic-stats", "cli-topic")
    assert [(q["queue_id"], q["max_offset"]) for q in stats] == [(0, 0), (1, 0), (2, 2), (3, 0)]
    [found] = admin_json(bp.address, "message", "--id", r.msg_id)
    assert found["body"] == "hello cli" and found["tags"] == "t1" and found["queue_offset"] == 0
    by_key = admin_json(bp.address, "message", "--key", "order-1")
    assert sorted(m["body"] for m in by_key) == ["hello cli", "second"]
    [off] = admin_json(bp.address, "offsets")
    assert (off["group"], off["offset"], off["max_offset"], off["lag"]) == ("cli-group", 1, 2, 1)
    created = admin_json(bp.address, "topic-create", "wide", "--queues", "16")
    assert created == [{"topic": "wide", "queue_nums": 16}]

    table = txmq("admin", "--broker", bp.address, "topics").stdout
    assert table.splitlines()[0].split() == ["TOPIC", "QUEUE_NUMS", "MESSAGES", "SYSTEM"]
    missing = txmq("admin", "--broker", bp.address, "message", "--id", "NOPE", check=False)
    assert missing.returncode == 1 and "no message with id 'NOPE'" in missing.stderr
    assert bp.terminate() == 0
    assert "received SIGTERM" in bp.output() and "broker stopped" in bp.output()


def test_clear_errors_for_bad_configuration_and_unreachable_broker(tmp_path: Any) -> None:
    bad = tmp_path / "b.toml"
    bad.write_text("[broker]\nflush = 'sometimes'\n")
    out = txmq("broker", "start", "--store", str(tmp_path / "s"), "--config", str(bad), check=False)
    assert out.returncode == 1 and "flush" in out.stderr and "Traceback" not in out.stderr
    out = txmq("admin", "--broker", "127.0.0.1:1", "topics", check=False)
    assert out.returncode == 1 and "cannot connect to broker 127.0.0.1:1" in out.stderr


@pytest.mark.parametrize("flag", ["--help"])
def test_help(flag: str) -> None:
    assert "broker" in txmq(flag).stdout


def test_options_work_before_and_after_the_subcommand(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    with Producer(bp.address) as p:
        p.send(Message("either-side", b"x"))
    orders = [
        ("admin", "topics", "--json", "--broker", bp.address),
        ("admin", "--json", "topics", "--broker", bp.address),
        ("admin", "--broker", bp.address, "--json", "topics"),
        ("--log-level", "WARNING", "admin", "topics", "--broker", bp.address, "--json"),
        ("admin", "topics", "--broker", bp.address, "--json", "--log-level", "WARNING"),
    ]
    for args in orders:
        topics = {t["topic"] for t in json.loads(txmq(*args).stdout)}
        assert "either-side" in topics, args
    parked = json.loads(txmq("admin", "transactions", "--parked", "--broker", bp.address,
                             "--json").stdout)  # fmt: skip
    assert parked == []


def _outbox_row(url: str, body: bytes) -> None:
    """A row in the outbox, added as an application adds it."""
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            outbox.add(session, Message("outbox-either-side", body))
    finally:
        engine.dispose()


def test_outbox_options_work_before_and_after_the_subcommand(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    bp = broker_process().start()
    url = f"sqlite:///{tmp_path}/app.db"
    txmq("db", "upgrade", "--url", url)
    _outbox_row(url, b"waiting")
    for args in [
        ("outbox", "stats", "--db", url, "--json"),
        ("outbox", "--db", url, "stats", "--json"),
        ("outbox", "--json", "stats", "--db", url),
        ("outbox", "--db", url, "--json", "stats", "--log-level", "WARNING"),
        ("--log-level", "WARNING", "outbox", "--url", url, "stats", "--json"),
    ]:
        assert json.loads(txmq(*args).stdout)["backlog"] == 1, args
    assert json.loads(txmq("outbox", "--db", url, "--json", "parked").stdout) == []
    assert json.loads(txmq("outbox", "parked", "--max", "5", "--json", "--db", url).stdout) == []
    said = txmq("outbox", "--db", url, "requeue", "--all").stdout
    assert said.strip() == "requeued 0 parked row(s)"
    said = txmq("outbox", "--db", url, "cleanup", "--older-than-hours", "2").stdout
    assert said.strip() == "deleted 0 sent outbox row(s) older than 2 h"
    # the relay: where it sends (--broker) and its database (--db) on either side
    relays = [
        ("outbox", "relay", "--db", url, "--broker", bp.address),
        ("outbox", "--broker", bp.address, "relay", "--db", url),
        ("outbox", "--db", url, "relay", "--broker", bp.address, "--stats-interval", "0"),
        ("outbox", "--db", url, "--broker", bp.address, "relay", "--log-level", "WARNING"),
    ]
    for sent, args in enumerate(relays, 1):
        if sent > 1:
            _outbox_row(url, b"row %d" % sent)
        proc = subprocess.Popen(
            [sys.executable, "-m", "txmq.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            started = read_line(proc, "txmq outbox relay:")
            assert started.endswith(f"-> {bp.address} (polling every 0.1 s)"), (args, started)

            def all_sent(count: int = sent) -> bool:
                stats = with_connection(url, outbox.stats)
                return stats.sent == count and stats.backlog == 0

            wait_for(all_sent, timeout=30)
        finally:
            proc.terminate()
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
    # --db is still required, and --json is for the commands that print rows
    missing = txmq("outbox", "stats", "--json", check=False)
    assert missing.returncode == 2 and "--db" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
    misplaced = txmq("outbox", "--json", "--db", url, "requeue", "--all", check=False)
    assert misplaced.returncode == 2 and "--json" in misplaced.stderr, misplaced.stderr


def test_first_contact_mistakes_get_one_line_each(
    broker_process: Callable[..., BrokerProcess], tmp_path: Any
) -> None:
    bp = broker_process(store=tmp_path / "running").start()
    port = bp.address.rsplit(":", 1)[1]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (("broker", "start", "--store", str(tmp_path / "s2"), "--port", port), "already in use"),
        (("broker", "start", "--store", str(tmp_path / "running"), "--port", "0"), "in use by"),
        (("broker", "start", "--store", str(a_file), "--port", "0"), "is a file"),
        (("db", "upgrade", "--url", "mysql://app@127.0.0.1/orders"), "no database driver"),
        (("outbox", "stats", "--db", f"sqlite:///{tmp_path}/app.db"), "txmq db upgrade --url"),
        (("quickstart", "--messages", "0"), "less than 1"),
        (("quickstart", "--messages", "-3"), "less than 1"),
    ]
    for args, text in cases:
        out = txmq(*args, check=False)
        said = [line for line in out.stderr.splitlines() if " INFO " not in line]
        errors = [line for line in said if "error:" in line]  # argparse adds a usage line
        assert out.returncode in (1, 2) and len(said) <= 2, (args, said)
        assert len(errors) == 1 and text in errors[0] and "Traceback" not in out.stderr, said
    still = txmq("admin", "topics", "--broker", bp.address)  # the running broker is untouched
    assert still.returncode == 0


@pytest.mark.parametrize("count", [1, 7, 8])
def test_quickstart_works_for_few_messages(count: int) -> None:
    out = txmq("quickstart", "--messages", str(count))
    assert "result:   OK" in out.stdout


def test_admin_shows_times_people_can_read(broker_process: Callable[..., BrokerProcess]) -> None:
    bp = broker_process().start()
    with Producer(bp.address) as p:
        r = p.send(Message("times", b"when?", keys=["t-1"]), queue_id=1)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"

    shown = txmq("admin", "message", "--id", r.msg_id, "--broker", bp.address).stdout
    fields = dict(re.findall(r"^ *(\w+): ?(.*)$", shown, re.MULTILINE))
    assert fields["store_time"] == ms_time(r.store_timestamp), shown
    assert re.fullmatch(stamp, fields["born_time"]), shown
    assert not any(re.fullmatch(r"\d{13}", v) for v in fields.values()), shown  # no raw epoch ms

    [found] = admin_json(bp.address, "message", "--key", "t-1")
    assert found["store_timestamp"] == r.store_timestamp  # the number stays, for scripts
    when = datetime.fromisoformat(found["store_time"])
    assert when.utcoffset() == timedelta(0) and round(when.timestamp() * 1000) == r.store_timestamp

    stats = txmq("admin", "topic-stats", "times", "--broker", bp.address).stdout.splitlines()
    assert stats[0].split() == ["QUEUE_ID", "MIN_OFFSET", "MAX_OFFSET", "LAST_STORE_TIME"]
    by_queue = {line.split()[0]: line for line in stats[2:]}
    assert by_queue["1"].endswith(ms_time(r.store_timestamp)) and by_queue["0"].endswith("-")
    [q0, q1, *_] = admin_json(bp.address, "topic-stats", "times")
    assert q0["last_store_ts"] == 0 and q0["last_store_time"] is None
    assert datetime.fromisoformat(q1["last_store_time"]).timestamp() * 1000 == q1["last_store_ts"]


def test_cleanup_says_its_span_in_the_unit_it_was_given(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/app.db"
    txmq("db", "upgrade", "--url", url)
    said = {
        days: txmq("db", "cleanup", "--url", url, "--older-than-days", days).stdout.strip()
        for days in ("7", "0.5", "1")
    }
    assert said == {
        "7": "deleted 0 transaction-log row(s) older than 7 days",
        "0.5": "deleted 0 transaction-log row(s) older than 12 h",
        "1": "deleted 0 transaction-log row(s) older than 1 day",
    }
    keys = txmq("db", "cleanup", "--url", url, "--table", "consumed-keys").stdout
    assert keys.strip() == "deleted 0 consumed key(s) older than 7 days"
    sent = txmq("outbox", "cleanup", "--db", url).stdout
    assert sent.strip() == "deleted 0 sent outbox row(s) older than 1 day"
    negative = txmq("db", "cleanup", "--url", url, "--older-than-days", "-1", check=False)
    assert negative.returncode == 2 and "less than 0" in negative.stderr


def test_broker_start_says_where_its_default_store_is(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXMQ_BROKER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "txmq.cli", "broker", "start", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    )
    try:
        said = read_line(proc, "txmq broker: store")
        read_line(proc, "txmq broker listening on")
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert str(tmp_path / "txmq-store") in said and "the default" in said, said
    assert "--store DIR" in said, said
    assert (tmp_path / "txmq-store").is_dir()
