"""The pytest fixtures of :mod:`txmq.testing` (see there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from txmq.testing.broker import InProcessBroker

__all__ = ["PERSIST_INTERVAL_S", "txmq_broker", "txmq_broker_settings"]

#: how often push consumers commit their offsets under the fixtures
PERSIST_INTERVAL_S = "0.05"


@pytest.fixture
def txmq_broker_settings() -> dict[str, Any]:
    """Settings of the test's broker (override it: ``{"delay_levels": "1s 2s", ...}``)."""
    return {}


@pytest.fixture
def txmq_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, txmq_broker_settings: dict[str, Any]
) -> Iterator[InProcessBroker]:
    """A broker in this process for one test, the default of the clients it makes."""
    broker = InProcessBroker(tmp_path / "txmq-store", **txmq_broker_settings)
    monkeypatch.delenv("TXMQ_NAMESRV_ADDR", raising=False)
    for key, value in broker.environment().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TXMQ_PERSIST_INTERVAL_S", PERSIST_INTERVAL_S)
    with broker:
        yield broker
