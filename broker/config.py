"""Broker settings: a frozen dataclass read from TOML ``[broker]`` and ``TXMQ_BROKER_*``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.store import FlushMode, StoreConfig
from txmq.protocol import DEFAULT_MAX_FRAME_SIZE
from txmq.settings import SettingsError, load_settings

__all__ = ["BrokerConfig"]


@dataclass(frozen=True)
class BrokerConfig:
    store: Path = Path("./txmq-store")
    host: str = "127.0.0.1"
    port: int = 10911
    flush: FlushMode = FlushMode.ASYNC
    auto_create_topic: bool = True
    default_queue_nums: int = 4
    max_message_size: int = 4 * 1024 * 1024
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    segment_size: int = 256 * 1024 * 1024
    cq_entries_per_file: int = 300_000
    flush_interval_ms: int = 500
    sync_flush_timeout_s: float = 5.0
    retention_hours: float = 72.0
    long_polling_max_s: float = 30.0
    offset_persist_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} is not between 0 and 65535")
        if not 1 <= self.default_queue_nums <= 1024:
            raise SettingsError("default_queue_nums must be between 1 and 1024")
        if self.max_message_size <= 0 or self.max_message_size + 65536 > self.max_frame_size:
            raise SettingsError(
                "max_message_size must be positive and at least 64 KiB below max_frame_size"
            )
        if self.segment_size < self.max_message_size + 4096:
            raise SettingsError(
                "segment_size must exceed max_message_size by at least 4096 bytes "
                "(a record never spans two segments)"
            )

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> BrokerConfig:
        return load_settings(
            cls,
            file=file,
            section="broker",
            env_prefix="TXMQ_BROKER_",
            env=env,
            overrides=overrides,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            root=self.store,
            segment_size=self.segment_size,
            cq_entries_per_file=self.cq_entries_per_file,
            flush_mode=self.flush,
            flush_interval_ms=self.flush_interval_ms,
            retention_hours=self.retention_hours,
            max_message_size=self.max_message_size,
        )
