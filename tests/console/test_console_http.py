"""The web console over HTTP (Starlette's TestClient) against a real broker process: every
page with live data, escaping, CSRF, confirmation, clear error pages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.console.conftest import NO_EXTRA, SCRIPT_BODY, Seeded, read_topic

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from starlette.testclient import TestClient

from txmq.console import ConsoleConfig, create_app


@pytest.fixture
def web(seeded: Seeded) -> Iterator[TestClient]:
    app = create_app(ConsoleConfig(broker=seeded.address, sample_every_s=0.2))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def token(client: TestClient) -> str:
    client.get("/cluster")
    value = client.cookies.get("txmq_csrf")
    assert value
    return value


def test_every_page_answers_with_live_data(web: TestClient, seeded: Seeded) -> None:
    r = web.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/cluster"
    cluster = web.get("/cluster")
    assert cluster.status_code == 200
    assert seeded.address in cluster.text and "messages per second" in cluster.text
    assert "script-src 'self'" in cluster.headers["content-security-policy"]

    topics = web.get("/topics").text
    assert 'href="/topic?name=orders"' in topics and "invoices" in topics
    topic = web.get("/topic", params={"name": "orders"}).text
    assert "shipping" in topic and '<table class="grid" id="queues">' in topic

    groups = web.get("/groups").text
    assert 'href="/group?name=shipping"' in groups and "lag per group" in groups
    group = web.get("/group", params={"name": "shipping"}).text
    assert 'id="group-lag">3<' in group  # 1 + 2 messages not consumed

    tx = web.get("/transactions").text
    assert seeded.pending_id in tx and seeded.parked_id in tx and "T-9" in tx

    dlq = web.get("/dlq").text
    assert 'href="/dlq?group=billing"' in dlq
    dead = web.get("/dlq", params={"group": "billing"}).text
    assert seeded.dead_id in dead and "invoice 7" in dead

    found = web.get("/message", params={"key": "order-42"}).text
    assert seeded.json_id in found and "(json)" in found
    assert "&#34;a&lt;b&gt;&#34;" in found  # pretty JSON, escaped

    # a live part alone (what the page's script fetches)
    part = web.get("/transactions", params={"partial": "1"}).text
    assert "<html" not in part and seeded.pending_id in part


def test_a_script_body_is_shown_as_text(web: TestClient, seeded: Seeded) -> None:
    page = web.get("/message", params={"id": seeded.script_id}).text
    assert SCRIPT_BODY.decode() not in page
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in page
    assert "evil&lt;key&gt;" in page and "<key>" not in page
    assert re.search(r"group <a [^>]*>shipping</a>: consumed", page)


def test_binary_and_huge_bodies(web: TestClient, seeded: Seeded) -> None:
    binary = web.get("/message", params={"id": seeded.binary_id}).text
    assert "(hex)" in binary and "00000000  00 01 02 03" in binary
    big = web.get("/message", params={"id": seeded.big_id}).text
    assert "(text, cut)" in big and "Download the whole body (200000 bytes)" in big
    download = web.get("/message/body", params={"id": seeded.big_id})
    assert download.status_code == 200 and len(download.content) == 200_000
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["content-disposition"].startswith("attachment;")


def test_only_its_own_host_names_are_answered(web: TestClient) -> None:
    """A page of another site that rebinds its name to 127.0.0.1 gets nothing."""
    r = web.get("/transactions", headers={"host": "attacker.example:8080"})
    assert r.status_code == 400 and "T-9" not in r.text
    assert web.get("/transactions", headers={"host": "localhost:8080"}).status_code == 200


def test_unknown_ids_are_404_pages(web: TestClient) -> None:
    for path, params in [
        ("/message", {"id": "0123456789ABCDEF0123456789ABCDEF"}),
        ("/message", {"key": "nobody-has-this-key"}),
        ("/topic", {"name": "no-such-topic"}),
    ]:
        r = web.get(path, params=params)
        assert r.status_code == 404, (path, r.text)
        assert "404 · Not found" in r.text and "Traceback" not in r.text


def test_posts_need_the_csrf_token(web: TestClient, seeded: Seeded) -> None:
    form = {"group": "billing", "all": "yes", "confirm": "yes"}
    r = web.post("/dlq/resend", data=form)
    assert r.status_code == 403 and "CSRF" in r.text
    r = web.post("/dlq/resend", data={**form, "csrf_token": "made.up"})
    assert r.status_code == 403
    web.cookies.set("txmq_csrf", "made.up")
    r = web.post("/dlq/resend", data={**form, "csrf_token": "made.up"})
    assert r.status_code == 403
    web.cookies.clear()
    assert read_topic(seeded.address, "%RETRY%billing") == []  # nothing was re-sent


def test_actions_ask_then_act(web: TestClient, seeded: Seeded) -> None:
    csrf = token(web)
    form = {"csrf_token": csrf, "topic": "created-here", "queues": "3"}
    asked = web.post("/topics", data=form)
    assert asked.status_code == 200 and "Create topic &#39;created-here&#39;" in asked.text
    assert 'name="confirm" value="yes"' in asked.text
    done = web.post("/topics", data={**form, "confirm": "yes"})
    assert done.status_code == 200 and "topic created-here has 3 queue(s)" in done.text

    end = {
        "csrf_token": csrf,
        "group": "tx-console",
        "msg_id": seeded.pending_id,
        "state": "COMMIT",
        "confirm": "yes",
    }
    rows = web.get("/transactions").text
    [offset] = re.findall(
        rf'name="offset" value="(\d+)">\s*<input type="hidden" name="msg_id" '
        rf'value="{seeded.pending_id}"',
        rows,
    )[:1]
    done = web.post("/transactions/end", data={**end, "offset": offset})
    assert f"{seeded.pending_id}: COMMITTED" in done.text
    assert [m.body for m in read_topic(seeded.address, "payments")] == [b"payment 9"]

    resent = web.post(
        "/dlq/resend",
        data={"csrf_token": csrf, "group": "billing", "msg_id": seeded.dead_id, "confirm": "yes"},
    )
    assert "re-sent 1 message(s) to %RETRY%billing" in resent.text
    assert [m.body for m in read_topic(seeded.address, "%RETRY%billing")] == [b"invoice 7"]


def test_a_broker_that_goes_down_is_a_503_page(web: TestClient, seeded: Seeded) -> None:
    assert web.get("/topics").status_code == 200
    assert seeded.broker is not None
    seeded.broker.kill()
    r = web.get("/topics")
    assert r.status_code == 503 and f"broker {seeded.address} did not answer" in r.text


def test_a_broker_that_is_down_is_a_503_page() -> None:
    nobody = f"127.0.0.1:{free_port()}"
    app = create_app(ConsoleConfig(broker=nobody, request_timeout=1.0), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        for path in ("/cluster", "/topics", "/transactions", "/message?id=X"):
            r = web.get(path)
            assert r.status_code == 503, (path, r.text)
            assert f"broker {nobody} did not answer" in r.text and "Traceback" not in r.text
        part = web.get("/groups", params={"partial": "1"})
        assert part.status_code == 503 and "<html" not in part.text


def test_the_producer_databases_log_beside_each_transaction(seeded: Seeded, tmp_path: Path) -> None:
    from sqlalchemy import create_engine, insert

    from txmq.sqla.tables import COMMITTED, metadata, transaction_log

    url = f"sqlite:///{tmp_path / 'orders.db'}"
    engine = create_engine(url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            insert(transaction_log).values(
                transaction_id="T-9", producer_group="tx-console", state=COMMITTED
            )
        )
    engine.dispose()
    missing = f"sqlite:///{tmp_path / 'empty.db'}"
    app = create_app(ConsoleConfig(broker=seeded.address, dbs=[url, missing]), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        page = web.get("/transactions").text
    [pending_row] = re.findall(rf'<tr data-msg-id="{seeded.pending_id}">.*?</tr>', page, re.S)
    assert '<span class="ok">COMMITTED</span>' in pending_row and "orders.db" in pending_row
    [parked_row] = re.findall(rf'<tr data-msg-id="{seeded.parked_id}">.*?</tr>', page, re.S)
    assert "no row" in parked_row
    assert "empty.db has no txmq tables yet" in page
