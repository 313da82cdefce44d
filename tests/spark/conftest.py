"""One Spark session (local[*], UTC, the JDBC driver) shared by every Spark test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from txmq.spark.job import JDBC_JAR, session


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    s = session("local[*]", JDBC_JAR)
    yield s
    s.stop()
