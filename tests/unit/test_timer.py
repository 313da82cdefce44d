"""Timer messages: the client's deliver_at / delay, the horizon setting, the wheel."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from txmq.broker.delivery.timer import TimerWheel
from txmq.broker.state.config import BrokerConfig
from txmq.protocol.message import Message, Prop
from txmq.protocol.settings import SettingsError


def test_deliver_at_and_delay_become_the_delivery_time_property() -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    props = Message("t", b"x", deliver_at=at).wire_properties("id")
    assert props[Prop.DELIVER_AT] == str(int(at.timestamp() * 1000))
    before = time.time_ns() // 1_000_000
    props = Message("t", b"x", delay=timedelta(seconds=90)).wire_properties("id")
    assert before + 90_000 <= int(props[Prop.DELIVER_AT]) <= before + 91_000
    assert Prop.DELIVER_AT not in Message("t", b"x").wire_properties("id")


@pytest.mark.parametrize(
    "kw",
    [
        {"delay": timedelta(seconds=1), "deliver_at": datetime.now(UTC)},
        {"delay": timedelta(seconds=1), "delay_level": 3},
        {"delay": timedelta(seconds=-1)},
    ],
)
def test_bad_delivery_times_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Message("t", b"x", **kw).wire_properties("id")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Message("t", b"x", delay=5).wire_properties("id")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, 30 * 86_400 + 1])
def test_timer_max_delay_must_be_sane(tmp_path: Path, bad: int) -> None:
    with pytest.raises(SettingsError, match="timer_max_delay_s"):
        BrokerConfig(store=tmp_path, timer_max_delay_s=bad)
    assert BrokerConfig(store=tmp_path).timer_max_delay_s == 3 * 86_400


def test_wheel_gives_due_timers_in_time_then_offset_order() -> None:
    wheel = TimerWheel()
    for e in [(5_500, 9, 1, 0), (1_200, 7, 1, 1), (5_100, 3, 1, 2), (1_200, 2, 1, 3)]:
        wheel.add(e)
    assert wheel.next_due() == 1_200
    assert wheel.take(5_200, 10) == [(1_200, 2, 1, 3), (1_200, 7, 1, 1), (5_100, 3, 1, 2)]
    assert wheel.count == 1 and wheel.next_due() == 5_500
    wheel.add((5_050, 1, 1, 4))  # into the slot being delivered
    assert wheel.take(6_000, 1) == [(5_050, 1, 1, 4)]
    assert wheel.take(6_000, 5) == [(5_500, 9, 1, 0)]
    assert wheel.next_due() is None and wheel.count == 0
