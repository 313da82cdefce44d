"""The gRPC proxy's pieces without a cluster: names that carry their broker set (transaction
ids, receipt handles), the producer registry that hands check-backs on, and its settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import CheckTransactionState
from txmq.protocol.wire.errors import InvalidReceiptHandle
from txmq.proxy import ProxyConfig
from txmq.proxy.pops import split_handle
from txmq.proxy.producers import ProxyProducers
from txmq.server.grpc import parse_transaction_id, transaction_id
from txmq.server.grpc.telemetry import Session


def test_a_transaction_id_names_its_broker_set_unless_it_is_the_endpoints_own() -> None:
    assert transaction_id(4096) == "0000000000001000"
    assert transaction_id(4096, "broker-b") == "broker-b:0000000000001000"
    assert parse_transaction_id("broker-b:0000000000001000") == ("broker-b", 4096)
    assert parse_transaction_id("0000000000001000") == ("", 4096)
    for bad in ("", "not-hex", "broker-b:", "0x10", "1" * 17, " 10", "b:+1"):
        with pytest.raises(ValueError):
            parse_transaction_id(bad)


def test_a_check_back_through_a_proxy_names_the_broker_set_that_asks() -> None:
    check = CheckTransactionState(transaction_offset=4096, topic="t", broker_name="broker-b")
    from tests.unit.test_grpc_endpoint_units import half_record

    own = Session("c1", "peer", home="broker-b")  # a broker's endpoint: its own set
    own.send_oneway(check, half_record())
    assert own.queue.get_nowait().recover_orphaned_transaction_command.transaction_id == (
        "0000000000001000"
    )
    proxied = Session("c1", "peer")  # a proxy's: every set named
    proxied.send_oneway(check, half_record())
    cmd = proxied.queue.get_nowait().recover_orphaned_transaction_command
    assert cmd.transaction_id == "broker-b:0000000000001000"


def test_a_proxys_receipt_handle_is_its_broker_sets_name_and_the_brokers_handle() -> None:
    assert split_handle("broker-a:0a1b2c3d:1f:0:42:4096:orders") == (
        "broker-a",
        "0a1b2c3d:1f:0:42:4096:orders",
    )
    for bad in ("", "forged", ":x", "broker-a:"):
        with pytest.raises(InvalidReceiptHandle, match="BROKER:HANDLE"):
            split_handle(bad)


class _Stream:
    def __init__(self) -> None:
        self.closed = False
        self.got: list[Any] = []

    def send_oneway(self, request: Any, body: bytes = b"") -> None:
        self.got.append(request)


def test_check_backs_go_round_robin_to_the_open_sessions_of_the_group() -> None:
    changes: list[tuple[str, bool]] = []
    producers = ProxyProducers(lambda group, joined: changes.append((group, joined)))
    a, b, gone = _Stream(), _Stream(), _Stream()
    producers.register("payments", "a", a)
    producers.register("payments", "b", b)
    producers.register("payments", "a", a)  # a heartbeat: no change
    producers.register("orders", "gone", gone)
    gone.closed = True
    assert changes == [("payments", True), ("orders", True)]
    assert producers.groups() == ["orders", "payments"]
    check = CheckTransactionState(transaction_offset=1, group="payments")
    assert all(producers.check_back(check, b"") for _ in range(4))
    assert len(a.got) == len(b.got) == 2
    assert not producers.check_back(
        CheckTransactionState(transaction_offset=1, group="orders"), b""
    )
    assert not producers.check_back(CheckTransactionState(transaction_offset=1, group="x"), b"")
    producers.unregister("payments", "a")
    producers.unregister("payments", "b")
    producers.unregister("payments", "b")  # twice: nothing more
    assert changes[-1] == ("payments", False) and producers.groups() == ["orders"]


def test_proxy_settings(tmp_path: Path) -> None:
    cfg = ProxyConfig.load(env={"TXMQ_PROXY_NAMESRV": "h1:9876;h2:9876"})
    assert cfg.namesrv_addresses == ("h1:9876", "h2:9876") and cfg.grpc_port == 8081
    assert cfg.retry_delays_ms[:2] == (10_000, 30_000)  # RocketMQ's levels 3 and 4
    assert cfg.peer_security().credentials is None
    file = tmp_path / "txmq.toml"
    file.write_text(
        '[proxy]\nnamesrv = "ns:9876"\naccess_key = "proxy"\nsecret_key = "s3cret-key"\n'
    )
    cfg = ProxyConfig.load(file, grpc_port=0, message_delay_levels="1s 1s 2s")
    assert cfg.grpc_port == 0 and cfg.retry_delays_ms == (2000,)
    assert cfg.peer_security().access_key == "proxy" and "s3cret" not in repr(cfg)
    for bad, why in (
        ({"namesrv": "ns"}, "HOST:PORT"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"access_key": "proxy"}, "go together"),
        ({"advertised_address": "nowhere"}, "advertised_address"),
        ({"tls_ca": "ca.pem"}, "tls_ca"),
    ):
        with pytest.raises(SettingsError, match=why):
            ProxyConfig.load(env={"TXMQ_PROXY_NAMESRV": "ns:9876"}, **bad)


def test_a_proxy_without_name_servers_says_what_to_give() -> None:
    pytest.importorskip("rocketmq")
    from txmq.proxy import Proxy

    with pytest.raises(SettingsError, match="--namesrv"):
        Proxy(ProxyConfig())
