"""One order followed through the orders example by its trace: the HTTP request that
places it (order service), the transactional send of OrderCreated, the inventory service's
consumer span, the outbox relay's send of the reply and the order service's consumer span
are all in the request's trace; and the front's ``?wait=`` answers once the inventory
consumed the order (txmq.wait_consumed).

The two services run in this process (as in test_orders' front test), with an
OpenTelemetry SDK tracer provider and an in-memory exporter given to txmq
(``txmq.observability.hooks.use_tracer_provider``): no exporter process, nothing global changed."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from examples.orders import db as dbs
from examples.orders.checker import check
from examples.orders.inventory_service import GROUP as INVENTORY
from examples.orders.inventory_service import InventoryService
from examples.orders.models import ORDER_CREATED, STOCK_REPLIES
from examples.orders.order_service import GROUP as ORDERS
from examples.orders.order_service import OrderService
from examples.orders.web import request
from tests.conftest import running_async, wait_for
from tests.observe_support import spans
from txmq.broker.server import EmbeddedBroker

__all__ = ["spans"]  # fixtures


def _one(spans: list[ReadableSpan], name: str, **attributes: object) -> ReadableSpan:
    found = [
        s
        for s in spans
        if s.name == name and all((s.attributes or {}).get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


@pytest.mark.timeout(120)
def test_one_order_is_one_trace_from_the_request_to_the_reply(
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    spans: InMemorySpanExporter,
) -> None:
    b = embedded_broker()
    orders_db, inventory_db = f"sqlite:///{tmp_path / 'o.db'}", f"sqlite:///{tmp_path / 'i.db'}"
    dbs.upgrade("inventory", inventory_db)
    dbs.seed_stock(inventory_db, {"apple": 3})
    dbs.upgrade("orders", orders_db)
    inventory = InventoryService(inventory_db, b.address)
    with running_async(inventory), OrderService(orders_db, b.address) as orders:
        assert orders.server is not None
        status, placed = request(
            orders.server.url, "POST", "/orders?wait=10", {"product": "apple", "quantity": 2}
        )
        assert status == 201 and placed["inventory"] == "consumed", placed
        wait_for(lambda: check(orders_db, inventory_db).pending == 0, timeout=30)
        # the order service's consumer span ends after its handler's commit
        wait_for(
            lambda: any(s.name == f"process {STOCK_REPLIES}" for s in spans.get_finished_spans())
        )
    finished = list(spans.get_finished_spans())
    http = _one(finished, "POST /orders")
    assert http.kind is SpanKind.SERVER and http.parent is None
    tx_send = _one(finished, f"send {ORDER_CREATED}")
    reserve = _one(finished, f"process {ORDER_CREATED}")
    relay_send = _one(finished, f"send {STOCK_REPLIES}")
    reply = _one(finished, f"process {STOCK_REPLIES}")
    assert tx_send.attributes is not None and reserve.attributes is not None
    assert tx_send.attributes["messaging.rocketmq.message.type"] == "transaction"
    assert tx_send.attributes["messaging.message.id"] == placed["msg_id"]
    assert reserve.attributes["messaging.consumer.group.name"] == INVENTORY
    assert reply.attributes is not None
    assert reply.attributes["messaging.consumer.group.name"] == ORDERS
    trace_id = http.context.trace_id
    chain = [http, tx_send, reserve, relay_send, reply]
    assert {s.context.trace_id for s in chain} == {trace_id}
    for parent, child in itertools.pairwise(chain):
        assert child.parent is not None and child.parent.span_id == parent.context.span_id, (
            parent.name,
            child.name,
        )
