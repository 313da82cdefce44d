"""``txmq console --login``: the console's users are the brokers' ACL users.  Against a real
broker process with an ACL file (a super user ``ops``, a user ``viewer`` with ``sub`` rules
only): pages want a login, wrong credentials and too many of them, each user's rights as
the broker checks them, logout, expiry, open redirects, a user deleted meanwhile; the CLI
flag and warning; one login through the form in a real browser."""

from __future__ import annotations

import html
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import pytest

from tests.acl_support import secured_broker
from tests.conftest import BrokerProcess, NamesrvProcess, wait_for
from tests.console.conftest import NO_EXTRA, ConsoleProcess

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from starlette.applications import Starlette
from starlette.testclient import TestClient

from txmq import AdminClient
from txmq.cli.main import main
from txmq.console import ConsoleConfig, create_app
from txmq.console.login import safe_next
from txmq.console.sessions import Sessions
from txmq.security.acl import Acl

POLICY = """
[users.ops]
secret_key = "ops-secret-1"
super = true

[users.temp]
secret_key = "temp-secret-1"
super = true

[users.viewer]
secret_key = "viewer-secret"
rules = [
  { resource = "topic:orders", actions = ["sub"] },
  { resource = "group:billing", actions = ["sub"] },
]
"""
SECRETS = {"ops": "ops-secret-1", "temp": "temp-secret-1", "viewer": "viewer-secret"}
WRONG = "access key or secret key is wrong"


@pytest.fixture
def secured(tmp_path: Path, broker_process: Callable[..., BrokerProcess]) -> BrokerProcess:
    return secured_broker(broker_process, tmp_path, POLICY)


def _app(address: str, **config: Any) -> Starlette:
    return create_app(ConsoleConfig(broker=address, login=True, **config), sample=False)


@pytest.fixture
def web(secured: BrokerProcess) -> Iterator[TestClient]:
    with TestClient(_app(secured.address), base_url="http://127.0.0.1") as client:
        yield client


def sessions(web: TestClient) -> Sessions:
    app: Any = web.app
    found: Sessions = app.state.sessions
    return found


def csrf(web: TestClient) -> str:
    if not web.cookies.get("txmq_csrf"):
        web.get("/login")
    token = web.cookies.get("txmq_csrf")
    assert token
    return token


def log_in(web: TestClient, user: str, secret: str | None = None, **extra: str) -> Any:
    form = {
        "csrf_token": csrf(web),
        "access_key": user,
        "secret_key": SECRETS[user] if secret is None else secret,
        **extra,
    }
    return web.post("/login", data=form, follow_redirects=False)


def location(response: Any) -> str:
    assert response.status_code == 303, response.text
    return str(response.headers["location"])


def test_every_page_wants_a_login(web: TestClient) -> None:
    for path in ("/", "/cluster", "/topics", "/outbox", "/reconcile", "/transactions"):
        r = web.get(path, follow_redirects=False)
        assert location(r) == f"/login?next={path.replace('/', '%2F')}", path
    r = web.get("/topic", params={"name": "orders"}, follow_redirects=False)
    assert parse_qs(urlsplit(location(r)).query) == {"next": ["/topic?name=orders"]}
    # an action without a session does nothing and goes to the login page
    r = web.post("/topics", data={"csrf_token": csrf(web), "topic": "x", "queues": "1"},
                 follow_redirects=False)  # fmt: skip
    assert location(r) == "/login"
    # a page's live part gets a fragment saying so (not the login page inside the page)
    part = web.get("/topics", params={"partial": "1"})
    assert part.status_code == 401 and "<html" not in part.text and "log in" in part.text
    # open: the login page and the static files
    page = web.get("/login", params={"next": "/topics"})
    assert (
        page.status_code == 200 and 'name="secret_key" id="secret-key" type="password"' in page.text
    )
    assert 'name="next" value="/topics"' in page.text
    assert 'href="/topics"' not in page.text  # no navigation before a login
    assert web.get("/static/console.css").status_code == 200
    assert web.get("/logout").status_code == 405  # POST only


def test_wrong_credentials_are_one_answer_and_no_session(web: TestClient) -> None:
    answers = [
        log_in(web, "ops", "not-the-secret"),
        log_in(web, "nobody", "nobody-secret"),
        log_in(web, "ops", ""),
        log_in(web, "", "ops-secret-1"),
    ]
    for r in answers:
        assert r.status_code == 401
        problem = html.unescape(r.text.split('id="login-problem">')[1].split("<")[0])
        assert problem == WRONG
        assert "txmq_session" not in r.headers.get("set-cookie", "")
    assert web.cookies.get("txmq_session") is None and len(sessions(web)) == 0
    assert location(web.get("/cluster", follow_redirects=False)).startswith("/login")
    # a forged session id is no session either
    web.cookies.set("txmq_session", "made-up")
    assert location(web.get("/cluster", follow_redirects=False)).startswith("/login")


def test_the_login_form_needs_its_csrf_token(web: TestClient) -> None:
    r = web.post("/login", data={"access_key": "ops", "secret_key": SECRETS["ops"]})
    assert r.status_code == 403 and "CSRF" in r.text
    assert len(sessions(web)) == 0


def _topics_on_broker(address: str) -> set[str]:
    async def go() -> set[str]:
        async with AdminClient(address, access_key="ops", secret_key=SECRETS["ops"]) as admin:
            return {t.topic for t in await admin.topics()}

    return anyio.run(go)


def test_ops_logs_in_and_acts_as_ops(web: TestClient, secured: BrokerProcess) -> None:
    r = log_in(web, "ops", next="/topics")
    assert location(r) == "/topics"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("txmq_session=")
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= flags and "secure" not in flags
    session_id = web.cookies.get("txmq_session")
    assert session_id and len(session_id) >= 40

    cluster = web.get("/cluster")
    assert cluster.status_code == 200 and secured.address in cluster.text
    assert '<span class="user" id="user">ops</span>' in cluster.text
    assert 'action="/logout"' in cluster.text
    assert web.get("/topics").status_code == 200
    assert web.get("/login", follow_redirects=False).headers["location"] == "/cluster"

    form = {"csrf_token": csrf(web), "topic": "made-by-ops", "queues": "3", "confirm": "yes"}
    done = web.post("/topics", data=form)
    assert done.status_code == 200 and "topic made-by-ops has 3 queue(s)" in done.text
    assert "made-by-ops" in _topics_on_broker(secured.address)


def test_viewer_is_refused_what_its_rules_do_not_allow(
    web: TestClient, secured: BrokerProcess
) -> None:
    assert location(log_in(web, "viewer")) == "/cluster"
    form = {"csrf_token": csrf(web), "topic": "made-by-viewer", "queues": "1", "confirm": "yes"}
    refused = web.post("/topics", data=form)
    assert refused.status_code == 403
    text = html.unescape(refused.text)
    assert "user 'viewer' has no 'admin' right on topic:made-by-viewer" in text
    assert '<span class="user" id="user">viewer</span>' in refused.text
    assert "made-by-viewer" not in _topics_on_broker(secured.address)
    # a cluster-wide list is an admin's too; the session stays
    topics = web.get("/topics")
    assert topics.status_code == 403
    assert "user 'viewer' has no 'admin' right on cluster" in html.unescape(topics.text)
    assert len(sessions(web)) == 1


def test_logout_ends_the_session_and_its_client(web: TestClient) -> None:
    location(log_in(web, "ops"))
    session_id = web.cookies.get("txmq_session")
    assert session_id
    [session] = list(sessions(web)._by_id.values())
    assert session.client.started
    assert web.post("/logout", data={}).status_code == 403  # no CSRF token: still logged in
    assert web.get("/topics").status_code == 200

    r = web.post("/logout", data={"csrf_token": csrf(web)}, follow_redirects=False)
    assert location(r).startswith("/login?")
    assert web.cookies.get("txmq_session") is None
    assert len(sessions(web)) == 0 and not session.client.started
    assert "logged out" in web.get(location(r)).text
    web.cookies.clear()
    web.cookies.set("txmq_session", session_id)  # the old cookie, kept by someone
    assert location(web.get("/topics", follow_redirects=False)).startswith("/login")


def test_five_failures_a_minute_then_429(web: TestClient) -> None:
    for _ in range(5):
        assert log_in(web, "ops", "guessing-1").status_code == 401
    blocked = log_in(web, "ops")  # even the right secret: not checked now
    assert blocked.status_code == 429 and "too many failed logins" in blocked.text
    assert 0 < int(blocked.headers["retry-after"]) <= 60
    assert web.cookies.get("txmq_session") is None and len(sessions(web)) == 0
    limiter = sessions(web).limiter
    now = time.monotonic()
    limiter.clock = lambda: now + 61  # the minute is over
    assert location(log_in(web, "ops")) == "/cluster"


@pytest.mark.parametrize(
    "target",
    ["https://evil.example/", "//evil.example/", "/\\evil.example", "javascript:alert(1)",
     "http:/evil.example", "/logout", " https://evil.example"],
)  # fmt: skip
def test_next_never_leaves_the_console(web: TestClient, target: str) -> None:
    assert location(log_in(web, "ops", next=target)) == "/cluster"


def test_next_may_be_any_page_of_the_console(web: TestClient) -> None:
    evil = web.get("/login", params={"next": "https://evil.example/"}).text
    assert 'name="next" value="/cluster"' in evil
    first = web.get("/group", params={"name": "billing"}, follow_redirects=False)
    target = parse_qs(urlsplit(location(first)).query)["next"][0]
    assert target == "/group?name=billing"
    assert location(log_in(web, "ops", next=target)) == "/group?name=billing"
    assert safe_next("/topics?x=1") == "/topics?x=1" and safe_next(None) == "/cluster"
    # logged in already: the login page sends the browser on, never away
    again = web.get("/login", params={"next": "//evil.example"}, follow_redirects=False)
    assert location(again) == "/cluster"


def test_a_deleted_user_is_sent_back_to_the_login(
    web: TestClient, secured: BrokerProcess, tmp_path: Path
) -> None:
    location(log_in(web, "temp"))
    assert web.get("/topics").status_code == 200
    path = tmp_path / "acl.toml"
    Acl.load(path).without_user("temp").save(path)
    deadline = time.monotonic() + 20  # the broker reads its file again within ~1 s
    while True:
        r = web.get("/topics", follow_redirects=False)
        if r.status_code != 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # (polling: the next look)
    to = location(r)
    assert to.startswith("/login?") and parse_qs(urlsplit(to).query)["next"] == ["/topics"]
    assert web.cookies.get("txmq_session") is None and len(sessions(web)) == 0
    said = html.unescape(web.get(to).text)
    assert "you were logged out" in said and "no longer accepts user 'temp'" in said
    assert log_in(web, "temp").status_code == 401


def test_sessions_expire_idle_and_at_most_after_their_maximum(secured: BrokerProcess) -> None:
    now = [1000.0]
    app = _app(secured.address, session_idle_s=60, session_max_s=280)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        sessions(web).clock = lambda: now[0]
        location(log_in(web, "ops"))
        [session] = list(sessions(web)._by_id.values())
        now[0] += 50
        assert web.get("/topics", params={"partial": "1"}).status_code == 200
        now[0] += 50  # 100 s without a use: the live refresh above was none
        assert location(web.get("/topics", follow_redirects=False)).startswith("/login")
        assert not session.client.started and len(sessions(web)) == 0

        location(log_in(web, "ops"))
        for _ in range(6):  # used every 50 s, but 280 s after its login it ends
            assert web.get("/topics", follow_redirects=False).status_code == 200
            now[0] += 50
        assert location(web.get("/topics", follow_redirects=False)).startswith("/login")


def test_at_most_max_sessions_the_least_recently_used_goes(secured: BrokerProcess) -> None:
    with TestClient(_app(secured.address, max_sessions=2), base_url="http://127.0.0.1") as web:
        ids: list[str] = []
        for _ in range(3):
            web.cookies.delete("txmq_session")  # another browser
            location(log_in(web, "ops"))
            ids.append(web.cookies.get("txmq_session") or "")
        assert len(sessions(web)) == 2 and len(set(ids)) == 3
        for sid, alive in zip(ids, [False, True, True], strict=True):
            web.cookies.clear()
            web.cookies.set("txmq_session", sid)
            r = web.get("/topics", follow_redirects=False)
            assert (r.status_code == 200) is alive, sid


def test_a_login_replaces_the_session_the_browser_had(web: TestClient) -> None:
    location(log_in(web, "ops"))
    first = web.cookies.get("txmq_session")
    assert first
    location(log_in(web, "viewer"))
    assert web.cookies.get("txmq_session") != first and len(sessions(web)) == 1
    web.cookies.clear()
    web.cookies.set("txmq_session", first)
    assert location(web.get("/topics", follow_redirects=False)).startswith("/login")


def test_over_https_the_session_cookie_is_secure(secured: BrokerProcess) -> None:
    with TestClient(_app(secured.address), base_url="https://127.0.0.1") as web:
        r = log_in(web, "ops")
        assert location(r) == "/cluster"
        assert "secure" in {f.strip().lower() for f in r.headers["set-cookie"].split(";")}
        assert web.get("/cluster").status_code == 200


def test_a_broker_without_access_control_says_login_makes_no_sense(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    plain = broker_process(store=tmp_path / "plain").start()
    with TestClient(_app(plain.address), base_url="http://127.0.0.1") as web:
        r = log_in(web, "ops")
        assert r.status_code == 400 and "access control is off" in r.text
        assert "logging in makes no sense" in r.text
        assert web.cookies.get("txmq_session") is None


def test_through_name_servers_the_name_servers_check_the_login(
    tmp_path: Path,
    namesrv_process: Callable[..., NamesrvProcess],
    cluster_broker: Callable[..., BrokerProcess],
) -> None:
    files = {name: tmp_path / f"acl-{name}.toml" for name in ("ns", "broker")}
    for path in files.values():
        path.write_text(POLICY)
    ns = namesrv_process("ns", env={"TXMQ_NAMESRV_ACL_FILE": str(files["ns"])}).start()
    env = {
        "TXMQ_BROKER_ACL_FILE": str(files["broker"]),
        "TXMQ_BROKER_ACCESS_KEY": "ops",  # what the broker registers with
        "TXMQ_BROKER_SECRET_KEY": SECRETS["ops"],
    }
    cluster_broker("broker-a", [ns.address], env=env).start()
    config = ConsoleConfig(namesrv=ns.address, login=True)
    with TestClient(create_app(config, sample=False), base_url="http://127.0.0.1") as web:
        assert log_in(web, "viewer", "viewer-secret-2").status_code == 401
        location(log_in(web, "ops"))

        def listed() -> bool:  # the broker registers as it starts (a failed first try
            return "broker-a" in web.get("/cluster").text  # is made again 30 s later)

        wait_for(listed, timeout=60, interval=0.1)
        location(log_in(web, "viewer"))
        form = {"csrf_token": csrf(web), "topic": "by-viewer", "queues": "1", "confirm": "yes"}
        refused = web.post("/topics", data=form)
        assert refused.status_code == 403
        assert "user 'viewer' has no 'admin' right on topic:by-viewer" in html.unescape(
            refused.text
        )


def test_the_charts_sampler_keeps_the_consoles_own_credentials(secured: BrokerProcess) -> None:
    config = ConsoleConfig(broker=secured.address, login=True, sample_every_s=0.1)
    with TestClient(create_app(config), base_url="http://127.0.0.1") as web:
        location(log_in(web, "ops"))
        app: Any = web.app
        history = app.state.console.history
        wait_for(lambda: "not signed" in history.last_error, timeout=20)
        page = web.get("/cluster")  # the user's own requests work all the same
        assert page.status_code == 200 and "not signed" in page.text


# -- the command line --------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What ``txmq console`` would serve (uvicorn is not started)."""
    import uvicorn

    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    return apps


def test_cli_login_flag_and_the_warning_without_it(
    served: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["console", "--broker", "127.0.0.1:1", "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0 without --login" in err
    assert "acts with the console's credentials" in err
    assert served[-1].state.console.config.login is False

    assert main(["console", "--broker", "127.0.0.1:1", "--host", "0.0.0.0", "--login"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert served[-1].state.console.config.login is True
    for host in ("127.0.0.1", "::1", "localhost"):
        assert main(["console", "--broker", "127.0.0.1:1", "--host", host]) == 0
        assert "warning" not in capsys.readouterr().err, host


# -- a real browser ----------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[Any]:
    pytest.importorskip("selenium", reason=NO_EXTRA)
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip("no chromium / chromedriver (scripts/test.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_log_in_through_the_form_in_a_browser(
    browser: Any, secured: BrokerProcess, console_process: Callable[..., ConsoleProcess]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    console = console_process("--broker", secured.address, "--login")
    browser.get(console.url + "/topics")
    assert urlsplit(browser.current_url).path == "/login"
    browser.find_element(By.ID, "access-key").send_keys("ops")
    browser.find_element(By.ID, "secret-key").send_keys("not-it")
    browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    problem = WebDriverWait(browser, 20).until(
        ec.presence_of_element_located((By.ID, "login-problem"))
    )
    assert problem.text == WRONG
    browser.find_element(By.ID, "secret-key").send_keys(SECRETS["ops"])
    browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    WebDriverWait(browser, 20).until(ec.presence_of_element_located((By.ID, "user")))
    assert urlsplit(browser.current_url).path == "/topics"
    assert browser.find_element(By.ID, "user").text == "ops"
    browser.get(console.url + "/cluster")
    assert "Cluster" in browser.title and secured.address in browser.page_source
    assert browser.find_element(By.ID, "user").text == "ops"
    browser.find_element(By.CSS_SELECTOR, "#logout button").click()
    WebDriverWait(browser, 20).until(ec.presence_of_element_located((By.ID, "login")))
    browser.get(console.url + "/cluster")
    assert urlsplit(browser.current_url).path == "/login"
    assert "logged in from" in console.output() and "Traceback" not in console.output()
