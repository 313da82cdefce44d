"""The console's outbox, reconciliation, message-journey and queue-holder views, over HTTP
(Starlette's TestClient) against real broker processes, real SQLite outbox databases, a
real relay and real push consumers."""

from __future__ import annotations

import html
import json
import os
import re
import sqlite3
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BrokerProcess, free_port, wait_for
from tests.console.conftest import NO_EXTRA, ConsoleProcess, Seeded

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from txmq import ConsumeResult, Message, outbox
from txmq.console import ConsoleConfig, create_app
from txmq.console.reconcile_page import CLASSES
from txmq.protocol.message import MessageExt
from txmq.spark.job import Result
from txmq.sqla import metadata as txmq_metadata
from txmq.sqla.db import with_connection
from txmq.sync import AdminClient, Producer, PushConsumer

#: retries come back quickly (the first retry is level 3)
QUICK_LEVELS = "50ms 100ms 150ms 200ms 250ms 300ms 350ms 400ms"
EVIL_KEY = "<img src=x onerror=alert(1)>"


def token(client: TestClient) -> str:
    client.get("/cluster")
    value = client.cookies.get("txmq_csrf")
    assert value
    return value


def section(page: str, index: int) -> str:
    [found] = re.findall(rf'<section class="outbox" id="outbox-{index}".*?</section>', page, re.S)
    return str(found)


def cell(part: str, cls: str) -> str:
    [found] = re.findall(rf'<td class="{cls}[^"]*">(.*?)</td>', part, re.S)
    return str(found)


# -- the outbox -----------------------------------------------------------------------------


@pytest.fixture
def strict_broker(broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A broker that refuses topics nobody created (so an outbox row for one is parked)."""
    bp = broker_process()
    bp.env["TXMQ_BROKER_AUTO_CREATE_TOPIC"] = "false"
    bp.start()
    with AdminClient(bp.address) as admin:
        admin.create_topic("shipped", 1)
    return bp


def outbox_db(path: Path) -> str:
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    txmq_metadata.create_all(engine)
    engine.dispose()
    return url


def add_outbox_row(url: str, topic: str, body: bytes, key: str | None = None) -> str:
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            return outbox.add(session, Message(topic, body), sharding_key=key)
    finally:
        engine.dispose()


def test_outbox_page_shows_each_database_and_requeues_parked_rows(
    strict_broker: BrokerProcess, tmp_path: Path
) -> None:
    url = outbox_db(tmp_path / "orders.db")
    add_outbox_row(url, "nowhere", b"lost parcel", key=EVIL_KEY)
    add_outbox_row(url, "shipped", b"parcel 1", key="p1")
    # a real relay: the broker refuses "nowhere", so after its one attempt the row is parked
    with outbox.sync.OutboxRelay(url, strict_broker.address, max_attempts=1, backoff=0.05,
                                 poll_interval=0.05) as relay:  # fmt: skip
        wait_for(lambda: relay.stats().parked == 1 and relay.stats().sent == 1, timeout=20)
    add_outbox_row(url, "shipped", b"parcel 2", key="p2")  # a backlog: no relay runs now
    missing = tmp_path / "gone.db"
    bare = tmp_path / "bare.db"
    sqlite3.connect(bare).close()  # a database without txmq's tables
    dbs = [url, f"sqlite:///{missing}", f"sqlite:///{bare}"]
    app = create_app(ConsoleConfig(broker=strict_broker.address, dbs=dbs), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        page = web.get("/outbox")
        assert page.status_code == 200 and "Traceback" not in page.text
        orders = section(page.text, 0)
        assert "orders.db" in orders
        assert cell(orders, "backlog") == "1" and cell(orders, "parked-count") == "1"
        assert cell(orders, "sent") == "1" and cell(orders, "lag").endswith(" s")
        [row_id] = re.findall(r'<tr data-row-id="(\d+)">', orders)
        row = re.findall(r'<tr data-row-id="\d+">.*?</tr>', orders, re.S)[0]
        assert "nowhere" in row and "TopicNotFound" in row
        assert html.escape(EVIL_KEY, quote=True) in row and EVIL_KEY not in page.text
        # the databases that cannot be read each say why, and the others are still shown
        assert f"no such database file ({missing})" in section(page.text, 1)
        assert not missing.exists()  # the console did not create it
        assert "bare.db has no txmq tables yet" in section(page.text, 2)
        assert 'href="/outbox" class="here"' in page.text

        part = web.get("/outbox", params={"partial": "1"})
        assert part.status_code == 200 and "<html" not in part.text and "orders.db" in part.text

        form = {"db": "0", "id": row_id}
        assert web.post("/outbox/requeue", data={**form, "confirm": "yes"}).status_code == 403
        csrf = token(web)
        asked = web.post("/outbox/requeue", data={**form, "csrf_token": csrf})
        assert asked.status_code == 200 and f"Requeue parked row {row_id}" in asked.text
        assert 'name="confirm" value="yes"' in asked.text
        assert with_connection(url, outbox.stats).parked == 1  # asking changed nothing

        done = web.post("/outbox/requeue", data={**form, "csrf_token": csrf, "confirm": "yes"})
        assert done.status_code == 200 and "requeued 1 parked row(s) in" in done.text
        stats = with_connection(url, outbox.stats)
        assert (stats.parked, stats.backlog) == (0, 2)
        again = section(done.text, 0)
        assert "no parked rows" in again and cell(again, "backlog") == "2"

        # again: it is not parked any more; all of a database; a database it does not have
        again = web.post("/outbox/requeue", data={**form, "csrf_token": csrf, "confirm": "yes"})
        assert f"row {row_id} is not parked (any more)" in again.text
        every = {"db": "0", "all": "yes", "csrf_token": csrf, "confirm": "yes"}
        assert "no row is parked" in web.post("/outbox/requeue", data=every).text
        r = web.post("/outbox/requeue", data={**every, "db": "7"})
        assert r.status_code == 400 and "no database number 7" in r.text
        r = web.post("/outbox/requeue", data={**every, "db": "1"})
        assert r.status_code == 503 and "no such database file" in r.text
        assert not missing.exists()


def test_outbox_page_without_databases_says_how(tmp_path: Path) -> None:
    app = create_app(ConsoleConfig(broker=f"127.0.0.1:{free_port()}"), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        r = web.get("/outbox")
    assert r.status_code == 200 and "--db URL" in r.text


# -- the reconciliation report --------------------------------------------------------------


def write_summary(
    out: Path, counts: dict[str, int], examples: dict[str, list[dict[str, Any]]]
) -> None:
    """``summary.json`` as ``txmq reconcile`` writes it (spark/job.py ``run``: its Result,
    its facts, json.dumps with default=str)."""
    now = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)
    facts = {
        "transactions": 17,
        "outbox_rows": 4,
        "messages": 21,
        "multi_stored": 0,
        "retrying": 1,
        "expected": [("inventory", "order-created")],
        "window": "beginning .. end",
        "sla": str(timedelta(minutes=10)),
        "now": now.isoformat(timespec="seconds"),
        "master": "local[2]",
        "stores": {"broker-a": "/var/lib/txmq/store"},
        "consumed_keys": "about 12, broadcast",
        "seconds": {"store": 1.25, "transactions": 0.5, "write": 0.25},
        "truncated": {},
    }
    full = {c: examples.get(c, []) for c in CLASSES}
    result = Result({c: counts.get(c, 0) for c in CLASSES}, full, facts, str(out), 2.0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(
        json.dumps(
            {"ok": result.ok, "counts": result.counts, "facts": facts, "examples": full},
            default=str,
            indent=2,
        )
    )


def _example(**values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(
        ("group", "transaction_id", "msg_id", "topic", "key", "local_state", "broker_state",
         "detail", "db", "broker"),
        None,
    )  # fmt: skip
    row["at"] = datetime(2026, 11, 23, 9, 58, 1)
    return {**row, **values}


def test_the_console_classes_are_the_jobs() -> None:
    pytest.importorskip("pyspark", reason="the spark extra is not installed")
    from txmq.spark.classify import CLASSES as JOB_CLASSES

    assert CLASSES == JOB_CLASSES


def test_reconcile_page_shows_the_newest_report(
    tmp_path: Path, console_process: Callable[..., ConsoleProcess]
) -> None:
    reports = tmp_path / "reports"
    write_summary(reports / "monday", {}, {})
    parked = _example(
        transaction_id="T-P", msg_id="0A0B", topic="payments", local_state="COMMITTED",
        broker_state="PARKED", detail="decide COMMIT", key="<i>stuck</i>",
    )  # fmt: skip
    lost = _example(transaction_id="T-L", topic="orders", local_state="COMMITTED")
    write_summary(
        reports / "tuesday", {"parked": 1, "lost": 2}, {"parked": [parked], "lost": [lost]}
    )
    old = time.time() - 3600
    os.utime(reports / "monday" / "summary.json", (old, old))

    console = console_process("--broker", f"127.0.0.1:{free_port()}", "--reports", str(reports))
    with urllib.request.urlopen(console.url + "/reconcile", timeout=10) as r:
        page = r.read().decode()
    assert str(reports / "tuesday" / "summary.json") in page
    assert "Needs attention: 3 anomalies" in page
    rows = dict(re.findall(r'<tr data-class="(\w+)"><td>\w+</td><td class="\w+">(\d+)</td>', page))
    assert rows == {c: {"parked": "1", "lost": "2"}.get(c, "0") for c in CLASSES}
    assert "a half message parked after the last check-back" in page
    assert 'href="/transactions">see transactions</a>' in page
    assert "&lt;i&gt;stuck&lt;/i&gt;" in page and "<i>stuck" not in page
    assert "decide COMMIT" in page and "T-L" in page
    assert "broker-a (/var/lib/txmq/store)" in page and "inventory &lt;- order-created" in page
    assert "took</th><td>2.0 s" in page

    # the older run alone: nothing needs attention
    (reports / "tuesday" / "summary.json").unlink()
    with urllib.request.urlopen(console.url + "/reconcile?partial=1", timeout=10) as r:
        part = r.read().decode()
    assert "Nothing needs attention" in part and "<html" not in part
    assert "Traceback" not in console.output()


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "no summary.json in"),
        (b"{not json", "is not a reconcile summary: it is not JSON"),
        (b"\xff\xfe\x00garbage", "is not a reconcile summary"),
        (b"[1, 2]", "it is not a JSON object"),
        (b'{"ok": true, "counts": "lots"}', "it has no &#34;counts&#34;"),
        (b'{"counts": {"lost": -1}}', "the count of &#39;lost&#39; is not a count"),
    ],
)
def test_reconcile_page_without_a_good_report_says_so(
    tmp_path: Path, content: bytes | None, said: str
) -> None:
    if content is not None:
        (tmp_path / "summary.json").write_bytes(content)
    app = create_app(ConsoleConfig(broker="127.0.0.1:1", reports=str(tmp_path)), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        r = web.get("/reconcile")
    assert r.status_code == 200 and "Traceback" not in r.text
    assert 'class="bad report-problem"' in r.text and said in r.text, r.text


def test_reconcile_page_shows_saga_rows_and_the_evidence_of_consumption(tmp_path: Path) -> None:
    stuck = {
        "saga_id": "s-1",
        "saga": "checkout",
        "state": "PARKED",
        "step": 1,
        "branch": "charge-card",
        "op": "compensation",
        "service": "payment",
        "detail": "PARKED for 1:00:00, past the SLA: waits for an operator",
        "at": datetime(2026, 11, 23, 9, 0),
        "age": "1:00:00",
        "db": "sqlite:///orders.db",
        "participant_db": "sqlite:///payment.db",
    }
    write_summary(tmp_path, {"saga_stuck": 1}, {"saga_stuck": [stuck]})
    data = json.loads((tmp_path / "summary.json").read_text())
    data["facts"]["evidence"] = {"billing": "committed offsets", "audit": "none"}
    data["facts"]["sagas"] = 7
    data["facts"]["saga_participants"] = {"payment": ["sqlite:///payment.db"]}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    config = ConsoleConfig(broker="127.0.0.1:1", reports=str(tmp_path))
    with TestClient(create_app(config, sample=False), base_url="http://127.0.0.1") as web:
        page = web.get("/reconcile").text
    table = page[page.index('<table class="grid examples" data-class="saga_stuck">') :]
    table = table[: table.index("</table>")]
    headings = re.findall(r"<th>([^<]*)</th>", table)
    assert headings == [
        *("saga id", "saga", "state", "step", "branch", "op", "service", "detail", "at"),
        *("age", "participant database"),
    ]
    assert "<td>charge-card</td>" in table and "<td>sqlite:///payment.db</td>" in table
    assert "waits for an operator to retry or resolve it" in page  # the class explained
    assert "audit: none; billing: committed offsets" in page
    assert "<th>sagas judged</th><td>7</td>" in page
    assert "payment: sqlite:///payment.db" in page


def test_reconcile_page_unconfigured_or_missing_folder(tmp_path: Path) -> None:
    for reports, said in [
        (None, "without --reports DIR"),
        (str(tmp_path / "no"), "is not a folder"),
    ]:
        config = ConsoleConfig(broker="127.0.0.1:1", reports=reports)
        with TestClient(create_app(config, sample=False), base_url="http://127.0.0.1") as web:
            r = web.get("/reconcile")
        assert r.status_code == 200 and said in r.text, r.text


# -- a message's journey and the queues a group's members hold -------------------------------


@pytest.fixture
def quick_broker(broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    bp = broker_process()
    bp.env["TXMQ_BROKER_MESSAGE_DELAY_LEVELS"] = QUICK_LEVELS
    bp.start()
    return bp


@pytest.fixture
def web_of(quick_broker: BrokerProcess) -> Iterator[TestClient]:
    app = create_app(ConsoleConfig(broker=quick_broker.address), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        yield web


def _consumer(address: str, group: str, topic: str, listener: Any, **kw: Any) -> PushConsumer:
    consumer = PushConsumer(
        address,
        group,
        listener=listener,
        persist_interval=0.1,
        rebalance_interval=0.2,
        long_poll=1.0,
        **kw,
    )
    consumer.subscribe(topic)
    return consumer


def test_message_journey_consumed_by_one_group_retried_by_another(
    quick_broker: BrokerProcess, web_of: TestClient
) -> None:
    address = quick_broker.address
    with AdminClient(address) as admin:
        admin.create_topic("parcels", 1)
    seen: list[tuple[str, int, str]] = []

    def audit(msg: MessageExt) -> ConsumeResult:
        seen.append(("audit", msg.reconsume_times, msg.topic))
        return ConsumeResult.SUCCESS

    def picky(msg: MessageExt) -> ConsumeResult:  # fails the first time only
        seen.append(("picky", msg.reconsume_times, msg.topic))
        return ConsumeResult.SUCCESS if msg.reconsume_times else ConsumeResult.RECONSUME_LATER

    with (
        _consumer(address, "audit", "parcels", audit) as a,
        _consumer(address, "picky", "parcels", picky) as p,
    ):
        wait_for(lambda: a.queues_held() and p.queues_held(), timeout=20)
        with Producer(address) as producer:
            sent = producer.send(Message("parcels", b"<b>parcel 9</b>", keys=["parcel-9"]))

        def journey_done() -> str | None:
            r = web_of.get("/message", params={"id": sent.msg_id})
            done = r.status_code == 200 and len(re.findall(r": consumed <small>", r.text)) == 3
            return r.text if done else None

        page = wait_for(journey_done, timeout=30, interval=0.2)
    assert sorted(seen) == [
        ("audit", 0, "parcels"),
        ("picky", 0, "parcels"),
        ("picky", 1, "parcels"),
    ]
    article = re.findall(r"<article.*?</article>", page, re.S)
    assert len(article) == 1 and "&lt;b&gt;parcel 9&lt;/b&gt;" in page and "<b>parcel" not in page
    [stored] = re.findall(r'<li class="stored">.*?</ul></li>', page, re.S)
    assert "stored in parcels · queue 0 @ 0" in stored
    assert re.search(r"group <a [^>]*>audit</a>: consumed", stored)
    assert re.search(r"group <a [^>]*>picky</a>: consumed", stored)
    [retry] = re.findall(r'<li class="retry">.*?</ul></li>', page, re.S)
    assert re.search(r"retried for group <a [^>]*>picky</a>: a copy in %RETRY%picky", retry)
    assert '<span class="reconsume">1</span>' in retry
    assert re.search(r"group <a [^>]*>picky</a>: consumed", retry)
    assert "audit" not in retry and 'class="dead' not in page
    # the newest record with the id is the retry copy; the page shows the message first
    assert '<td class="topic">parcels</td>' in page
    # by key: the records of one message are one journey
    by_key = web_of.get("/message", params={"key": "parcel-9"}).text
    assert len(re.findall(r"<article", by_key)) == 1 and '<li class="retry">' in by_key


def test_group_page_lists_the_queues_each_member_holds(
    quick_broker: BrokerProcess, web_of: TestClient
) -> None:
    address = quick_broker.address
    with AdminClient(address) as admin:
        admin.create_topic("lanes", 4)

    def ok(msg: MessageExt) -> ConsumeResult:
        return ConsumeResult.SUCCESS

    one = _consumer(address, "pickers", "lanes", ok, instance_name="member-1")
    two = _consumer(address, "pickers", "lanes", ok, instance_name="member-2")
    with one, two:

        def balanced() -> bool:
            held = [
                {mq.queue_id for mq in c.queues_held() if mq.topic == "lanes"} for c in (one, two)
            ]
            return len(held[0]) == len(held[1]) == 2 and not held[0] & held[1]

        wait_for(balanced, timeout=30, interval=0.1)
        with Producer(address) as producer:
            for qid in range(4):
                producer.send(Message("lanes", f"lane {qid}".encode()), queue_id=qid)
        with AdminClient(address) as admin:
            wait_for(
                lambda: (
                    len({o.queue_id for o in admin.offsets() if o.group == "pickers" and o.offset})
                    == 4
                ),
                timeout=30,
                interval=0.1,
            )
        expected = {mq.queue_id: c.aio.client_id for c in (one, two) for mq in c.queues_held()
                    if mq.topic == "lanes"}  # fmt: skip
        page = web_of.get("/group", params={"name": "pickers"}).text
        members = re.findall(r"<li>(.*?)</li>", page.split('id="members"')[1].split("</ul>")[0])
    assert sorted(members) == sorted(set(expected.values())) and len(members) == 2
    shown = {
        int(qid): html.unescape(holder)
        for qid, holder in re.findall(
            r'<tr data-queue="lanes/[^/]*/(\d+)">.*?<td class="holder">(.*?)</td>', page, re.S
        )
    }
    assert shown == expected
    assert "The allocation the members compute themselves" in page


def test_message_journey_shows_a_dead_letter(seeded: Seeded) -> None:
    app = create_app(ConsoleConfig(broker=seeded.address), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        page = web.get("/message", params={"id": seeded.dead_id}).text
    assert '<td class="topic">invoices</td>' in page  # the message, not its DLQ copy
    assert re.search(r'<li class="stored">stored in invoices · queue 0 @ 0', page)
    [dead] = re.findall(r'<li class="dead bad">.*?</li>', page, re.S)
    assert 'dead-lettered for group <a href="/dlq?group=billing">billing</a> after 1' in dead
    assert "%DLQ%billing" in dead and '<li class="retry">' not in page
