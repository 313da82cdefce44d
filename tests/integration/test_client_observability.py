"""Client traces and metrics with a real broker: one trace from a send to the consumer's
handler (both transports), through a retry and into the DLQ; a transactional send in a
SQLAlchemy transaction and an outbox row relayed continue the trace current when they were
made; the client metrics move; wait_consumed waits for a group's commit, or times out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

import txmq
import txmq.sync
from tests.observe_support import registry, spans
from tests.outbox_support import Db, make_db, until
from tests.sqla_support import TRANSPORTS, start_broker
from txmq import (
    AdminClient,
    ConsumeFrom,
    ConsumeResult,
    Message,
    MessageExt,
    Producer,
    PushConsumer,
    TransactionProducer,
    outbox,
)
from txmq.broker.server import EmbeddedBroker
from txmq.observability import hooks as observe
from txmq.sqla import SqlTransactionChecker, transaction

pytestmark = pytest.mark.anyio

LEVELS = "10ms 20ms 40ms 60ms 80ms 100ms 120ms 140ms 160ms 180ms 200ms 220ms 240ms 260ms"

__all__ = ["registry", "spans"]  # fixtures


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Db]:
    with make_db("sqlite", tmp_path) as d:
        yield d


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def trace_id_of(traceparent: str) -> int:
    return int(traceparent.split("-")[1], 16)


async def _topic(address: str, topic: str) -> None:
    async with AdminClient(address) as admin:
        await admin.create_topic(topic, 2)


def _consumer(address: str, group: str, topic: str, listener: Any, **kw: Any) -> PushConsumer:
    consumer = PushConsumer(
        address,
        group,
        listener=listener,
        consume_from=ConsumeFrom.FIRST_OFFSET,
        persist_interval=0.1,
        **kw,
    )
    consumer.subscribe(topic)
    return consumer


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_send_and_its_processing_share_one_trace(
    embedded_broker: Callable[..., EmbeddedBroker],
    spans: InMemorySpanExporter,
    transport: str,
) -> None:
    via = start_broker(embedded_broker, transport)
    await _topic(via.broker.address, "traced")
    seen: list[tuple[int, int]] = []
    done = anyio.Event()
    tracer = observe.tracer()

    async def listener(msg: MessageExt) -> None:
        # the handler runs inside the consumer span: its own spans are its children
        with tracer.start_as_current_span("handler") as span:
            ctx = span.get_span_context()
            seen.append((ctx.trace_id, ctx.span_id))
        done.set()

    consumer = _consumer(via.address, "g-traced", "traced", listener, **via.kw)
    async with consumer, Producer(via.address, "p-traced", **via.kw) as producer:
        with tracer.start_as_current_span("request") as request:
            result = await producer.send(Message("traced", b"hi", tags="t", keys=["k1"]))
        with anyio.fail_after(30):
            await done.wait()
    trace_id = request.get_span_context().trace_id
    [send] = named(spans, "send traced")
    [process] = named(spans, "process traced")
    [handler] = named(spans, "handler")
    assert send.kind is SpanKind.PRODUCER and process.kind is SpanKind.CONSUMER
    assert {send.context.trace_id, process.context.trace_id, seen[0][0]} == {trace_id}
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert handler.parent is not None and handler.parent.span_id == process.context.span_id
    assert send.attributes is not None and process.attributes is not None
    assert send.attributes["messaging.message.id"] == result.msg_id
    assert process.attributes["messaging.message.id"] == result.msg_id
    assert process.attributes["messaging.consumer.group.name"] == "g-traced"
    assert process.attributes["messaging.destination.name"] == "traced"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unsampled_trace_carries_its_context_end_to_end_without_spans(
    embedded_broker: Callable[..., EmbeddedBroker], transport: str
) -> None:
    """Under a sampler that samples nothing (1 % of traces in production: the rest), txmq
    makes no span — and still carries the trace context: the message sent in an unsampled
    request carries that trace, the consumer's handler runs inside it, and a message the
    handler sends on carries it too; the trace stays unsampled all the way."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observe.use_tracer_provider(provider)
    try:
        via = start_broker(embedded_broker, transport)
        await _topic(via.broker.address, "unsampled")
        await _topic(via.broker.address, "unsampled-on")
        seen: list[tuple[int, bool]] = []
        onward: list[MessageExt] = []
        done = anyio.Event()
        tracer = observe.tracer()
        producer = Producer(via.address, "p-unsampled", **via.kw)

        async def listener(msg: MessageExt) -> None:
            ctx = tracer.start_span("handler").get_span_context()  # (not recorded)
            current = trace.get_current_span().get_span_context()
            seen.append((current.trace_id, current.trace_flags.sampled))
            assert ctx.trace_id == current.trace_id
            await producer.send(Message("unsampled-on", b"on"))

        async def onward_listener(msg: MessageExt) -> None:
            onward.append(msg)
            done.set()

        first = _consumer(via.address, "g-unsampled", "unsampled", listener, **via.kw)
        second = _consumer(via.address, "g-unsampled-on", "unsampled-on", onward_listener, **via.kw)
        async with producer, first, second:
            with tracer.start_as_current_span("request") as request:
                assert not request.is_recording()
                await producer.send(Message("unsampled", b"hi"))
            with anyio.fail_after(30):
                await done.wait()
        trace_id = request.get_span_context().trace_id
        assert seen == [(trace_id, False)]
        [msg] = onward
        parent = msg.properties["traceparent"]
        assert trace_id_of(parent) == trace_id
        assert not int(parent.rsplit("-", 1)[1], 16) & 1  # its sampled flag is off
        assert exporter.get_finished_spans() == ()
    finally:
        observe.use_tracer_provider(None)
        provider.shutdown()


async def test_the_trace_goes_through_retries_into_the_dlq(
    embedded_broker: Callable[..., EmbeddedBroker], spans: InMemorySpanExporter
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    await _topic(eb.address, "flaky")
    attempts: list[int] = []

    async def listener(msg: MessageExt) -> ConsumeResult:
        attempts.append(msg.reconsume_times)
        if len(attempts) == 1:
            return ConsumeResult.RECONSUME_LATER
        raise RuntimeError("still failing")

    consumer = _consumer(eb.address, "g-flaky", "flaky", listener, max_reconsume_times=1)
    tracer = observe.tracer()
    async with consumer, Producer(eb.address) as producer, AdminClient(eb.address) as admin:
        with tracer.start_as_current_span("request") as request:
            await producer.send(Message("flaky", b"poison"))
        dead = await until(lambda: admin.dlq_list("g-flaky"), what="the dead letter")
    trace_id = request.get_span_context().trace_id
    [send] = named(spans, "send flaky")
    processes = named(spans, "process flaky")
    assert attempts == [0, 1] and len(processes) == 2
    for process in processes:
        assert process.context.trace_id == trace_id
        assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert processes[0].attributes is not None and processes[1].attributes is not None
    assert processes[0].attributes["txmq.consume.result"] == "reconsume_later"
    assert processes[1].attributes["txmq.consume.result"] == "error"
    assert processes[1].attributes["txmq.reconsume_times"] == 1
    assert trace_id_of(dead[0].all_properties["traceparent"]) == trace_id


async def test_a_transactional_send_and_a_relayed_outbox_row_continue_their_trace(
    embedded_broker: Callable[..., EmbeddedBroker],
    spans: InMemorySpanExporter,
    db: Db,
) -> None:
    eb = embedded_broker()
    await _topic(eb.address, "tx-orders")
    await _topic(eb.address, "replies")
    got: dict[str, MessageExt] = {}

    async def listener(msg: MessageExt) -> None:
        got[msg.topic] = msg

    tracer = observe.tracer()
    aengine = create_async_engine(db.aurl)
    consumer = _consumer(eb.address, "g-both", "tx-orders", listener)
    consumer.subscribe("replies")
    relay = outbox.OutboxRelay(db.aurl, eb.address, poll_interval=0.05)
    try:
        async with (
            consumer,
            TransactionProducer(
                eb.address, "tx-traced", listener=SqlTransactionChecker(aengine)
            ) as producer,
        ):
            with tracer.start_as_current_span("place order") as placing:
                async with (
                    async_sessionmaker(aengine)() as session,
                    transaction(producer, session) as tx,
                ):
                    await tx.send(Message("tx-orders", b"order 1"))
            with tracer.start_as_current_span("reply") as replying:
                with Session(db.engine) as s, s.begin():
                    outbox.add(s, Message("replies", b"reserved"))
            async with relay:  # started outside any span: the row's context is continued
                await until(lambda: len(got) == 2, what="both messages")
    finally:
        await aengine.dispose()
    [tx_send] = named(spans, "send tx-orders")
    [tx_process] = named(spans, "process tx-orders")
    assert tx_send.attributes is not None
    assert tx_send.attributes["messaging.rocketmq.message.type"] == "transaction"
    assert tx_send.parent is not None
    assert tx_send.parent.span_id == placing.get_span_context().span_id
    assert tx_process.context.trace_id == placing.get_span_context().trace_id
    assert tx_process.parent is not None and tx_process.parent.span_id == tx_send.context.span_id
    [relay_send] = named(spans, "send replies")
    [reply_process] = named(spans, "process replies")
    assert relay_send.parent is not None
    assert relay_send.parent.span_id == replying.get_span_context().span_id
    assert relay_send.context.trace_id == replying.get_span_context().trace_id
    assert reply_process.parent is not None
    assert reply_process.parent.span_id == relay_send.context.span_id


async def test_client_metrics_move(
    embedded_broker: Callable[..., EmbeddedBroker],
    registry: CollectorRegistry,
    db: Db,
) -> None:
    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    eb = embedded_broker(message_delay_levels=LEVELS)
    await _topic(eb.address, "counted")
    handled: list[str] = []

    aengine = create_async_engine(db.aurl)

    @txmq.idempotent(async_sessionmaker(aengine), group="g-counted")
    async def handle(msg: MessageExt, session: AsyncSession) -> ConsumeResult:
        handled.append(msg.body.decode())
        if msg.body == b"later" and msg.reconsume_times == 0:
            return ConsumeResult.RECONSUME_LATER
        return ConsumeResult.SUCCESS

    consumer = _consumer(eb.address, "g-counted", "counted", handle)
    try:
        async with consumer, Producer(eb.address) as producer:
            for body in ("a", "later"):
                await producer.send(Message("counted", body.encode(), keys=[body]))
            await producer.send(Message("counted", b"a again", keys=["a"]))  # a duplicate
            await until(
                lambda: (
                    value("txmq_idempotent_duplicates_total", group="g-counted") == 1
                    and handled.count("later") == 2
                ),
                what="every message consumed",
            )
    finally:
        await aengine.dispose()
    assert value("txmq_client_send_seconds_count", topic="counted", result="ok") == 3
    assert value("txmq_client_send_seconds_sum", topic="counted", result="ok") > 0
    consumed = "txmq_client_consume_seconds_count"
    labels = {"group": "g-counted", "topic": "counted"}
    assert value(consumed, **labels, result="success") == 3  # a, later (2nd), the duplicate
    assert value(consumed, **labels, result="reconsume_later") == 1
    # the outbox: rows waiting, then sent
    with Session(db.engine) as s, s.begin():
        for i in range(5):
            outbox.add(s, Message("counted", f"row {i}".encode()))
    relay = outbox.OutboxRelay(db.aurl, eb.address, poll_interval=0.05, metrics_interval=0.05)
    await relay.update_metrics()
    assert value("txmq_outbox_backlog_rows") == 5
    assert value("txmq_outbox_lag_seconds") > 0
    assert value("txmq_outbox_parked_rows") == 0
    async with relay:
        await until(lambda: value("txmq_outbox_backlog_rows") == 0, what="the backlog drained")
    assert value("txmq_outbox_lag_seconds") == 0
    assert value("txmq_client_send_seconds_count", topic="counted", result="ok") == 4


async def test_wait_consumed_returns_once_the_group_committed_and_times_out_otherwise(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    await _topic(eb.address, "waited")
    release = anyio.Event()

    async def listener(msg: MessageExt) -> None:
        await release.wait()

    consumer = _consumer(eb.address, "g-waited", "waited", listener)
    async with consumer, Producer(eb.address) as producer:
        result = await producer.send(Message("waited", b"1", keys=["order-7"]))
        with pytest.raises(txmq.ConsumeTimeout, match=r"g-waited.*has not consumed"):
            await txmq.wait_consumed(result.msg_id, "g-waited", eb.address, timeout=0.5)
        release.set()
        with anyio.fail_after(15):
            found = await txmq.wait_consumed(result.msg_id, "g-waited", eb.address, timeout=10)
            assert found.msg_id == result.msg_id and found.topic == "waited"
            by_key = await txmq.wait_consumed("order-7", "g-waited", eb.address, timeout=10)
            assert by_key.msg_id == result.msg_id
        # a group that consumes nothing; a message nobody sent
        with pytest.raises(TimeoutError, match="'nobody'"):
            await txmq.wait_consumed(result.msg_id, "nobody", eb.address, timeout=0.3)
        with pytest.raises(txmq.ConsumeTimeout, match="no message 'order-none'"):
            await txmq.wait_consumed("order-none", "g-waited", eb.address, timeout=0.3)
    # the blocking twin
    found = await anyio.to_thread.run_sync(
        lambda: txmq.sync.wait_consumed("order-7", "g-waited", eb.address, timeout=10)
    )
    assert found.msg_id == result.msg_id
