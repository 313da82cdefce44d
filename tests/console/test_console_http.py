"""The web console over HTTP (Starlette's TestClient) against a real broker process: every
page with live data, escaping, CSRF, confirmation, clear error pages."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from html import unescape as html_unescape
from pathlib import Path

import anyio
import pytest

from tests.conftest import free_port
from tests.console.conftest import NO_EXTRA, SCRIPT_BODY, Seeded, read_topic

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from starlette.testclient import TestClient

from txmq import AdminClient, Message, Producer, PullConsumer
from txmq.client.core import BrokerClient
from txmq.console import ConsoleConfig, create_app
from txmq.protocol.wire import ConsumerSendMsgBack, GroupOffset


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
    assert 'href="/group?group=shipping"' in groups and "lag per group" in groups
    group = web.get("/group", params={"group": "shipping"}).text
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


def test_a_dead_letter_reason_is_shown_escaped(web: TestClient, seeded: Seeded) -> None:
    reason = "bad payload\n<script>alert('reason')</script>"

    async def dead_letter() -> None:
        address = seeded.address
        async with PullConsumer(address, "auditing") as c, BrokerClient(address) as raw:
            [m] = (await c.pull("invoices", 0, 0, long_poll=0)).messages
            back = ConsumerSendMsgBack(
                group="auditing",
                commit_log_offset=m.commit_log_offset,
                delay_level=-1,
                origin_msg_id=m.msg_id,
                reason=reason,
            )
            await raw.call(back)

    anyio.run(dead_letter)
    page = web.get("/dlq", params={"group": "auditing"}).text
    assert "<script>alert(" not in page
    shown = "bad payload\n&lt;script&gt;alert(&#39;reason&#39;)&lt;/script&gt;"
    assert f'<td class="reason">{shown}</td>' in page
    billing = web.get("/dlq", params={"group": "billing"}).text  # sent back without a reason
    assert '<td class="reason">sent to the DLQ by its consumer</td>' in billing


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

    decide = {
        "csrf_token": csrf,
        "group": "tx-console",
        "msg_id": seeded.pending_id,
        "decision": "COMMIT",
    }
    asked = web.post("/transactions/decide", data=decide)
    assert asked.status_code == 200 and "COMMIT the half message" in asked.text
    assert 'name="reason" required' in asked.text
    missing = web.post("/transactions/decide", data={**decide, "confirm": "yes"})
    assert "A reason is needed." in missing.text
    assert read_topic(seeded.address, "payments") == []
    done = web.post(
        "/transactions/decide",
        data={**decide, "confirm": "yes", "reason": "paid <by> phone"},
    )
    assert f"{seeded.pending_id}: COMMIT recorded" in done.text
    assert [m.body for m in read_topic(seeded.address, "payments")] == [b"payment 9"]
    decided = web.get("/transactions").text
    assert "paid &lt;by&gt; phone" in decided and "console (testclient)" in decided
    again = web.post("/transactions/decide", data={**decide, "confirm": "yes", "reason": "twice"})
    assert again.status_code == 404 and "resolved (COMMIT)" in again.text

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


def _queue_cells(html: str, topic: str) -> dict[int, list[str]]:
    """The group page's queue table: queue id -> [committed offset, max offset, lag]."""
    table = html[html.index('id="group-queues"') :]
    table = table[: table.index("</table>")]
    out = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row)]
        if cells and cells[0] == topic:
            out[int(cells[2])] = cells[3:6]
    return out


def _committed(address: str, group: str, topic: str) -> dict[int, int]:
    async def go() -> dict[int, int]:
        async with AdminClient(address) as admin:
            rows = await admin.offsets()
        return {o.queue_id: o.offset for o in rows if (o.group, o.topic) == (group, topic)}

    return anyio.run(go)


def test_reset_offsets_of_a_group_asks_then_moves_them(web: TestClient, seeded: Seeded) -> None:
    page = web.get("/group", params={"name": "shipping"}).text
    assert 'action="/group/reset"' in page and "<option>orders</option>" in page
    assert 'type="datetime-local" name="to"' in page
    form = {"group": "shipping", "topic": "orders", "to": "2000-01-01T00:00"}
    assert web.post("/group/reset", data=form).status_code == 403  # no CSRF token
    csrf = token(web)
    asked = web.post("/group/reset", data={**form, "csrf_token": csrf})
    assert asked.status_code == 200
    assert "Reset the offsets of group &#39;shipping&#39; on topic &#39;orders&#39;" in asked.text
    assert 'name="confirm" value="yes"' in asked.text
    assert _committed(seeded.address, "shipping", "orders") == {0: 1, 1: 0}  # not yet

    # back to a time before every message: each queue from its first message (queues 2 and 3
    # of the topic, never committed and empty, get an offset too)
    done = web.post("/group/reset", data={**form, "csrf_token": csrf, "confirm": "yes"})
    assert done.status_code == 200
    assert "offsets of orders reset to 2000-01-01 00:00:00 UTC: 3 of 4 queue(s) moved" in done.text
    empty = {2: ["0", "0", "0"], 3: ["0", "0", "0"]}
    assert _queue_cells(done.text, "orders") == {0: ["0", "2", "2"], 1: ["0", "2", "2"], **empty}
    # forward past the newest message: nothing left to consume
    later = {**form, "to": "2100-01-01T00:00:00", "csrf_token": csrf, "confirm": "yes"}
    done = web.post("/group/reset", data=later)
    assert "2 of 4 queue(s) moved" in done.text
    assert _queue_cells(done.text, "orders") == {0: ["2", "2", "0"], 1: ["2", "2", "0"], **empty}
    assert _committed(seeded.address, "shipping", "orders") == {0: 2, 1: 2, 2: 0, 3: 0}

    bad = web.post("/group/reset", data={**later, "to": "soon"})
    assert bad.status_code == 400 and "to must be a date and time" in bad.text
    missing = web.post("/group/reset", data={**later, "topic": "no-such-topic"})
    assert missing.status_code == 404 and "does not exist" in missing.text


# -- one number, one name ---------------------------------------------------------------------


@pytest.fixture
def quiet_web(seeded: Seeded) -> Iterator[TestClient]:
    """The console without its background sampler: the history is what a test puts in."""
    app = create_app(ConsoleConfig(broker=seeded.address), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _legend(html: str) -> dict[str, str]:
    """A page's chart legend: line name -> the value it shows."""
    found = re.findall(
        r'<span class="legend" data-line="([^"]*)">.*?<span class="last">([^<]*)</span>', html, re.S
    )
    return {html_unescape(name): value for name, value in found}


def _plotted_last(html: str, line: str) -> float:
    """The value where chart line ``line`` ends, read back from the SVG's geometry."""
    from txmq.console.render import HEIGHT, PAD_BOTTOM, PAD_TOP

    y_max = re.findall(r'<text x="\d+" y="\d+" text-anchor="end">(\d+)</text>', html)[0]
    [points] = re.findall(rf'<polyline data-line="{re.escape(line)}" points="([^"]*)"', html)
    y = float(points.split()[-1].split(",")[1])
    bottom, top = HEIGHT - PAD_BOTTOM, PAD_TOP
    return (bottom - y) / (bottom - top) * float(y_max)


def test_group_total_lag_is_what_its_chart_shows(quiet_web: TestClient, seeded: Seeded) -> None:
    """The issue's page: a sample of 10 s ago said lags 5 and 6, the page's total (read
    now) is 3.  The chart's lines end with the page's reading: its "total" line is the
    page's total lag, each queue's line that queue's row."""
    state = quiet_web.app.state.console  # type: ignore[attr-defined]
    old = [
        GroupOffset(group="shipping", topic="orders", queue_id=q, offset=0, max_offset=lag, lag=lag)
        for q, lag in ((0, 5), (1, 6))
    ]
    state.history.record_offsets(old, time.time() - 10)
    page = quiet_web.get("/group", params={"group": "shipping"}).text
    total = re.search(r'id="group-lag">(\d+)<', page)
    assert total and total.group(1) == "3"  # 1 + 2 messages not consumed
    legend = _legend(page)
    assert legend == {"total": "3", "orders#0": "1", "orders#1": "2"}
    assert next(iter(legend)) == "total"  # the page's number comes first
    lags = {f"orders#{q}": cells[2] for q, cells in _queue_cells(page, "orders").items()}
    assert {k: v for k, v in legend.items() if k != "total"} == lags
    assert sum(map(int, lags.values())) == int(legend["total"])
    assert _plotted_last(page, "total") == pytest.approx(3, abs=0.05)
    # the history stays behind the line: the sample of 10 s ago is its first point
    assert len(re.findall(r'data-line="total" points="([^"]*)"', page)[0].split()) == 2

    # more messages: the page, its live part and the chart move together
    anyio.run(_send, seeded.address, 4)
    part = quiet_web.get("/group", params={"group": "shipping", "partial": "1"}).text
    assert 'id="group-lag">7<' in part and _legend(part)["total"] == "7"
    # the groups page: each group's legend value is its row's lag
    groups = quiet_web.get("/groups").text
    [row_lag] = re.findall(
        r'href="/group\?group=shipping">shipping</a></td><td>[^<]*</td><td>(\d+)<', groups
    )
    assert row_lag == "7" and _legend(groups)["shipping"] == "7"


async def _send(address: str, n: int) -> None:
    async with Producer(address) as p:
        for i in range(n):
            await p.send(Message("orders", f"more {i}".encode()), queue_id=0)


def test_a_group_is_group_on_every_page_and_name_still_works(
    quiet_web: TestClient, seeded: Seeded
) -> None:
    new = quiet_web.get("/group", params={"group": "shipping"})
    old = quiet_web.get("/group", params={"name": "shipping"})  # links from before
    assert new.status_code == old.status_code == 200
    assert 'id="group-lag">3<' in new.text and 'id="group-lag">3<' in old.text
    missing = quiet_web.get("/group")
    assert missing.status_code == 400 and "?group=" in missing.text
    # every link to a group's page or its dead letters says group=
    pages = [
        quiet_web.get("/groups").text,
        quiet_web.get("/topic", params={"name": "orders"}).text,
        quiet_web.get("/group", params={"group": "shipping"}).text,
        quiet_web.get("/message", params={"id": seeded.dead_id}).text,
        quiet_web.get("/dlq").text,
    ]
    links = [q for text in pages for q in re.findall(r'href="/(?:group|dlq)\?([a-z]+)=', text)]
    assert links and set(links) == {"group"}, links
    # the reset action's redirect too
    csrf = token(quiet_web)
    form = {"group": "shipping", "topic": "orders", "to": "2000-01-01T00:00"}
    done = quiet_web.post(
        "/group/reset",
        data={**form, "csrf_token": csrf, "confirm": "yes"},
        follow_redirects=False,
    )
    assert done.status_code == 303 and done.headers["location"].startswith("/group?group=shipping&")
