"""Delay levels: parsing ``message_delay_levels`` and the queue-lock table's rules."""

from __future__ import annotations

import pytest

from txmq.broker.state.config import DEFAULT_DELAY_LEVELS, BrokerConfig, parse_delay_levels
from txmq.broker.state.locks import RebalanceLockManager
from txmq.protocol.settings import SettingsError


def test_default_levels_are_rocketmqs() -> None:
    levels = parse_delay_levels(DEFAULT_DELAY_LEVELS)
    assert len(levels) == 18
    assert levels[:5] == (1000, 5000, 10_000, 30_000, 60_000)
    assert levels[-1] == 2 * 3_600_000
    assert BrokerConfig().delay_levels == levels


def test_units_and_separators() -> None:
    assert parse_delay_levels("10ms 1s  2m\t1h 1d") == (10, 1000, 120_000, 3_600_000, 86_400_000)
    assert parse_delay_levels("1.5s,250ms") == (1500, 250)
    assert parse_delay_levels("5S 3MS") == (5000, 3)


@pytest.mark.parametrize("bad", ["", "   ", "1x", "10", "s", "0s", "0ms", "-1s", "1s two"])
def test_bad_levels_name_the_setting(bad: str) -> None:
    with pytest.raises(SettingsError, match="message_delay_levels"):
        parse_delay_levels(bad)
    with pytest.raises(SettingsError, match="message_delay_levels"):
        BrokerConfig(message_delay_levels=bad)


def test_levels_from_environment_and_other_new_settings() -> None:
    cfg = BrokerConfig.load(
        env={
            "TXMQ_BROKER_MESSAGE_DELAY_LEVELS": "10ms 20ms 30ms",
            "TXMQ_BROKER_LOCK_EXPIRY_S": "2.5",
            "TXMQ_BROKER_CONSUMER_CHANNEL_EXPIRY_S": "7",
        }
    )
    assert cfg.delay_levels == (10, 20, 30)
    assert (cfg.lock_expiry_s, cfg.consumer_channel_expiry_s) == (2.5, 7.0)
    with pytest.raises(SettingsError, match="lock_expiry_s"):
        BrokerConfig(lock_expiry_s=0)
    with pytest.raises(SettingsError, match="consumer_channel_expiry_s"):
        BrokerConfig(consumer_channel_expiry_s=-1)


def test_lock_table_rules() -> None:
    now = [100.0]
    locks = RebalanceLockManager(60.0, clock=lambda: now[0])
    a, b = ("t", 0), ("t", 1)
    assert locks.try_lock_batch("g", [a, b], "c1") == [a, b]
    assert locks.try_lock_batch("g", [a, b, ("t", 2)], "c2") == [("t", 2)]
    assert locks.try_lock_batch("other-group", [a], "c2") == [a]  # groups are separate
    now[0] += 59
    assert locks.try_lock_batch("g", [a], "c1") == [a]  # renewed
    now[0] += 30  # b is now 89 s old, a 30 s
    assert locks.try_lock_batch("g", [a, b], "c2") == [b]
    assert locks.owner("g", a) == "c1" and locks.owner("g", b) == "c2"
    assert locks.unlock_batch("g", [a], "c2") == 0  # not the owner
    assert locks.unlock_batch("g", [a], "c1") == 1
    assert locks.owner("g", a) is None
    assert locks.try_lock_batch("g", [a], "c2") == [a]
    assert locks.is_locked("g", a, "c2") and not locks.is_locked("g", a, "c1")
