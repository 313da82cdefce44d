"""The TCP proxy of the partition tests (:class:`TcpProxy`): it lives in
``bench/tcp_proxy.py``, which the failover benchmark uses too (the benchmarks import
nothing from ``tests/``); see there for its states and controls."""

from __future__ import annotations

from bench.tcp_proxy import TcpProxy

__all__ = ["TcpProxy"]
