"""The web console in a real headless browser (Debian's chromium and chromium-driver, driven
by Selenium) against ``txmq console`` and a broker, each in a process of its own: every
page renders live data, a pending and a parked transaction are committed from their
page and consumed, a dead letter is re-sent from its page and consumed, a topic is
deleted once its name is typed, a ``<script>`` body is shown as text.

``TXMQ_CONSOLE_SCREENSHOTS=docs/console`` saves a PNG of each main page there (the
README's pictures)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for
from tests.console.conftest import (
    NO_EXTRA,
    SCRIPT_BODY,
    ConsoleProcess,
    Seeded,
    read_topic,
)

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("selenium", reason=NO_EXTRA)

from selenium import webdriver
from selenium.common.exceptions import (
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
    pytest.skip(
        "no chromium / chromedriver (scripts/test.sh installs Debian's chromium and "
        "chromium-driver)",
        allow_module_level=True,
    )
SHOTS = os.environ.get("TXMQ_CONSOLE_SCREENSHOTS", "")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1360,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def console(
    seeded: Seeded, console_process: Callable[..., ConsoleProcess], tmp_path: Path
) -> ConsoleProcess:
    from tests.console.test_console_pages import add_outbox_row, outbox_db, write_summary
    from tests.console.test_console_sagas import seed_sagas

    db = outbox_db(tmp_path / "orders.db")
    add_outbox_row(db, "orders", b"waiting", key="order-7")
    seed_sagas(db)
    write_summary(tmp_path / "reports", {"parked": 1}, {})
    return console_process(
        "--broker", seeded.address, "--refresh", "0.5", "--sample-every", "0.3",
        "--db", db, "--reports", str(tmp_path / "reports"),
    )  # fmt: skip


def shot(driver: WebDriver, name: str) -> None:
    if SHOTS:
        folder = ROOT / SHOTS
        folder.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(folder / f"{name}.png"))


def text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def _again(act: Callable[[], object]) -> object:
    """``act()``, again while the page's live refresh replaces what it found (a stale
    element), for up to 10 s."""
    done: list[object] = []

    def attempt() -> bool:
        try:
            done.append(act())
        except StaleElementReferenceException:
            return False
        return True

    wait_for(attempt, timeout=10)
    return done[0]


def click(driver: WebDriver, by: str, value: str, *, inside: str | None = None) -> None:
    """Click the element (in the element matching CSS ``inside``), found afresh until the
    click lands on a live one."""

    def act() -> None:
        root = driver.find_element(By.CSS_SELECTOR, inside) if inside else driver
        root.find_element(by, value).click()

    _again(act)


def text_of(driver: WebDriver, by: str, value: str) -> str:
    return str(_again(lambda: driver.find_element(by, value).text))


def no_alert(driver: WebDriver, wait: float = 1.0) -> bool:
    try:
        WebDriverWait(driver, wait).until(ec.alert_is_present())
    except TimeoutException:
        return True
    return False


def test_every_page_renders_live_data(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    browser.get(console.url + "/cluster")
    assert "Cluster" in browser.title
    assert seeded.address in text(browser)
    # the live part is refreshed by the page's script, and the chart gets samples
    live = browser.find_element(By.CSS_SELECTOR, "[data-live]")
    wait_for(lambda: live.get_attribute("data-updated"), timeout=15)
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "figure.chart polyline"), timeout=15)
    shot(browser, "cluster")

    browser.get(console.url + "/topics")
    assert "orders" in text(browser) and "invoices" in text(browser)
    shot(browser, "topics")
    click(browser, By.LINK_TEXT, "orders")
    assert "shipping" in text(browser)

    browser.get(console.url + "/groups")
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "figure.chart polyline"), timeout=15)
    shot(browser, "groups")
    click(browser, By.LINK_TEXT, "shipping")
    assert "group=shipping" in browser.current_url
    assert text_of(browser, By.ID, "group-lag") == "3"
    # the chart's total is the page's, at the same moment, also after a live refresh
    total = '.legend[data-line="total"] .last'
    assert text_of(browser, By.CSS_SELECTOR, total) == "3"
    live = browser.find_element(By.CSS_SELECTOR, "[data-live]")
    first = live.get_attribute("data-updated")
    wait_for(lambda: live.get_attribute("data-updated") != first, timeout=15)
    assert text_of(browser, By.CSS_SELECTOR, total) == text_of(browser, By.ID, "group-lag")
    shot(browser, "group")

    browser.get(f"{console.url}/message?key=order-42")
    body = browser.find_element(By.CSS_SELECTOR, "pre.body.json").text
    assert '"order": 42' in body and '"a<b>"' in body
    shot(browser, "message")

    browser.get(console.url + "/transactions")
    assert seeded.pending_id in text(browser) and seeded.parked_id in text(browser)
    shot(browser, "transactions")

    browser.get(console.url + "/dlq?group=billing")
    assert seeded.dead_id in text(browser)
    shot(browser, "dlq")

    browser.get(console.url + "/outbox")
    assert "Outbox" in browser.title and "orders.db" in text(browser)
    assert text_of(browser, By.CSS_SELECTOR, "#outbox-0 td.backlog") == "1"
    shot(browser, "outbox")

    browser.get(console.url + "/sagas")
    assert "Sagas" in browser.title and "orders.db" in text(browser)
    assert text_of(browser, By.CSS_SELECTOR, "#sagas-0 td.count-PARKED") == "2"
    shot(browser, "sagas")
    click(browser, By.LINK_TEXT, "parked-1")
    assert text_of(browser, By.ID, "saga-state") == "PARKED"
    assert "refund failed" in text_of(browser, By.ID, "saga-error")
    assert "<script>" in text(browser)  # the data's script, shown as text
    shot(browser, "saga")

    browser.get(console.url + "/reconcile")
    assert "Reconciliation" in browser.title
    assert text_of(browser, By.ID, "verdict") == "Needs attention: 1 anomaly"
    shot(browser, "reconcile")
    assert "Traceback" not in console.output()


def test_a_script_body_is_shown_as_text_and_never_run(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    browser.get(f"{console.url}/message?id={seeded.script_id}")
    assert no_alert(browser, 2.0)
    shown = browser.find_element(By.CSS_SELECTOR, "pre.body.text").text
    assert shown == SCRIPT_BODY.decode()
    assert "evil<key>" in text(browser)
    # still after a refresh of the live part of another page showing it
    browser.get(console.url + "/dlq?group=billing")
    assert no_alert(browser, 1.5)


def _decide(browser: WebDriver, row: str, button: str, reason: str) -> str:
    """Click ``button`` in the transaction row ``row``, give the reason the console's page
    asks for, confirm; the flash the page shows then."""
    click(browser, By.CSS_SELECTOR, button, inside=row)
    field = WebDriverWait(browser, 10).until(ec.presence_of_element_located((By.ID, "reason")))
    field.send_keys(reason)
    browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    flash = WebDriverWait(browser, 10).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, ".flash"))
    )
    return str(flash.text)


def test_commit_transactions_from_the_page(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    browser.get(console.url + "/transactions")
    pending = f'#pending tr[data-msg-id="{seeded.pending_id}"]'
    assert f"{seeded.pending_id}: COMMIT recorded" in _decide(
        browser, pending, "button.commit", "paid by phone"
    )
    consumed = read_topic(seeded.address, "payments", group="payments-reader")
    assert [m.body for m in consumed] == [b"payment 9"]
    assert "operator 127.0.0.1: COMMIT the half message" in console.output()

    # a parked one: nobody checks it back any more; the operator's COMMIT delivers it
    parked = f'#parked tr[data-msg-id="{seeded.parked_id}"]'
    assert f"{seeded.parked_id}: COMMIT recorded" in _decide(
        browser, parked, "button.commit", "stuck <b>payment</b> confirmed"
    )
    consumed = read_topic(seeded.address, "payments", group="payments-reader")
    assert sorted(m.body for m in consumed) == [b"payment 9", b"stuck payment"]
    decided = text_of(browser, By.ID, "decided")
    assert "stuck <b>payment</b> confirmed" in decided and "paid by phone" in decided
    assert (
        browser.find_elements(By.CSS_SELECTOR, f'#parked tr[data-msg-id="{seeded.parked_id}"]')
        == []
    )


def test_cancelled_confirmation_does_nothing(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    browser.get(console.url + "/transactions")
    row = f'#pending tr[data-msg-id="{seeded.pending_id}"]'
    click(browser, By.CSS_SELECTOR, "button.danger", inside=row)
    WebDriverWait(browser, 10).until(ec.presence_of_element_located((By.ID, "reason")))
    click(browser, By.LINK_TEXT, "Cancel")
    assert no_alert(browser, 0.5)
    assert browser.find_elements(By.CSS_SELECTOR, ".flash") == []
    assert read_topic(seeded.address, "payments", group="payments-reader") == []
    browser.get(console.url + "/transactions")
    assert browser.find_elements(By.CSS_SELECTOR, row)


def test_resend_a_dead_letter_from_the_page(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    browser.get(console.url + "/dlq")
    click(browser, By.LINK_TEXT, "billing")
    click(browser, By.TAG_NAME, "button", inside=f'tr[data-msg-id="{seeded.dead_id}"]')
    WebDriverWait(browser, 5).until(ec.alert_is_present()).accept()
    WebDriverWait(browser, 10).until(ec.presence_of_element_located((By.CSS_SELECTOR, ".flash")))
    assert (
        "re-sent 1 message(s) to %RETRY%billing"
        in browser.find_element(By.CSS_SELECTOR, ".flash").text
    )
    again = read_topic(seeded.address, "%RETRY%billing", group="billing")
    assert [(m.msg_id, m.body) for m in again] == [(seeded.dead_id, b"invoice 7")]


def test_delete_a_topic_from_the_page_by_typing_its_name(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    from selenium.webdriver.support.ui import Select

    from txmq.sync import AdminClient

    browser.get(console.url + "/topics")
    Select(browser.find_element(By.CSS_SELECTOR, "#delete-topic select")).select_by_visible_text(
        "invoices"
    )
    browser.find_element(By.CSS_SELECTOR, "#delete-topic input[name=typed]").send_keys("invoice")
    browser.find_element(By.CSS_SELECTOR, "#delete-topic button").click()
    # a wrong name: the page that asks again, and nothing deleted
    wrong = WebDriverWait(browser, 10).until(ec.presence_of_element_located((By.ID, "typed-wrong")))
    assert wrong.text == "You typed “invoice”, not “invoices”: nothing was done."
    assert no_alert(browser, 0.5)
    with AdminClient(seeded.address) as admin:
        assert "invoices" in {t.topic for t in admin.topics()}
    browser.find_element(By.ID, "typed").send_keys("invoices")
    browser.find_element(By.CSS_SELECTOR, "#confirm-form button[type=submit]").click()
    flash = WebDriverWait(browser, 10).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, ".flash"))
    )
    assert flash.text == "topic invoices deleted"
    assert "invoices" not in text_of(browser, By.ID, "topics")
    with AdminClient(seeded.address) as admin:
        assert "invoices" not in {t.topic for t in admin.topics()}
    assert "operator 127.0.0.1: deleted topic 'invoices'" in console.output()


#: for each URL the page shows (CSS selector arguments[0]): its text, how many lines it
#: spans, and the pieces of it (text between two of its <wbr>) a line end cut, as laid out
_URL_LINES = """
const out = [];
for (const url of document.querySelectorAll(arguments[0])) {
  const tops = new Set();
  const cut = [];
  for (const piece of url.children) {
    const range = document.createRange();
    range.selectNodeContents(piece);
    const lines = new Set(
      [...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
    lines.forEach((top) => tops.add(top));
    if (lines.size > 1) cut.push(piece.textContent);
  }
  out.push({text: url.textContent, lines: tops.size, cut: cut});
}
return out;
"""


def test_a_database_url_wraps_at_its_separators(
    browser: WebDriver, console: ConsoleProcess, seeded: Seeded
) -> None:
    """The transactions page's database column is narrow: its URL (sqlite:////tmp/...)
    wraps at slashes, never inside a folder or file name (the CSS used to break it
    anywhere)."""
    browser.get(console.url + "/transactions")
    selector = "#pending td.db-log .url"
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, selector), timeout=15)
    shot(browser, "transactions-narrow")
    [shown] = browser.execute_script(_URL_LINES, selector)
    assert shown["text"].startswith("sqlite:///") and shown["text"].endswith("/orders.db")
    assert shown["lines"] > 1, shown  # it does wrap here...
    assert shown["cut"] == [], shown  # ...between its pieces only
    # the outbox page's heading: the same URL, on one line when there is room
    browser.get(console.url + "/outbox")
    [heading] = browser.execute_script(_URL_LINES, "#outbox-0 h2 .url")
    assert heading["text"] == shown["text"] and heading["cut"] == []


def test_a_broker_that_goes_down_is_a_clear_page(
    browser: WebDriver, console_process: Callable[..., ConsoleProcess]
) -> None:
    from tests.conftest import free_port

    nobody = f"127.0.0.1:{free_port()}"
    console = console_process("--broker", nobody)
    browser.get(console.url + "/topics")
    assert "503 · Broker unavailable" in text(browser)
    assert f"broker {nobody} did not answer" in text(browser)
    browser.get(console.url + "/message?id=whatever")
    assert "503" in text(browser) and "Traceback" not in browser.page_source
