"""A real etcd cluster on loopback for the controllers-on-etcd tests: the launcher
(:class:`EtcdCluster`, :class:`EtcdMember`, :func:`start_cluster`) lives in
``bench/etcd_cluster.py``, which the failover benchmark uses too (the benchmarks import
nothing from ``tests/``); see there for the members, ports, folders and timing.  Here: the
pytest fixture :func:`etcd_cluster`, and :func:`start_cluster` failing the test (rather
than erroring) when etcd is not installed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.etcd_cluster import ETCD, EtcdCluster, EtcdMember, etcd_available, start_cluster_in
from bench.etcd_cluster import start_cluster as _start_cluster

__all__ = ["EtcdCluster", "EtcdMember", "etcd_cluster", "start_cluster"]


def _require_etcd() -> None:
    if not etcd_available():
        pytest.fail(
            f"etcd not found ({ETCD}): apt-get install etcd-server (scripts/test.sh does)",
            pytrace=False,
        )


def start_cluster(tmp_path: Path, members: int = 3, **kwargs: Any) -> EtcdCluster:
    """:func:`bench.etcd_cluster.start_cluster` (same arguments); fails the test if etcd is
    not installed."""
    _require_etcd()
    return _start_cluster(tmp_path, members, **kwargs)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """Factory: ``etcd_cluster(members=3, *, heartbeat_ms=100, election_ms=1000,
    extra_args=None, timeout=30.0)`` starts a cluster (data dirs ``m<i>/`` and logs
    ``m<i>.log`` in ``<tmp_path>/etcd<n>/``; a port taken before etcd bound it: once more,
    in the next folder) and returns once every member is healthy; at the end every member
    still running (paused or not) is SIGKILLed by PID."""
    made: list[EtcdCluster] = []

    def make(members: int = 3, **kwargs: Any) -> EtcdCluster:
        _require_etcd()
        cluster = start_cluster_in(tmp_path, members, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop_all()
