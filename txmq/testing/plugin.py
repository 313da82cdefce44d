"""The pytest fixtures of :mod:`txmq.testing` (see there)."""

from __future__ import annotations

import os
import shutil
import tempfile
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
    """A broker in this process for one test, the default of the clients it makes.  Its
    store is in memory (``/dev/shm``, where there is one: a test's broker needs no fsync to
    a disk), else in the test's temporary folder."""
    shm = Path("/dev/shm")
    in_memory = shm.is_dir() and os.access(shm, os.W_OK)
    store = Path(tempfile.mkdtemp(prefix="txmq-test-", dir=shm)) if in_memory else tmp_path
    broker = InProcessBroker(store / "txmq-store", **txmq_broker_settings)
    monkeypatch.delenv("TXMQ_NAMESRV_ADDR", raising=False)
    for key, value in broker.environment().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TXMQ_PERSIST_INTERVAL_S", PERSIST_INTERVAL_S)
    try:
        with broker:
            yield broker
    finally:
        if in_memory:
            shutil.rmtree(store, ignore_errors=True)
