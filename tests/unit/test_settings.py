from __future__ import annotations

from pathlib import Path

import pytest

from txmq.broker.config import BrokerConfig
from txmq.broker.store import FlushMode
from txmq.settings import SettingsError


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
