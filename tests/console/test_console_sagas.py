"""The console's sagas pages over HTTP (Starlette's TestClient) against a real broker
process and real SQLite databases: the list by state, one saga with its step log and how
long each answer took, and an operator's retry and resolve with a reason — the retry's
command reaching the broker as a transactional message."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess
from tests.console.conftest import NO_EXTRA, read_topic

pytest.importorskip("starlette", reason=NO_EXTRA)
pytest.importorskip("httpx2", reason=NO_EXTRA)

from sqlalchemy import create_engine, insert
from starlette.testclient import TestClient

from txmq.console import ConsoleConfig, create_app
from txmq.saga import Saga, Step, saga_info
from txmq.sqla import metadata as txmq_metadata
from txmq.sqla.db import with_connection
from txmq.sqla.tables import saga_steps, sagas

EVIL = "<script>alert(1)</script>"
CHECKOUT = Saga(
    "checkout",
    [
        Step("reserve-stock", "inventory", compensation="release-stock"),
        Step("charge", "payment", compensation="refund", compensation_retries=1),
        Step("confirm-order", "orders"),
    ],
)


def seed_sagas(url: str) -> None:
    """Three sagas of a shop: one completed, two parked on the refund of their charge."""
    engine = create_engine(url)
    t0 = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC)
    with engine.begin() as conn:
        txmq_metadata.create_all(conn)
        for saga_id, state in (("done-1", "COMPLETED"), ("parked-1", "PARKED"),
                               ("parked-2", "PARKED")):  # fmt: skip
            parked = state == "PARKED"
            conn.execute(
                insert(sagas).values(
                    saga_id=saga_id, name="checkout", definition=CHECKOUT.to_dict(),
                    coordinator="shop", state=state, step=1 if parked else 2,
                    op="compensation" if parked else "action", command_id="c-old",
                    data={"order": saga_id, "note": EVIL}, effected=[0, 1] if parked else [0, 1, 2],
                    error=f"refund failed: ConnectionError: {EVIL}" if parked else None,
                )
            )  # fmt: skip
            log = [
                ("reserve-stock", 0, "action", "sent", None, None, 0.0),
                ("reserve-stock", 0, "action", "done", 1, None, 0.25),
                ("charge", 1, "action", "sent", None, None, 0.3),
                ("charge", 1, "action", "done", 1, None, 1.8),
            ]
            if parked:
                log += [
                    ("charge", 2, "action", "refused", 1, "the order was cancelled", 2.5),
                    ("charge", 1, "compensation", "sent", None, None, 2.6),
                    ("charge", 1, "compensation", "failed", 2, f"ConnectionError: {EVIL}", 9.6),
                ]
            conn.execute(
                insert(saga_steps),
                [
                    {"saga_id": saga_id, "branch": b, "step": s, "op": op, "event": e,
                     "attempts": a, "detail": d, "at": t0 + timedelta(seconds=at)}
                    for b, s, op, e, a, d, at in log
                ],
            )  # fmt: skip
    engine.dispose()


def _csrf(web: TestClient) -> str:
    web.get("/sagas")
    value = web.cookies.get("txmq_csrf")
    assert value
    return value


def test_sagas_pages_list_show_and_let_an_operator_retry_and_resolve(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_process().start()
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    seed_sagas(url)
    app = create_app(ConsoleConfig(broker=broker.address, dbs=[url]), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as web:
        page = web.get("/sagas")
        assert page.status_code == 200 and "Traceback" not in page.text
        assert 'href="/sagas" class="here"' in page.text
        assert re.search(r'class="count-PARKED bad">2<', page.text)
        assert re.search(r'class="count-COMPLETED">1<', page.text)
        assert EVIL not in page.text and html.escape(EVIL) in page.text
        parked = web.get("/sagas", params={"state": "PARKED"}).text
        assert 'data-saga-id="parked-1"' in parked and 'data-saga-id="done-1"' not in parked
        assert web.get("/sagas", params={"state": "NOPE"}).status_code == 400

        one = web.get("/saga", params={"db": "0", "id": "parked-1"})
        assert one.status_code == 200 and EVIL not in one.text
        assert '<td id="saga-state" class="bad">PARKED</td>' in one.text
        assert "1.500 s" in one.text  # the charge answered 1.5 s after its command
        assert "7.000 s" in one.text  # the refund gave up 7 s after it was sent
        assert 'id="saga-retry"' in one.text and 'id="saga-resolve"' in one.text
        assert web.get("/saga", params={"db": "0", "id": "nope"}).status_code == 404
        assert web.get("/saga", params={"db": "9", "id": "x"}).status_code == 400

        csrf = _csrf(web)
        form = {"db": "0", "id": "parked-1", "action": "retry", "csrf_token": csrf}
        asked = web.post("/saga/act", data=form)
        assert asked.status_code == 200 and "Reason (recorded in the saga" in asked.text
        no_reason = web.post("/saga/act", data={**form, "confirm": "yes", "reason": " "})
        assert "A reason is needed." in no_reason.text
        assert with_connection(url, lambda c: saga_info(c, "parked-1")).state == "PARKED"

        done = web.post("/saga/act", data={**form, "confirm": "yes", "reason": "bank is back"})
        assert done.status_code == 200 and "retry recorded (bank is back); now COMPENSATING" in (
            done.text
        )
        info = with_connection(url, lambda c: saga_info(c, "parked-1"))
        assert info.state == "COMPENSATING" and info.steps[-2].op == "operator"
        assert (
            info.steps[-2].detail.startswith("console (")
            and "bank is back" in info.steps[-2].detail
        )
        sent = read_topic(broker.address, "saga-payment")  # the refund again, through the broker
        assert [m.keys for m in sent] == [["parked-1/1/compensation"]]

        resolve = {**form, "id": "parked-2", "action": "resolve", "confirm": "yes"}
        done = web.post("/saga/act", data={**resolve, "reason": "refunded by hand, ticket 9"})
        assert "now COMPENSATING" in done.text  # on to the stock's release
        again = web.post("/saga/act", data={**resolve, "reason": "twice"})
        assert "is COMPENSATING, not PARKED" in again.text
