"""One order followed through the orders example by its trace: the HTTP request that
places it (order service), the transactional send of its saga's first command, the
inventory's consumer span and its answer, the coordinator's consumer span and its next
command to the payment service, and so on to the order service's own last step — all in
the request's trace, each span the child of the one before; and the front's ``?wait=``
answers once the saga ended.

The three services run in this process (as in test_orders' front test), with an
OpenTelemetry SDK tracer provider and an in-memory exporter given to txmq
(``txmq.observability.hooks.use_tracer_provider``): no exporter process, nothing global
changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from examples.orders import db as dbs
from examples.orders.checker import check
from examples.orders.inventory_service import InventoryService
from examples.orders.order_service import OrderService
from examples.orders.payment_service import PaymentService
from examples.orders.web import request
from tests.conftest import running_async, wait_for
from tests.observe_support import spans
from txmq.broker.server import EmbeddedBroker

__all__ = ["spans"]  # fixtures

#: the order's path, each span the child of the one before it
CHAIN = [
    "POST /orders",
    "send saga-inventory",
    "process saga-inventory",
    "send saga-orders-replies",
    "process saga-orders-replies",
    "send saga-payment",
    "process saga-payment",
    "send saga-orders-replies",
    "process saga-orders-replies",
    "send saga-orders",
    "process saga-orders",
    "send saga-orders-replies",
    "process saga-orders-replies",
]


@pytest.mark.timeout(120)
def test_one_order_is_one_trace_from_the_request_to_its_last_step(
    tmp_path: Path,
    embedded_broker: Callable[..., EmbeddedBroker],
    spans: InMemorySpanExporter,
) -> None:
    b = embedded_broker()
    orders_db, inventory_db, payment_db = (f"sqlite:///{tmp_path / f'{s}.db'}" for s in "oip")
    dbs.upgrade("inventory", inventory_db)
    dbs.seed_stock(inventory_db, {"apple": 3})
    dbs.upgrade("payment", payment_db)
    dbs.seed_accounts(payment_db, {"ann": 100})
    dbs.upgrade("orders", orders_db)
    with (
        running_async(InventoryService(inventory_db, b.address)),
        PaymentService(payment_db, b.address),
        OrderService(orders_db, b.address) as orders,
    ):
        assert orders.server is not None
        order = {"product": "apple", "quantity": 2, "customer": "ann"}
        status, placed = request(orders.server.url, "POST", "/orders?wait=20", order)
        assert status == 201 and placed["state"] == "CONFIRMED", placed
        wait_for(lambda: check(orders_db, inventory_db, payment_db).pending == 0, timeout=30)
        # the coordinator's consumer span of the last answer ends after its commit
        wait_for(lambda: _chain(list(spans.get_finished_spans())) == CHAIN, timeout=30)
    finished = list(spans.get_finished_spans())
    chain = _path(finished)
    http, first_send = chain[0], chain[1]
    assert http.kind is SpanKind.SERVER and http.parent is None
    assert first_send.attributes is not None
    assert first_send.attributes["messaging.rocketmq.message.type"] == "transaction"
    assert first_send.attributes["messaging.message.id"] == placed["msg_id"]
    groups = [
        (s.attributes or {}).get("messaging.consumer.group.name")
        for s in chain
        if s.name.startswith("process ")
    ]
    assert groups == [
        "saga-inventory",
        "saga-orders-coordinator",
        "saga-payment",
        "saga-orders-coordinator",
        "saga-orders",
        "saga-orders-coordinator",
    ]
    assert {s.context.trace_id for s in chain} == {http.context.trace_id}


def _path(finished: list[ReadableSpan]) -> list[ReadableSpan]:
    """From the request's span, each next span of CHAIN's name whose parent is the one
    before it (as far as it goes)."""
    roots = [s for s in finished if s.name == CHAIN[0] and s.parent is None]
    if len(roots) != 1:
        return []
    path = roots
    for name in CHAIN[1:]:
        children = [
            s
            for s in finished
            if s.name == name
            and s.parent is not None
            and s.parent.span_id == path[-1].context.span_id
        ]
        if len(children) != 1:
            break
        path.append(children[0])
    return path


def _chain(finished: list[ReadableSpan]) -> list[str]:
    return [s.name for s in _path(finished)]
