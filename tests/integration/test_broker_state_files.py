"""The broker's state files (topics, consumer offsets, delay and transaction offsets, the
timer checkpoint) hold only what the broker checked, and a damaged one never stops the
broker from starting."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BrokerProcess, wait_for
from tests.raw_client import RawClient, still_serving
from txmq import Message
from txmq.protocol.connection import error_message
from txmq.protocol.wire import RequestCode
from txmq.protocol.wire.errors import ResponseCode
from txmq.sync import AdminClient, Producer, PullConsumer

OFFSET = RequestCode.UPDATE_CONSUMER_OFFSET


@pytest.fixture
def raw() -> Iterator[Callable[[str], RawClient]]:
    opened: list[RawClient] = []

    def connect(address: str) -> RawClient:
        opened.append(RawClient(address))
        return opened[-1]

    yield connect
    for client in opened:
        client.sock.close()


def _config(store: Path, name: str) -> Any:
    return json.loads((store / "config" / name).read_text())


def test_only_checked_offsets_are_saved_and_the_broker_starts_again(
    broker_process: Callable[..., BrokerProcess], raw: Callable[[str], RawClient], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    broker = broker_process(store=store).start()
    with AdminClient(broker.address) as admin:
        admin.create_topic("orders", 4)
    client = raw(broker.address)
    good = {"group": "billing", "topic": "orders", "queue_id": 2, "offset": 7}
    refused: list[tuple[dict[str, Any], ResponseCode, str]] = [
        ({**good, "offset": None}, ResponseCode.BAD_REQUEST, "'offset'"),
        ({**good, "queue_id": None}, ResponseCode.BAD_REQUEST, "'queue_id'"),
        ({**good, "offset": "7"}, ResponseCode.BAD_REQUEST, "'offset'"),
        ({**good, "offset": -1}, ResponseCode.BAD_REQUEST, "negative"),
        ({**good, "queue_id": -1}, ResponseCode.BAD_REQUEST, "out of range"),
        ({**good, "queue_id": 4}, ResponseCode.BAD_REQUEST, "out of range"),
        ({**good, "group": ""}, ResponseCode.BAD_REQUEST, "'group'"),
        ({**good, "group": None}, ResponseCode.BAD_REQUEST, "'group'"),
        ({**good, "topic": ""}, ResponseCode.BAD_REQUEST, "'topic'"),
        ({**good, "topic": "a/b"}, ResponseCode.TOPIC_NOT_EXIST, "does not exist"),
        ({**good, "topic": "zürich ☃"}, ResponseCode.TOPIC_NOT_EXIST, "does not exist"),
        ({**good, "topic": "never-created"}, ResponseCode.TOPIC_NOT_EXIST, "does not exist"),
    ]
    for header, code, text in refused:
        frame = client.request(OFFSET, header)
        assert (frame.code, text in error_message(frame)) == (code, True), header
    assert client.request(OFFSET, good).code == ResponseCode.SUCCESS
    assert broker.terminate() == 0  # a clean stop persists the offsets

    assert _config(store, "offsets.json") == {"offsets": {"billing": {"orders": {"2": 7}}}}
    broker = broker_process(store=store).start()
    with PullConsumer(broker.address, group="billing") as consumer:
        assert consumer.fetch_offset("orders", 2) == 7
    still_serving(broker.address)


def _damage(store: Path) -> None:
    config = store / "config"
    offsets = _config(store, "offsets.json")
    offsets["offsets"]["billing"]["orders"].update({"1": None, "None": 7, "3": -2})
    offsets["offsets"]["billing"]["a/b"] = {"0": 1}
    offsets["offsets"]["audit"] = "not a map"
    (config / "offsets.json").write_text(json.dumps(offsets))
    topics = _config(store, "topics.json")
    topics["topics"]["bad/name"] = {"name": "bad/name", "queue_nums": 4}
    topics["topics"]["zero"] = {"name": "zero", "queue_nums": 0}
    (config / "topics.json").write_text(json.dumps(topics))
    (config / "delay_offsets.json").write_text('{"offsets": {"3": 1, "x": 2')  # torn
    (config / "timer_checkpoint.json").write_text('{"delivered_ms": "soon"')  # torn
    (config / "transaction_offsets.json").write_text(
        json.dumps({"check_offset": -1, "op_offset": None, "check_times": {"0": "many"}})
    )


def _timed(address: str) -> list[bytes]:
    """The bodies in topic "timed" (one queue)."""
    with PullConsumer(address, "timed-reader") as consumer:
        got = consumer.pull("timed", 0, 0, max_msgs=32, long_poll=0)
        return [m.body for m in got.messages]


def test_a_damaged_state_file_is_set_aside_and_what_fits_is_kept(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    broker = broker_process(store=store).start()
    with Producer(broker.address) as producer, PullConsumer(broker.address, "billing") as c:
        producer.send(Message("orders", b"x"), queue_id=0)
        c.commit_offset("orders", 0, 1)
        c.commit_offset("orders", 2, 5)
        with AdminClient(broker.address) as admin:
            admin.create_topic("timed", 1)
        producer.send(Message("timed", b"first", delay=timedelta(seconds=0.2)))
        wait_for(lambda: _timed(broker.address) == [b"first"], timeout=10)
    assert broker.terminate() == 0
    _damage(store)

    broker = broker_process(store=store).start()  # starts: the bad entries are left out
    kept = {"billing": {"orders": {"0": 1, "2": 5}}}
    assert _config(store, "offsets.json")["offsets"] == kept  # saved at once, not at stop
    assert set(_config(store, "topics.json")["topics"]) >= {"orders"}
    with PullConsumer(broker.address, group="billing") as consumer:
        assert consumer.fetch_offset("orders", 0) == 1
        assert consumer.fetch_offset("orders", 2) == 5
        assert consumer.fetch_offset("orders", 1) == -1
    with AdminClient(broker.address) as admin:
        names = {t.topic for t in admin.topics()}
    assert "orders" in names and not {"bad/name", "zero"} & names
    config = store / "config"
    for name, dropped in [("offsets.json", 5), ("topics.json", 2)]:
        [aside] = config.glob(f"{name}.bad-*")
        assert "bad/name" in aside.read_text() or "None" in aside.read_text()
        warnings = [line for line in broker.output().splitlines() if f"/{name} is damaged" in line]
        assert len(warnings) == 1 and f"{dropped} entries dropped" in warnings[0], warnings
    [delay_aside] = config.glob("delay_offsets.json.bad-*")
    [tx_aside] = config.glob("transaction_offsets.json.bad-*")
    assert '"many"' in tx_aside.read_text()
    assert _config(store, "transaction_offsets.json")["check_offset"] >= 0
    assert delay_aside.read_text().endswith('"x": 2')
    [timer_aside] = config.glob("timer_checkpoint.json.bad-*")
    assert timer_aside.read_text() == '{"delivered_ms": "soon"'
    assert "nothing could be kept" in broker.output()
    # without its checkpoint the timer finds what it delivered in the log: not again
    with Producer(broker.address) as producer:
        producer.send(Message("timed", b"second", delay=timedelta(seconds=0.2)))
    wait_for(lambda: b"second" in _timed(broker.address), timeout=10)
    assert _timed(broker.address) == [b"first", b"second"]
    still_serving(broker.address)
    assert broker.terminate() == 0
    assert _config(store, "offsets.json")["offsets"] == kept
