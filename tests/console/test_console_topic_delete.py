"""Deleting a topic from the console (``POST /topics/delete``), over HTTP against real broker
processes: only once the operator has typed the topic's name (anything else deletes
nothing), only with the CSRF token, never by a GET, never a system topic (the brokers'
own check, which ``txmq admin topic delete`` meets too); with ``--login`` a user the
brokers give no ``admin`` right on the topic is refused; through name servers the topic
goes from every broker set holding it."""

from __future__ import annotations

import html
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.acl_support import policy, secured_broker
from tests.conftest import BrokerProcess, NamesrvProcess, ask, wait_for
from tests.console.conftest import NO_EXTRA, Seeded, read_topic

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from starlette.testclient import TestClient

from txmq.console import ConsoleConfig, create_app
from txmq.protocol.message import is_system_topic
from txmq.protocol.wire import GetAllTopicConfig, GetTopicRoute
from txmq.protocol.wire.errors import NoPermission, TopicNotFound, TxmqError
from txmq.sync import AdminClient


@pytest.fixture
def web(seeded: Seeded) -> Iterator[TestClient]:
    app = create_app(ConsoleConfig(broker=seeded.address), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def token(client: TestClient, page: str = "/topics") -> str:
    if not client.cookies.get("txmq_csrf"):
        client.get(page)
    value = client.cookies.get("txmq_csrf")
    assert value
    return value


def topics_of(address: str, **client: str) -> set[str]:
    with AdminClient(address, **client) as admin:
        return {t.topic for t in admin.topics()}


def one_line(response: object) -> str:
    """The error page's message (its one line)."""
    text = str(getattr(response, "text", ""))
    [detail] = re.findall(r'<section class="error"[^>]*>.*?<p>(.*?)</p>', text, re.S)
    assert "\n" not in detail
    return html.unescape(detail)


def test_a_topic_is_deleted_once_its_name_is_typed(
    web: TestClient, seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    page = web.get("/topics").text
    [form] = re.findall(r'<form method="post" action="/topics/delete" id="delete-topic">.*?</form>',
                        page, re.S)  # fmt: skip
    options = re.findall(r"<option>([^<]*)</option>", form)
    assert "orders" in options and "invoices" in options
    assert not [o for o in options if is_system_topic(html.unescape(o))]  # none offered
    assert 'name="typed" required' in form and "data-confirm" not in form
    csrf = token(web)
    form_data = {"csrf_token": csrf, "topic": "orders"}

    # nothing typed: the page that asks for the name; nothing deleted
    asked = web.post("/topics/delete", data=form_data)
    assert asked.status_code == 200
    assert "Delete topic &#39;orders&#39; from every broker set holding it?" in asked.text
    assert 'Type <span class="name">orders</span> to confirm' in asked.text
    assert '<input type="hidden" name="topic" value="orders">' in asked.text
    assert 'id="typed-wrong"' not in asked.text
    # a wrong name: said in one line, nothing deleted
    for wrong in ("order", "ORDERS", "invoices", "orders2"):
        refused = web.post("/topics/delete", data={**form_data, "typed": wrong})
        assert refused.status_code == 400, wrong
        [said] = re.findall(r'<p class="bad" id="typed-wrong">(.*?)</p>', refused.text)
        assert html.unescape(said) == f"You typed “{wrong}”, not “orders”: nothing was done."
    assert {"orders", "invoices"} <= topics_of(seeded.address)
    assert len(read_topic(seeded.address, "orders")) == 4

    # the name typed (here from the confirmation page: confirm=yes changes nothing)
    with caplog.at_level(logging.WARNING, logger="txmq.console"):
        done = web.post(
            "/topics/delete",
            data={**form_data, "typed": "orders", "confirm": "yes"},
            follow_redirects=False,
        )
    assert done.status_code == 303 and done.headers["location"].startswith("/topics?flash=")
    shown = web.get(done.headers["location"]).text
    assert '<p class="flash ok" role="status">topic orders deleted</p>' in shown
    assert 'href="/topic?name=orders"' not in shown and 'href="/topic?name=invoices"' in shown
    assert "operator testclient: deleted topic 'orders'" in caplog.text
    on_broker = topics_of(seeded.address)
    assert "orders" not in on_broker and "invoices" in on_broker
    assert read_topic(seeded.address, "orders") == []
    with AdminClient(seeded.address) as admin:  # the group's offsets of it went with it
        assert not [o for o in admin.offsets() if o.topic == "orders"]
    # again: the topic is gone, a 404 of one line
    again = web.post("/topics/delete", data={**form_data, "typed": "orders"})
    assert again.status_code == 404 and one_line(again) == "topic 'orders' does not exist"


def test_the_topic_page_deletes_its_topic(web: TestClient, seeded: Seeded) -> None:
    page = web.get("/topic", params={"name": "invoices"}).text
    [form] = re.findall(r'<form method="post" action="/topics/delete".*?</form>', page, re.S)
    assert '<input type="hidden" name="topic" value="invoices">' in form
    csrf = token(web)
    data = {"csrf_token": csrf, "topic": "invoices", "typed": "invoices"}
    done = web.post("/topics/delete", data=data)
    assert done.status_code == 200 and "topic invoices deleted" in done.text
    assert "invoices" not in topics_of(seeded.address)


def test_no_get_and_no_post_without_the_csrf_token_deletes(web: TestClient, seeded: Seeded) -> None:
    csrf = token(web)
    params = {"csrf_token": csrf, "topic": "orders", "typed": "orders", "confirm": "yes"}
    assert web.get("/topics/delete", params=params).status_code == 405
    assert web.get("/topics", params=params).status_code == 200
    assert web.get("/topic", params={**params, "name": "orders"}).status_code == 200
    no_token = {k: v for k, v in params.items() if k != "csrf_token"}
    refused = web.post("/topics/delete", data=no_token)
    assert refused.status_code == 403 and "CSRF" in one_line(refused)
    made_up = web.post("/topics/delete", data={**no_token, "csrf_token": "made.up"})
    assert made_up.status_code == 403
    assert "orders" in topics_of(seeded.address)
    assert len(read_topic(seeded.address, "orders")) == 4


def test_system_topics_are_refused_as_the_brokers_refuse_them(
    web: TestClient, seeded: Seeded
) -> None:
    system = sorted(t for t in topics_of(seeded.address) if is_system_topic(t))
    assert "%DLQ%billing" in system and "RMQ_SYS_TRANS_HALF_TOPIC" in system
    csrf = token(web)
    for topic in system:
        r = web.post("/topics/delete", data={"csrf_token": csrf, "topic": topic, "typed": topic})
        assert r.status_code == 400, topic
        said = one_line(r)
        assert said == f"{topic} is a system topic: the brokers need it, it cannot be deleted"
    assert set(system) <= topics_of(seeded.address)
    page = web.get("/topic", params={"name": "%DLQ%billing"}).text
    assert 'action="/topics/delete"' not in page and "it cannot be deleted" in page
    # the same check is the brokers' (what ``txmq admin topic delete`` meets)
    with AdminClient(seeded.address) as admin:
        with pytest.raises(NoPermission, match="reserved system topic"):
            admin.delete_topic("%DLQ%billing")


# -- with --login: the brokers' rights ---------------------------------------------------


@pytest.fixture
def secured(tmp_path: Path, broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    # bob may read orders (its pages need no more); alice administers the topic orders only
    rules = {"bob": [("topic:orders", "sub")], "alice": [("topic:orders", "admin")]}
    bp = secured_broker(broker_process, tmp_path, policy(rules))
    with AdminClient(bp.address, access_key="ops", secret_key="ops-secret-1") as admin:
        admin.create_topic("orders", 2)
        admin.create_topic("invoices", 2)
    return bp


def _log_in(web: TestClient, user: str, secret: str) -> None:
    form = {"csrf_token": token(web, "/login"), "access_key": user, "secret_key": secret}
    r = web.post("/login", data=form, follow_redirects=False)
    assert r.status_code == 303, r.text


def test_a_user_without_the_admin_right_cannot_delete(secured: BrokerProcess) -> None:
    ops = {"access_key": "ops", "secret_key": "ops-secret-1"}
    app = create_app(ConsoleConfig(broker=secured.address, login=True), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        # not logged in: to the login page, nothing deleted
        data = {"csrf_token": token(web, "/login"), "topic": "orders", "typed": "orders"}
        r = web.post("/topics/delete", data=data, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/login"
        _log_in(web, "bob", "bob-secret-1")
        refused = web.post("/topics/delete", data=data)
        assert refused.status_code == 403
        said = one_line(refused)
        assert (
            f"broker {secured.address} refused: DeleteTopic: user 'bob' has no 'admin' right "
            "on topic:orders" in said
        ), said
        assert {"orders", "invoices"} <= topics_of(secured.address, **ops)
        # alice administers orders (only: the topics page, a cluster-wide list, is not
        # hers): she deletes it, and may not delete invoices
        _log_in(web, "alice", "alice-secret")
        other = web.post("/topics/delete", data={**data, "topic": "invoices", "typed": "invoices"})
        assert other.status_code == 403 and "no 'sub' right on topic:invoices" in one_line(other)
        done = web.post("/topics/delete", data=data, follow_redirects=False)
        assert done.status_code == 303 and done.headers["location"].startswith("/topics?flash=")
        assert topics_of(secured.address, **ops) & {"orders", "invoices"} == {"invoices"}


# -- through name servers: every broker set ---------------------------------------------


def test_through_name_servers_every_broker_set_loses_the_topic(
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
) -> None:
    ns = namesrv_process("ns").start()
    names = ("broker-a", "broker-b")
    brokers = {name: cluster_broker(name, [ns.address]).start() for name in names}
    with AdminClient(namesrv=ns.address) as admin:

        def registered() -> bool:  # (each broker registers as it starts)
            try:
                return len(admin.cluster()) == 2
            except TxmqError:
                return False

        wait_for(registered, timeout=30, interval=0.1)
        assert admin.create_topic("orders", 2).brokers == {"broker-a": 2, "broker-b": 2}
        admin.create_topic("invoices", 2)
    wait_for(lambda: len(ask(ns.address, GetTopicRoute(topic="orders")).queues) == 2, timeout=30)

    def held(topic: str) -> list[str]:
        return [
            name
            for name, b in brokers.items()
            if topic in {t.topic for t in ask(b.address, GetAllTopicConfig()).topics}
        ]

    assert held("orders") == ["broker-a", "broker-b"]
    app = create_app(ConsoleConfig(namesrv=ns.address), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        data = {"csrf_token": token(web), "topic": "orders", "typed": "orders"}
        done = web.post("/topics/delete", data=data)
        assert done.status_code == 200, done.text
        assert "topic orders deleted from broker-a, broker-b" in done.text
        assert 'href="/topic?name=orders"' not in done.text
    assert held("orders") == [] and held("invoices") == ["broker-a", "broker-b"]
    with AdminClient(namesrv=ns.address) as admin, pytest.raises(TopicNotFound):
        admin.topic_stats("orders")
