from __future__ import annotations

from pathlib import Path

import pytest

from txmq.broker.state.config import BrokerConfig
from txmq.broker.store import FlushMode
from txmq.namesrv import ControllerConfig
from txmq.protocol.settings import SettingsError


def test_toml_then_env_then_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[broker]\nport = 12000\nflush = "sync"\nauto-create-topic = false\n')
    c = BrokerConfig.load(cfg, env={"TXMQ_BROKER_PORT": "12001"}, store=tmp_path / "s")
    assert (c.port, c.flush, c.auto_create_topic, c.store) == (
        12001,
        FlushMode.SYNC,
        False,
        tmp_path / "s",
    )
    assert BrokerConfig.load(cfg, env={}, port=5).port == 5


def test_bad_configuration_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text("[broker]\nportt = 1\n")
    with pytest.raises(SettingsError, match="unknown key 'portt'"):
        BrokerConfig.load(cfg, env={})
    with pytest.raises(SettingsError, match="TXMQ_BROKER_PORT"):
        BrokerConfig.load(env={"TXMQ_BROKER_PORT": "ten"})
    with pytest.raises(SettingsError, match="flush"):
        BrokerConfig.load(env={"TXMQ_BROKER_FLUSH": "sometimes"})
    with pytest.raises(SettingsError, match="port"):
        BrokerConfig(port=70000)
    assert BrokerConfig(store=str(tmp_path / "s")).store == tmp_path / "s"  # a str will do
    with pytest.raises(SettingsError, match="store must be a path, not int"):
        BrokerConfig(store=7)  # type: ignore[arg-type]
    cfg.write_text("not toml [")
    with pytest.raises(SettingsError, match="not valid TOML"):
        BrokerConfig.load(cfg, env={})


def test_disk_max_used_ratio_is_a_share_read_from_toml_and_env(tmp_path: Path) -> None:
    assert BrokerConfig().disk_max_used_ratio == 0.90  # RocketMQ's diskSpaceWarningLevelRatio
    cfg = tmp_path / "broker.toml"
    cfg.write_text("[broker]\ndisk_max_used_ratio = 0.8\n")
    c = BrokerConfig.load(cfg, env={})
    assert (c.disk_max_used_ratio, c.store_config().disk_max_used_ratio) == (0.8, 0.8)
    env = {"TXMQ_BROKER_DISK_MAX_USED_RATIO": "1", "TXMQ_BROKER_DISK_CHECK_INTERVAL_S": "0.5"}
    c = BrokerConfig.load(env=env)
    assert (c.disk_max_used_ratio, c.disk_check_interval_s) == (1.0, 0.5)
    for bad in (0, -0.1, 1.01, 90):
        with pytest.raises(SettingsError, match="disk_max_used_ratio must be above 0"):
            BrokerConfig(disk_max_used_ratio=bad)
    with pytest.raises(SettingsError, match="disk_check_interval_s"):
        BrokerConfig(disk_check_interval_s=0)


@pytest.mark.parametrize(
    ("setting", "bad", "says"),
    [
        ("replication", "SYNC_MASTER", "replication must be 'async'"),
        ("ha_port", -2, "ha_port -2"),
        ("ha_port", 70000, "ha_port 70000"),
        ("ha_master_address", "nohost", "ha_master_address"),
        ("ha_advertised_address", "nohost", "ha_advertised_address"),
        ("sync_replication_timeout_s", 0, "sync_replication_timeout_s must be positive"),
        ("ha_metadata_sync_interval_s", -1, "ha_metadata_sync_interval_s must be positive"),
        ("ha_in_sync_lag_s", 0, "ha_in_sync_lag_s must be positive"),
        ("controller", "nohost", "controller: 'nohost' is not HOST:PORT"),
        ("controller_heartbeat_interval_s", 0, "controller_heartbeat_interval_s"),
        ("controller_heartbeat_interval_s", 11, "controller_heartbeat_interval_s"),
        ("access_message_in_memory_max_ratio", -0.1, "access_message_in_memory_max_ratio"),
        ("access_message_in_memory_max_ratio", 1.5, "access_message_in_memory_max_ratio"),
    ],
)
def test_bad_replication_settings_are_clear_errors(setting: str, bad: object, says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        BrokerConfig(**{setting: bad})  # type: ignore[arg-type]
    assert BrokerConfig(replication="sync", ha_port=0).replication == "sync"


@pytest.mark.parametrize(
    ("setting", "bad", "says"),
    [
        ("port", 70000, "port 70000"),
        ("lease_s", 0, "lease_s must be positive and shorter than heartbeat_timeout_s"),
        ("lease_s", 5, "lease_s must be positive and shorter than heartbeat_timeout_s"),
        ("reconnect_grace_s", -1, "reconnect_grace_s must not be negative"),
        ("unclean_election_after_s", -1, "unclean_election_after_s must not be negative"),
        ("etcd", "e1", "etcd endpoint 'e1' is not HOST:PORT"),
        ("etcd", "e1:99999", "etcd endpoint 'e1:99999' is not HOST:PORT"),
        ("etcd", " , ", "--etcd needs at least one endpoint"),
        ("etcd_lease_s", 0, "etcd_lease_s must be at least 1"),
    ],
)
def test_bad_controller_settings_are_clear_errors(setting: str, bad: object, says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        ControllerConfig(**{setting: bad})  # type: ignore[arg-type]
    env = {"TXMQ_CONTROLLER_LEASE_S": "1.5", "TXMQ_CONTROLLER_STORE": "/tmp/ctl"}
    loaded = ControllerConfig.load(env=env)
    assert (loaded.lease_s, loaded.store) == (1.5, Path("/tmp/ctl"))
    with pytest.raises(SettingsError, match="lease_s"):
        ControllerConfig.load(env={"TXMQ_CONTROLLER_LEASE_S": "soon"})
    with pytest.raises(SettingsError, match="all_ack_in_sync"):
        BrokerConfig.load(env={"TXMQ_BROKER_ALL_ACK_IN_SYNC": "maybe"})
    etcd = ControllerConfig(etcd="http://e1:2379, e2:2379")
    assert etcd.etcd_lease_s == 1  # (etcd grants its shortest if longer)


def test_dedupe_settings_are_read_and_checked() -> None:
    c = BrokerConfig()
    assert (c.dedupe_window_s, c.dedupe_max_entries) == (120.0, 500_000)
    env = {"TXMQ_BROKER_DEDUPE_WINDOW_S": "0", "TXMQ_BROKER_DEDUPE_MAX_ENTRIES": "1000"}
    c = BrokerConfig.load(env=env)
    assert (c.dedupe_window_s, c.dedupe_max_entries) == (0.0, 1000)  # 0: off
    for bad in (-1, 86_401, float("nan")):
        with pytest.raises(SettingsError, match="dedupe_window_s must be between 0"):
            BrokerConfig(dedupe_window_s=bad)
    for bad_count in (0, -5, 100_000_001):
        with pytest.raises(SettingsError, match="dedupe_max_entries must be between 1"):
            BrokerConfig(dedupe_max_entries=bad_count)
    with pytest.raises(SettingsError, match="TXMQ_BROKER_DEDUPE_MAX_ENTRIES"):
        BrokerConfig.load(env={"TXMQ_BROKER_DEDUPE_MAX_ENTRIES": "many"})


@pytest.mark.parametrize("bad", ["0", "0.5", "3601", "-60"])
def test_the_acl_time_window_is_between_a_second_and_an_hour(bad: str) -> None:
    """``acl_time_window_s`` (how far a signed request's time may be from the server's):
    from the environment or the file, outside 1-3600 s is refused at start."""
    with pytest.raises(SettingsError, match="acl_time_window_s must be between 1 and 3600"):
        BrokerConfig.load(env={"TXMQ_BROKER_ACL_TIME_WINDOW_S": bad})
    ok = BrokerConfig.load(env={"TXMQ_BROKER_ACL_TIME_WINDOW_S": "5"})
    assert ok.acl_time_window_s == 5.0


def test_a_controller_on_etcd_behind_a_wildcard_needs_an_advertised_address() -> None:
    from txmq.namesrv.config import controller_address

    with pytest.raises(SettingsError, match="needs advertised_address"):
        controller_address("0.0.0.0", 9878, "")
    assert controller_address("0.0.0.0", 9878, "c1:9878") == "c1:9878"
    assert controller_address("127.0.0.1", 9878, "") == "127.0.0.1:9878"
