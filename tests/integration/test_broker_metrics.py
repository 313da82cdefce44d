"""The broker's Prometheus endpoint (``txmq broker start --metrics-port``), scraped while
real traffic runs: messages in, consumer lag up then down, transactions committed, rolled
back and parked, retries and dead letters, replication lag; and the port's settings."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, BrokerProcess, ask, free_port, wait_for
from txmq import LocalTransactionState, Message
from txmq.protocol.message import MessageExt, Prop
from txmq.protocol.wire import ConsumerSendMsgBack, GetMaxOffset
from txmq.sync import Producer, PullConsumer, TransactionProducer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Start = Callable[..., BrokerProcess]


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, parsed by prometheus_client's own text parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples: Samples, name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for (n, ls) in samples)


def with_metrics(broker_process: Start, *args: str, **kw: Any) -> tuple[BrokerProcess, int]:
    port = free_port()
    bp = broker_process("--metrics-port", str(port), *args, **kw)
    return bp, port


def test_messages_in_and_out_and_lag_up_then_down(broker_process: Start) -> None:
    bp, port = with_metrics(broker_process)
    bp.start()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in bp.output()
    topic, group = "m-orders", "m-billing"
    before = scrape(port)
    assert value(before, "rocketmq_messages_in_total", topic=topic) == 0
    assert has(before, "txmq_commitlog_size_bytes") and has(before, "process_cpu_seconds_total")
    with Producer(bp.address) as producer, PullConsumer(bp.address, group) as consumer:
        bodies = [f"order {i}".encode() for i in range(10)]
        for body in bodies:
            producer.send(Message(topic, body))
        now = scrape(port)
        labels = {"topic": topic, "message_type": "normal"}
        assert value(now, "rocketmq_messages_in_total", **labels) == 10
        assert value(now, "rocketmq_throughput_in_total", topic=topic) == sum(map(len, bodies))
        assert value(now, "rocketmq_message_size_count", **labels) == 10
        assert value(now, "rocketmq_message_size_bucket", le="1024", **labels) == 10
        sends = {"protocol_type": "remoting", "request_code": "send_message"}
        assert value(now, "rocketmq_rpc_latency_count", response_code="success", **sends) >= 10

        def drain() -> int:
            got = 0
            for q in range(4):
                offset = max(consumer.fetch_offset(topic, q), 0)
                res = consumer.pull(topic, q, offset, long_poll=0)
                got += len(res.messages)
                consumer.commit_offset(topic, q, res.next_offset)
            return got

        assert drain() == 10
        lag = {"topic": topic, "consumer_group": group}
        now = scrape(port)
        assert value(now, "rocketmq_consumer_lag_messages", **lag) == 0
        assert value(now, "rocketmq_messages_out_total", **lag) == 10
        assert value(now, "rocketmq_send_to_consumer_latency_count", **lag) == 10

        # nothing consumes: the lag goes up by what is sent, all of it ready
        for i in range(7):
            producer.send(Message(topic, f"late {i}".encode()))
        now = scrape(port)
        assert value(now, "rocketmq_messages_in_total", **labels) == 17
        assert value(now, "rocketmq_consumer_lag_messages", **lag) == 7
        assert value(now, "rocketmq_consumer_ready_messages", **lag) == 7
        assert value(now, "rocketmq_consumer_inflight_messages", **lag) == 0

        # pulled, not committed yet: in flight; then committed: back to 0
        def behind(q: int) -> int:
            end = ask(bp.address, GetMaxOffset(topic=topic, queue_id=q)).offset
            return end - consumer.fetch_offset(topic, q)

        q = next(q for q in range(4) if behind(q) > 0)
        res = consumer.pull(topic, q, consumer.fetch_offset(topic, q), long_poll=0)
        now = scrape(port)
        assert value(now, "rocketmq_consumer_inflight_messages", **lag) == len(res.messages)
        assert value(now, "rocketmq_consumer_lag_messages", **lag) == 7
        consumer.commit_offset(topic, q, res.next_offset)
        assert drain() == 7 - len(res.messages)
        now = scrape(port)
        assert value(now, "rocketmq_consumer_lag_messages", **lag) == 0
        assert value(now, "rocketmq_consumer_inflight_messages", **lag) == 0
        assert value(now, "rocketmq_messages_out_total", **lag) == 17
    assert value(now, "txmq_commitlog_size_bytes") > 0


class Answers:
    """A transaction listener: checks answer by transaction id, UNKNOWN otherwise."""

    def __init__(self, answers: dict[str, LocalTransactionState]) -> None:
        self.answers = answers

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        tid = msg.get_property(Prop.TRANSACTION_ID) or ""
        return self.answers.get(tid, LocalTransactionState.UNKNOWN)


def test_transactions_committed_rolled_back_checked_and_parked(broker_process: Start) -> None:
    bp, port = with_metrics(broker_process)
    bp.env.update(
        TXMQ_BROKER_TRANSACTION_CHECK_MAX="1",
        TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S="1",
        TXMQ_BROKER_TRANSACTION_TIMEOUT_S="1",
    )
    bp.start()
    group, topic = "m-tx", "m-payments"
    pg = {"producer_group": group}
    listener = Answers({"checked-commit": LocalTransactionState.COMMIT})
    with TransactionProducer(bp.address, group, listener=listener) as p:
        committed = p.send_half(Message(topic, b"a"), transaction_id="commit")
        rolled = p.send_half(Message(topic, b"b"), transaction_id="rollback")
        p.send_half(Message(topic, b"c"), transaction_id="checked-commit")
        p.send_half(Message(topic, b"d"), transaction_id="stuck")
        now = scrape(port)
        assert value(now, "txmq_half_messages_prepared_total", **pg) == 4
        assert value(now, "txmq_half_messages_pending", **pg) == 4
        assert value(now, "txmq_half_messages_oldest_age_seconds", **pg) >= 0
        assert p.end_transaction(committed, LocalTransactionState.COMMIT) == "COMMITTED"
        assert p.end_transaction(rolled, LocalTransactionState.ROLLBACK) == "ROLLED_BACK"
        now = scrape(port)
        assert value(now, "txmq_half_messages_committed_total", **pg) == 1
        assert value(now, "txmq_half_messages_rolled_back_total", **pg) == 1
        assert value(now, "txmq_half_messages_pending", **pg) == 2
        assert (
            value(now, "rocketmq_messages_in_total", topic=topic, message_type="transaction") == 1
        )

        # "checked-commit" is committed by its check-back; "stuck" stays UNKNOWN and is
        # parked after its one check (transaction_check_max 1)
        def parked() -> Samples | None:
            now = scrape(port)
            return now if value(now, "txmq_half_messages_parked_total", **pg) == 1 else None

        now = wait_for(parked, timeout=60)
    assert value(now, "txmq_parked_transactions") == 1
    assert value(now, "txmq_half_messages_checked_total", **pg) >= 2
    assert value(now, "txmq_transaction_check_answers_total", state="COMMIT", **pg) == 1
    assert value(now, "txmq_half_messages_committed_total", **pg) == 2
    assert value(now, "txmq_half_messages_pending", **pg) == 0
    assert value(now, "rocketmq_messages_in_total", topic=topic, message_type="transaction") == 2


def test_retries_and_dead_letters_per_group(broker_process: Start) -> None:
    bp, port = with_metrics(broker_process)
    bp.start()
    topic, group = "m-mail", "m-mailer"
    cg = {"consumer_group": group}
    with Producer(bp.address) as producer, PullConsumer(bp.address, group) as consumer:
        for i in range(3):
            producer.send(Message(topic, f"mail {i}".encode()), queue_id=0)
        [first, second, third] = consumer.pull(topic, 0, 0, long_poll=0).messages
        assert value(scrape(port), "txmq_retry_messages_total", **cg) == 0
        for msg, level in ((first, 0), (second, 0), (third, -1)):
            ask(
                bp.address,
                ConsumerSendMsgBack(
                    group=group,
                    commit_log_offset=msg.commit_log_offset,
                    delay_level=level,
                    max_reconsume_times=16,
                    origin_msg_id=msg.msg_id,
                ),
            )
    now = scrape(port)
    assert value(now, "txmq_retry_messages_total", **cg) == 2
    assert value(now, "txmq_dlq_messages_total", **cg) == 1
    assert value(now, "txmq_dlq_depth_messages", **cg) == 1
    answers = {"request_code": "consumer_send_msg_back", "response_code": "success"}
    assert value(now, "rocketmq_rpc_latency_count", **answers) == 3


def test_replication_lag_on_master_and_slave(broker_process: Start, tmp_path: Path) -> None:
    ha = free_port()
    master, master_port = with_metrics(broker_process, "--ha-port", str(ha), store=tmp_path / "m")
    master.start()
    slave_metrics = free_port()
    slave = BrokerProcess(
        tmp_path / "s",
        [
            "--broker-id",
            "1",
            "--ha-master",
            f"127.0.0.1:{ha}",
            "--metrics-port",
            str(slave_metrics),
        ],
        tmp_path / "slave.log",
    )
    try:
        slave.start()

        def connected() -> Samples | None:
            now = scrape(slave_metrics)
            return now if value(now, "txmq_replication_connected") == 1 else None

        on_slave = wait_for(connected, timeout=30)
        assert has(on_slave, "txmq_broker_info", role="SLAVE", broker_id="1")
        assert has(on_slave, "txmq_replication_lag_bytes", slave_id="1")
        with Producer(master.address) as producer:
            for i in range(20):
                producer.send(Message("m-replicated", f"r{i}".encode() * 100))
        end = value(scrape(master_port), "txmq_commitlog_max_offset_bytes")
        assert end > 0

        def caught_up() -> bool:
            on_master = scrape(master_port)
            return (
                has(on_master, "txmq_replication_lag_bytes", slave_id="1")
                and value(on_master, "txmq_replication_lag_bytes", slave_id="1") == 0
                and value(scrape(slave_metrics), "txmq_commitlog_max_offset_bytes") == end
                and value(scrape(slave_metrics), "txmq_replication_lag_bytes") == 0
            )

        wait_for(caught_up, timeout=30)
        on_master = scrape(master_port)
        assert has(on_master, "txmq_broker_info", role="ASYNC_MASTER", broker_id="0")
        assert has(on_master, "txmq_replication_lag_seconds", slave_id="1")
    finally:
        if slave.alive():
            slave.terminate()


def _start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "txmq.cli", "broker", "start", "--store", str(tmp_path / "s")),
            *("--port", "0", "--grpc-port", "0", *args),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_bad_and_taken_metrics_ports_say_so_in_one_line(tmp_path: Path) -> None:
    for bad in ("70000", "-2"):
        out = _start(tmp_path, "--metrics-port", bad)
        assert out.returncode != 0 and f"metrics_port {bad}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = _start(tmp_path, "--metrics-port", str(port))
    assert out.returncode != 0, out.stderr
    assert f"the metrics port 127.0.0.1:{port} is in use" in out.stderr
    assert "--metrics-port" in out.stderr and "Traceback" not in out.stderr


def test_metrics_off_and_other_paths(broker_process: Start, tmp_path: Path) -> None:
    bp, port = with_metrics(broker_process)
    bp.start()
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=10)
        raise AssertionError("expected a 404")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
    bp.terminate()
    off = BrokerProcess(tmp_path / "off", [], tmp_path / "off.log").start()  # --metrics-port 0
    try:
        assert "metrics on" not in off.output()
    finally:
        off.terminate()
